"""A Spark standalone cluster on the multi-host bed (see bed.py): the master in the root
namespace, bound to the bridge address (as a cluster's master node that every machine
reaches), one worker per host, bound to that host's address, and drivers started with
``spark-submit`` in the root namespace (``spark.driver.host`` = the bridge address), the way a
user submits from a login node.

Every JVM is started here in the foreground (``spark-class``, no ``spark-daemon.sh``), so the
bed knows each one: the workers and the executors they start run inside their host and die
with it (:meth:`Bed.signal_host`, :meth:`Bed.close`); the master and drivers are killed by
:meth:`SparkBed.close`. Memory is kept small: the machine that runs the suite has two cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bed import Bed, Host

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
_MASTER_PORT = 7077       # on the bed's own bridge address: no other process binds it
_MASTER_UI_PORT = 8080
_WORKER_UI_PORT = 8081    # inside each host namespace


def spark_home() -> Path:
    import pyspark
    return Path(pyspark.__file__).resolve().parent


def base_env(tmp: Path, local_ip: str) -> dict[str, str]:
    """The environment of a Spark JVM (or spark-submit) that binds to ``local_ip``: the test's
    environment less spark_hvd/Horovod/Spark settings of the developer's shell."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPARK_HVD_", "HOROVOD_", "PYSPARK_", "SPARK_"))}
    env.update({
        "PYSPARK_PYTHON": PY, "PYSPARK_DRIVER_PYTHON": PY, "SPARK_HOME": str(spark_home()),
        # Addresses, not the hosts' names: the root namespace (driver, master) cannot resolve
        # the hosts' names, and Spark advertises SPARK_LOCAL_HOSTNAME to its peers.
        "SPARK_LOCAL_IP": local_ip, "SPARK_LOCAL_HOSTNAME": local_ip,
        "SPARK_DAEMON_MEMORY": "256m", "SPARK_LOG_DIR": str(tmp / "logs"),
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1",
    })
    return env


class SparkBed:
    """A standalone master (root namespace) and one worker per host of ``bed``."""

    def __init__(self, bed: Bed, tmp: Path, worker_cores: int = 2,
                 worker_memory: str = "1g", worker_addr=None):
        self.bed = bed
        self.tmp = tmp
        self.worker_cores = worker_cores
        self.worker_memory = worker_memory
        # The address each worker binds to (default: its host's bridge address).
        self.worker_addr = worker_addr or (lambda host: host.addr)
        self.master_url = f"spark://{bed.bridge_addr}:{_MASTER_PORT}"
        self.master: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.drivers: list[subprocess.Popen] = []
        (tmp / "logs").mkdir(parents=True, exist_ok=True)

    # -- the cluster ------------------------------------------------------------------------

    def _class_argv(self, cls: str, *args) -> list[str]:
        return ["bash", str(spark_home() / "bin" / "spark-class"), cls, *map(str, args)]

    def _log(self, name: str):
        return open(self.tmp / "logs" / f"{name}.log", "ab")

    def start(self, timeout: float = 90) -> "SparkBed":
        """Starts the master and every worker; returns once all workers registered."""
        with self._log("master") as log:
            self.master = subprocess.Popen(
                self._class_argv(MASTER_CLASS, "--host", self.bed.bridge_addr, "--port",
                                 _MASTER_PORT, "--webui-port", _MASTER_UI_PORT),
                env=base_env(self.tmp, self.bed.bridge_addr), stdout=log, stderr=log,
                start_new_session=True)
        for host in self.bed.hosts:
            self.start_worker(host)
        self.wait_workers(len(self.bed.hosts), timeout)
        return self

    def start_worker(self, host: Host) -> subprocess.Popen:
        """(Re)starts ``host``'s worker, bound to its address."""
        addr = self.worker_addr(host)
        work = self.tmp / f"work-{host.name}"
        work.mkdir(exist_ok=True)
        env = base_env(self.tmp, addr)
        env["SPARK_LOCAL_DIRS"] = str(work)
        with self._log(f"worker-{host.name}") as log:
            proc = self.bed.popen(host, self._class_argv(
                WORKER_CLASS, "--host", addr, "--cores", self.worker_cores, "--memory",
                self.worker_memory, "--webui-port", _WORKER_UI_PORT, "--work-dir", work,
                self.master_url), env=env, stdout=log, stderr=log)
        self.workers[host.name] = proc
        return proc

    def master_state(self) -> dict:
        url = f"http://{self.bed.bridge_addr}:{_MASTER_UI_PORT}/json/"
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())

    def alive_workers(self) -> list[str]:
        """The hosts (addresses) of the workers the master sees alive."""
        try:
            state = self.master_state()
        except (OSError, ValueError):
            return []
        return sorted(w["host"] for w in state.get("workers", []) if w.get("state") == "ALIVE")

    def wait_workers(self, n: int, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while len(self.alive_workers()) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} Spark workers did not register within {timeout} s "
                                   f"(alive: {self.alive_workers()})\n{self.logs()}")
            if self.master is not None and self.master.poll() is not None:
                raise RuntimeError(f"the Spark master exited\n{self.logs()}")
            time.sleep(0.5)

    # -- applications -----------------------------------------------------------------------

    def submit(self, script, *args, confs=(), stdout=None, stderr=None) -> subprocess.Popen:
        """``spark-submit`` of ``script`` from the root namespace (the driver binds to the
        bridge address); killed by :meth:`close` if still running."""
        argv = [str(Path(PY).parent / "spark-submit"), "--master", self.master_url,
                "--conf", f"spark.driver.host={self.bed.bridge_addr}",
                "--conf", f"spark.driver.bindAddress={self.bed.bridge_addr}",
                "--conf", "spark.ui.enabled=false",
                "--conf", f"spark.local.dir={self.tmp / 'driver-local'}",
                "--conf", "spark.driver.memory=512m", "--conf", "spark.executor.memory=512m"]
        for c in confs:
            argv += ["--conf", c]
        proc = subprocess.Popen(argv + [str(script), *map(str, args)],
                                env=base_env(self.tmp, self.bed.bridge_addr), cwd=REPO,
                                stdout=stdout or subprocess.PIPE,
                                stderr=stderr or subprocess.PIPE, text=True,
                                start_new_session=True)
        self.drivers.append(proc)
        return proc

    def logs(self, tail: int = 3000) -> str:
        """The last lines of every log of the cluster's daemons and executors."""
        files = sorted((self.tmp / "logs").glob("*.log"))
        files += sorted(self.tmp.glob("work-*/app-*/*/stderr"))
        return "\n".join(f"--- {f.relative_to(self.tmp)}\n{f.read_text(errors='replace')[-tail:]}"
                         for f in files)

    def close(self) -> None:
        """Kills the drivers and the master (the bed kills what runs in its hosts)."""
        for proc in [*self.drivers, self.master]:
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in [*self.drivers, self.master]:
            if proc is not None:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass

    def leftovers(self) -> list[str]:
        return [f"process {p.pid} {p.args[:4]}" for p in [*self.drivers, self.master]
                if p is not None and p.poll() is None]


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float) -> str:
    """The contents of ``path`` once a driver wrote it; fails if ``proc`` ends first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise RuntimeError(f"the driver exited ({proc.returncode}) before writing {path}"
                               f"\n{out[-4000:]}\n{err[-8000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the driver did not write {path} within {timeout} s")
        time.sleep(0.2)
    return path.read_text()

