"""Workers as processes, on this machine or over ssh: the elastic driver's spawner for
``spark-hvd-run`` and ``spark_hvd.run`` (Spark's slot jobs plug in the same way).

Each worker starts as a static rank does (``launch/spawn.py``: its own process group, the
secret on ssh's stdin, the parent-death signal) with the elastic environment (see
:func:`elastic_env`). A waiter thread reports its exit to the driver; an ssh exit code of 255
is reported as a connection failure (the host is lost, not the process). Output lines carry the
worker's current rank (``[2]<stdout>: ...``): the driver's, which changes from round to round.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from spark_hvd.common import _bootstrap_contract as contract
from spark_hvd.launch.elastic.driver import Spawner, WorkerSpec
from spark_hvd.launch.environment import number, rank_env
from spark_hvd.launch.output import forward
from spark_hvd.launch.spawn import spawn
from spark_hvd.launch.supervise import stop_leftovers


def elastic_env(base: dict[str, str], spec: WorkerSpec, *, rendezvous_addr: str, secret_hex: str,
                job_id: str, bind_addr: str, start_timeout: float, elastic_timeout: float,
                config: dict[str, str]) -> dict[str, str]:
    """A worker's environment: the static rank's (``rank_env``, with the place planned for it),
    the elastic variables, and Horovod's names of its place (``HOROVOD_RANK``, ...,
    ``HOROVOD_HOSTNAME``, ``HOROVOD_ELASTIC``), which Horovod's elastic scripts read."""
    env = rank_env(base, spec.planned, rendezvous_addr=rendezvous_addr, secret_hex=secret_hex,
                   job_id=job_id, bind_addr=bind_addr, start_timeout=start_timeout,
                   config=config)
    env[contract.ELASTIC] = "1"
    env[contract.ELASTIC_WORKER_ID] = spec.wid
    env[contract.ELASTIC_TIMEOUT] = number(elastic_timeout)
    env["HOROVOD_ELASTIC"] = "1"
    for ours, horovods in contract.HOROVOD_MIRRORS.items():
        env[horovods] = env[ours]
    return env


class ProcessSpawner(Spawner):
    """Starts workers as processes (see the module's docstring).

    Args:
        command: what each worker runs.
        env_for: ``spec -> environment`` (:func:`elastic_env` with the job's settings).
        post: the driver's ``post``.
        is_local: ``host -> bool``: start it here, or over ssh.
        rank_of: ``wid -> current rank`` for the output prefix.
        out, err: the launcher's ``LineSink`` s; ``output_dir``: per-worker copies
            (``worker.<host>.<slot>.<seq>/``); ``timestamp``: prefix lines with the time.
    """

    def __init__(self, command, env_for, post, is_local, rank_of, out, err, *, cwd=None,
                 output_dir=None, timestamp=False, ssh_port=None, ssh_identity_file=None,
                 connect_timeout=None, grace_seconds=5.0):
        self.command = list(command)
        self.env_for = env_for
        self.post = post
        self.is_local = is_local
        self.rank_of = rank_of
        self.out, self.err = out, err
        self.cwd = cwd or os.getcwd()
        self.output_dir = output_dir
        self.timestamp = timestamp
        self.ssh_port = ssh_port
        self.ssh_identity_file = ssh_identity_file
        self.connect_timeout = connect_timeout
        self.grace = grace_seconds
        self.procs = {}
        self._lock = threading.Lock()

    def spawn(self, spec: WorkerSpec) -> None:
        env = self.env_for(spec)
        remote = not self.is_local(spec.host)
        proc = spawn(spec.planned.rank, spec.host, self.command, env, self.cwd, remote=remote,
                     ssh_port=self.ssh_port, ssh_identity_file=self.ssh_identity_file,
                     connect_timeout=self.connect_timeout)
        wid = spec.wid
        label = lambda: self.rank_of(wid)  # noqa: E731
        dir_name = "worker." + wid.replace("/", ".")
        proc.output_threads = [
            forward(proc.popen.stdout, label, "stdout", self.out, self.output_dir,
                    self.timestamp, dir_name),
            forward(proc.popen.stderr, label, "stderr", self.err, self.output_dir,
                    self.timestamp, dir_name),
        ]
        with self._lock:
            self.procs[wid] = proc

        def wait():
            rc = proc.popen.wait()
            # Let the worker's last lines (a traceback) out before the driver reacts.
            for t in proc.output_threads:
                t.join(timeout=0.5)
            self.post(("exited", wid, rc, "ssh" if remote and rc == 255 else
                       ("signal" if rc < 0 else "exit")))

        threading.Thread(target=wait, name=f"spark-hvd-wait-{wid}", daemon=True).start()

    def stop(self, wid: str) -> None:
        with self._lock:
            proc = self.procs.get(wid)
        if proc is None or proc.popen.poll() is not None:
            return
        proc.close_stdin()  # a remote worker's watcher takes this as the order to stop
        proc.signal_group(signal.SIGTERM)

        def kill_later():
            deadline = time.monotonic() + self.grace
            while time.monotonic() < deadline:
                if proc.popen.poll() is not None:
                    return
                time.sleep(0.05)
            proc.signal_group(signal.SIGKILL)

        threading.Thread(target=kill_later, daemon=True, name=f"spark-hvd-kill-{wid}").start()

    def drain_output(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        for proc in list(self.procs.values()):
            for t in getattr(proc, "output_threads", ()):
                t.join(timeout=max(0.0, deadline - time.monotonic()))

    def stop_leftovers(self) -> None:
        """After every worker exited: stop what they started and left behind."""
        stop_leftovers(list(self.procs.values()), self.grace)
