"""spark_hvd.spark.run from spark-submit applications on multi-executor clusters (slow).

- ``local-cluster[2,1,1024]``: two executor JVMs of one core each.
- A real standalone cluster, master and two workers of two cores on 127.0.0.1, started here
  with Spark's ``sbin/spark-daemon.sh`` once for the module's last two tests and stopped after
  them whatever happens: four ranks, two per executor (local_size 2, cross_size 2).
- The documented example, ``spark-submit --master local[2] examples/spark/torch_run.py``.
- The TorchEstimator example with ``python`` and through spark-submit on the standalone cluster.

Each application runs with a timeout that kills everything it started.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import alive_pids

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

REPO = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "spark_workers" / "job.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _spark_home() -> Path:
    import pyspark
    return Path(pyspark.__file__).resolve().parent


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPARK_HVD_", "HOROVOD_", "PYSPARK_", "SPARK_"))}
    env.update({
        "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_HOME": str(_spark_home()), "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(tmp_path / "logs"), "SPARK_PID_DIR": str(tmp_path / "pids"),
        "SPARK_IDENT_STRING": f"spark_hvd_test_{os.getpid()}",
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    })
    return env


def _submit_args(master: str, tmp_path: Path, *confs: str) -> list[str]:
    args = [str(Path(sys.executable).parent / "spark-submit"), "--master", master,
            "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.ui.enabled=false",
            "--conf", f"spark.local.dir={tmp_path / 'local'}"]
    for c in confs:
        args += ["--conf", c]
    return args


def _run(args, env, timeout, cwd=REPO) -> subprocess.CompletedProcess:
    """Run ``args`` in its own session; on timeout kill the whole session and fail."""
    proc = subprocess.Popen([str(a) for a in args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{args} did not finish in {timeout} s\n{out[-5000:]}\n{err[-5000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _check_job(result: subprocess.CompletedProcess, report_path: Path, pid_dir: Path,
               executors: int, per_executor: int) -> dict:
    assert result.returncode == 0, f"{result.stdout[-5000:]}\n{result.stderr[-8000:]}"
    report = json.loads(report_path.read_text())
    ranks = report["results"]
    num_proc = executors * per_executor
    # Host-major ranks: each executor is a "host" with consecutive ranks.
    assert [(r["rank"], r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"])
            for r in ranks] == [(e * per_executor + k, k, per_executor, e, executors)
                                for e in range(executors) for k in range(per_executor)]
    assert all(r["sum"] == num_proc * (num_proc + 1) / 2 for r in ranks)
    # Output reached the driver from the executors, prefixed with the rank.
    for r in range(num_proc):
        assert f"[{r}]<stdout>: hello rank={r} tag=cluster" in result.stdout
    failure = report["failure"]
    assert failure is not None and failure["rank"] == num_proc - 1
    assert failure["kind"] == "user"
    assert f"ValueError: deliberate failure on rank {num_proc - 1}" in failure["message"]
    pids = [int(p) for f in pid_dir.glob("rank*.pids") for p in f.read_text().split()]
    assert len(pids) == 2 * num_proc
    assert alive_pids(pids, timeout=15.0) == []
    return report


def test_local_cluster_from_spark_submit(tmp_path):
    # Two executor JVMs of one core each (the standalone test below has two cores each).
    pid_dir = tmp_path / "rank_pids"
    pid_dir.mkdir()
    report_path = tmp_path / "report.json"
    args = _submit_args("local-cluster[2,1,1024]", tmp_path,
                        "spark.executor.memory=512m") + [JOB, report_path, 2, pid_dir]
    result = _run(args, _env(tmp_path), timeout=360)
    _check_job(result, report_path, pid_dir, executors=2, per_executor=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandaloneCluster:
    """A Spark standalone master and two workers (2 cores each) on 127.0.0.1."""

    MASTER = "org.apache.spark.deploy.master.Master"
    WORKER = "org.apache.spark.deploy.worker.Worker"

    def __init__(self, tmp_path: Path):
        self.env = _env(tmp_path)
        self.daemon = _spark_home() / "sbin" / "spark-daemon.sh"
        self.port = _free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.tmp = tmp_path
        self.started: list[tuple[str, int]] = []

    def _daemon(self, action, cls, instance, *args, timeout=60):
        return _run(["bash", self.daemon, action, cls, instance, *args], self.env, timeout)

    def start(self) -> None:
        r = self._daemon("start", self.MASTER, 1, "--host", "127.0.0.1", "--port", self.port,
                         "--webui-port", _free_port())
        assert r.returncode == 0, r.stdout + r.stderr
        self.started.append((self.MASTER, 1))
        for i in (1, 2):
            work = self.tmp / f"worker{i}"
            work.mkdir()
            r = self._daemon("start", self.WORKER, i, "--host", "127.0.0.1", "--cores", 2,
                             "--memory", "1g", "--webui-port", _free_port(), "--work-dir",
                             work, self.url)
            assert r.returncode == 0, r.stdout + r.stderr
            self.started.append((self.WORKER, i))

    def pids(self) -> list[int]:
        pids = []
        for f in (self.tmp / "pids").glob("*.pid"):
            try:
                pids.append(int(f.read_text().strip()))
            except ValueError:
                pass
        return pids

    def stop(self) -> None:
        pids = self.pids()
        for cls, instance in reversed(self.started):
            try:
                self._daemon("stop", cls, instance, timeout=30)
            except BaseException:  # noqa: BLE001 - killed below
                pass
        for pid in alive_pids(pids, timeout=10):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}"
                         for f in sorted((self.tmp / "logs").glob("*")))


def test_torch_example_with_spark_submit_local(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("spark_hvd.torch")
    args = _submit_args("local[2]", tmp_path) + [
        REPO / "examples" / "spark" / "torch_run.py", "--epochs", "2", "--train-samples", "2000",
        "--test-samples", "500"]
    result = _run(args, _env(tmp_path), timeout=360)
    assert result.returncode == 0, f"{result.stdout[-5000:]}\n{result.stderr[-8000:]}"
    final = [line for line in result.stdout.splitlines() if line.startswith("FINAL accuracy=")]
    assert final and final[0].endswith("ranks=2"), result.stdout[-3000:]
    assert float(final[0].split("=")[1].split()[0]) > 0.5, result.stdout[-3000:]
    assert "[0]<stdout>: epoch 2:" in result.stdout


ESTIMATOR_EXAMPLE = REPO / "examples" / "spark" / "torch_estimator_mnist.py"


def _check_estimator_example(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"{result.stdout[-5000:]}\n{result.stderr[-8000:]}"
    out = result.stdout
    assert "Epoch 2/2 - accuracy:" in out, out[-3000:]
    accuracy = [float(line.split()[-1]) for line in out.splitlines()
                if line.startswith("test accuracy:")]
    assert accuracy and accuracy[0] > 0.6, out[-3000:]
    assert "reloaded from" in out, out[-3000:]


def test_torch_estimator_example_with_python(tmp_path):
    pytest.importorskip("torch")
    result = _run([sys.executable, ESTIMATOR_EXAMPLE, "--rows", "3000", "--epochs", "2",
                   "--store", tmp_path / "store"], _env(tmp_path), timeout=360)
    _check_estimator_example(result)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    """One standalone cluster for this module's applications (starting one costs ~20 s of the
    two cores); stopped at the end whatever happens, and checked to leave no JVM behind."""
    cluster = StandaloneCluster(tmp_path_factory.mktemp("standalone"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
    assert alive_pids(cluster.pids(), timeout=1) == []


def test_standalone_cluster_from_spark_submit(standalone, tmp_path):
    pid_dir = tmp_path / "rank_pids"
    pid_dir.mkdir()
    report_path = tmp_path / "report.json"
    args = _submit_args(standalone.url, tmp_path, "spark.executor.cores=2",
                        "spark.cores.max=4", "spark.executor.memory=512m")
    result = _run(args + [JOB, report_path, 4, pid_dir], standalone.env, timeout=300)
    try:
        _check_job(result, report_path, pid_dir, executors=2, per_executor=2)
    except AssertionError:
        print(standalone.logs())
        raise


def test_torch_estimator_example_on_a_standalone_cluster(standalone, tmp_path):
    pytest.importorskip("torch")
    args = _submit_args(standalone.url, tmp_path, "spark.executor.cores=1", "spark.cores.max=2",
                        "spark.executor.memory=512m")
    result = _run(args + [ESTIMATOR_EXAMPLE, "--rows", "3000", "--epochs", "2", "--store",
                          tmp_path / "store"], standalone.env, timeout=360)
    try:
        _check_estimator_example(result)
    except AssertionError:
        print(standalone.logs())
        raise
