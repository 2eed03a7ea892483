"""Shared helpers for the tests that run real jobs through the real launcher.

A test starts ``python -m spark_hvd.runner -np N [-H ...] python tests/workers/<script>.py``,
waits for it (with a timeout that also kills every process the job started), and checks the
per-rank markers the worker prints (``OK rank=R ...``). Worker scripts run many checks per
launch and report every failure, so one launch covers a whole op x dtype x shape matrix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
PY = sys.executable

# Transports a job can be run over:
#   shm   - every rank on localhost, same-host pairs over shared memory (the default)
#   tcp   - every rank on localhost, shared memory disabled
#   hosts - ranks spread over two simulated hosts (127.0.0.1 and 127.0.0.2): TCP between the
#           "hosts", shared memory inside one
TRANSPORTS = ("shm", "tcp", "hosts")


def hosts_for(transport: str, np_: int) -> str:
    """The -H argument that gives ``np_`` ranks over ``transport``."""
    if transport == "hosts":
        first = (np_ + 1) // 2
        return f"127.0.0.1:{first},127.0.0.2:{np_ - first}"
    return f"localhost:{np_}"


def transport_env(transport: str) -> dict[str, str]:
    return {"SPARK_HVD_SHM_DISABLE": "1"} if transport == "tcp" else {}


# Every process the tests start (jobs, Spark's Python workers) writes its temporary files
# under one directory that goes away with the session: TensorFlow's autograph alone leaves
# hundreds of generated modules in the temporary directory per run. pytest's own tmp_path
# directories keep their usual place (gettempdir() is resolved before TMPDIR changes).
_SESSION_TMP: str | None = None


def pytest_configure(config):
    global _SESSION_TMP
    tempfile.gettempdir()
    _SESSION_TMP = tempfile.mkdtemp(prefix="spark_hvd-tests-")
    os.environ["TMPDIR"] = _SESSION_TMP
    # Every JVM the tests start (the session's, spark-submit's drivers, standalone masters,
    # workers, executors) lives seconds to minutes on small data: the optimising JIT tier
    # costs more CPU than it saves there (C1 only: the standalone-cluster tests ran in 114-119 s
    # instead of 150-161 s on 2 cores).
    os.environ["JDK_JAVA_OPTIONS"] = " ".join(
        filter(None, ["-XX:TieredStopAtLevel=1", os.environ.get("JDK_JAVA_OPTIONS")]))


_WHEEL_BUILD_WANTED = False
# Set by scripts/run_tests.py for the mostly_waiting tests' process beside the bed: it warms up
# the wheel's build (in build/wheel/, shared) for phase 2's test_wheel.py, and waits for it.
_WARM_UP_ONLY = os.environ.get("SPARK_HVD_TESTS_WARM_UP_WHEEL") == "1"


def pytest_collection_finish(session):
    global _WHEEL_BUILD_WANTED
    import importlib.util
    _WHEEL_BUILD_WANTED = bool(_SESSION_TMP) and importlib.util.find_spec("ziglang") is not None \
        and (any(item.path.name == "test_wheel.py" for item in session.items) or _WARM_UP_ONLY)


def pytest_runtest_setup(item):
    # test_wheel.py's ~95 s of compiling overlaps the other tests, at idle priority
    # (tests/wheel_build.py); its fixture finishes the build in the foreground. Not from the
    # network-namespace bed's own process; in make test, the process beside it starts it: the
    # bed and the waiting tests leave ~75 % of the cores idle then, and SCHED_IDLE takes only that.
    if _WHEEL_BUILD_WANTED and "multihost" not in item.path.parts:
        import wheel_build
        wheel_build.start_in_background(Path(_SESSION_TMP) / "wheel-build")


def pytest_sessionfinish(session, exitstatus):
    # The warm-up is for the next phase: a build killed mid-compile could leave objects
    # half-written, so it is waited for; not when the run was interrupted (stopped below).
    if _WARM_UP_ONLY and "wheel_build" in sys.modules \
            and exitstatus != pytest.ExitCode.INTERRUPTED:
        sys.modules["wheel_build"].wait_for_background(timeout=900)


def pytest_unconfigure(config):
    if "wheel_build" in sys.modules:
        sys.modules["wheel_build"].stop_background()
    if _SESSION_TMP:
        shutil.rmtree(_SESSION_TMP, ignore_errors=True)


# Environment variables of the developer's shell that would change what a job does.
_SCRUB_PREFIXES = ("SPARK_HVD_", "HOROVOD_", "OMPI_COMM_WORLD_")


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB_PREFIXES)}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("SPARK_HVD_START_TIMEOUT", "30")
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


@dataclass
class JobResult:
    """A finished launcher run."""
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def lines(self, rank: int, stream: str = "stdout") -> list[str]:
        """Lines the launcher forwarded from ``rank``'s ``stream``, prefix removed."""
        text = self.stdout if stream == "stdout" else self.stderr
        prefix = f"[{rank}]<{stream}>: "
        return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]

    def describe(self) -> str:
        return (f"command: {' '.join(self.args)}\nexit code {self.returncode} after "
                f"{self.seconds:.1f} s\n--- stdout ---\n{self.stdout[-12000:]}\n"
                f"--- stderr ---\n{self.stderr[-12000:]}")

    def markers(self, rank: int, word: str = "OK") -> list[str]:
        """The marker lines ``<word> rank=<rank> ...`` printed by ``rank``."""
        pat = re.compile(rf"{word} rank={rank}(\s|$)")
        return [line for line in self.lines(rank) if pat.match(line)]

    def assert_ok(self, np_: int, word: str = "OK", returncode: int | None = 0) -> None:
        """Every rank printed its success marker (and the launcher exited with
        ``returncode``, unless None)."""
        problems = []
        for r in range(np_):
            if not self.markers(r, word):
                problems.append(f"rank {r} printed no '{word} rank={r}' marker")
        for r in range(np_):
            problems += [f"rank {r}: {line}" for line in self.lines(r) if line.startswith("FAIL")]
        if returncode is not None and self.returncode != returncode:
            problems.append(f"launcher exit code {self.returncode}, expected {returncode}")
        assert not problems, "\n".join(problems) + "\n" + self.describe()

    def field(self, rank: int, key: str, word: str = "OK") -> str:
        """``key=value`` from ``rank``'s marker line."""
        for line in self.markers(rank, word):
            m = re.search(rf"\b{key}=(\S+)", line)
            if m:
                return m.group(1)
        raise AssertionError(f"rank {rank} reported no {key}=\n{self.describe()}")


def _kill_tree(proc: subprocess.Popen) -> None:
    """Stop the launcher and everything it started (ranks run in their own sessions)."""
    try:
        import psutil
        children = psutil.Process(proc.pid).children(recursive=True)
    except Exception:
        children = []
    try:
        proc.send_signal(signal.SIGTERM)  # the launcher forwards it to the ranks
        proc.wait(timeout=3)
    except Exception:
        pass
    for p in [proc] + children:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
    try:
        proc.wait(timeout=5)
    except Exception:
        pass


def run_job(np_: int, script: str, *args, env: dict | None = None, timeout: float = 60,
            hosts: str | None = None, launcher_args: tuple | list = (),
            transport: str | None = None) -> JobResult:
    """Run ``tests/workers/<script>.py args`` as an ``np_``-rank job through the launcher.

    ``transport`` ("shm", "tcp", "hosts") picks -H and the environment; ``hosts`` overrides -H.
    On timeout the whole job is killed and the test fails with the output so far.
    """
    extra = dict(env or {})
    if transport is not None:
        extra = {**transport_env(transport), **extra}
        hosts = hosts or hosts_for(transport, np_)
    cmd = [PY, "-m", "spark_hvd.runner", "-np", str(np_)]
    if hosts:
        cmd += ["-H", hosts]
    cmd += [str(a) for a in launcher_args]
    script_path = WORKERS / (script if script.endswith(".py") else script + ".py")
    cmd += [PY, str(script_path), *[str(a) for a in args]]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, err = proc.communicate()
        result = JobResult(cmd, proc.returncode, out, err, time.monotonic() - start)
        pytest.fail(f"job did not finish within {timeout} s\n{result.describe()}")
    return JobResult(cmd, proc.returncode, out, err, time.monotonic() - start)


def alive_pids(pids, timeout: float = 10.0) -> list[int]:
    """The pids among ``pids`` still alive (not zombies) after waiting up to ``timeout``."""
    import psutil
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while True:
        still = []
        for pid in alive:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    still.append(pid)
            except psutil.NoSuchProcess:
                pass
        alive = still
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


@pytest.fixture
def job():
    """The :func:`run_job` helper as a fixture."""
    return run_job


# One local Spark JVM for the whole test session (starting one costs ~10 s): a classic local[2]
# session that also serves Spark Connect on 127.0.0.1, and a Connect client of it.
import socket  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    """A classic local[2] session with the Spark Connect server plugin."""
    from pyspark.sql import SparkSession
    saved = {k: os.environ.get(k) for k in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    port = _free_port()
    session = (SparkSession.builder.master("local[2]").appName("spark_hvd-tests")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.ui.enabled", "false")
               .config("spark.local.dir", str(tmp_path_factory.mktemp("spark-local")))
               .config("spark.plugins", "org.apache.spark.sql.connect.SparkConnectPlugin")
               .config("spark.connect.grpc.binding.address", "127.0.0.1")
               .config("spark.connect.grpc.binding.port", str(port))
               .getOrCreate())
    session.sparkContext.setLogLevel("FATAL")
    session.connect_port = port
    yield session
    session.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def connect(spark):
    """A Spark Connect client of the session's server."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession
    session = ConnectSession.builder.remote(f"sc://127.0.0.1:{spark.connect_port}").getOrCreate()
    yield session
    session.stop()


# The estimator tests' data: y = x·w + 0.25 + small noise on 4-vector features, with a per-row
# weight and a validation flag (every 8th row).
REGRESSION_W = [1.5, -2.0, 0.5, 3.0]


@pytest.fixture(scope="session")
def regression_df(spark):
    import numpy as np
    from pyspark.ml.linalg import Vectors
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 4)).astype(np.float32)
    y = x @ np.array(REGRESSION_W, dtype=np.float32) + 0.25 + \
        rng.normal(0, 0.01, 512).astype(np.float32)
    rows = [(Vectors.dense(xi.tolist()), float(yi), float(1 + i % 2), i % 8 == 0)
            for i, (xi, yi) in enumerate(zip(x, y))]
    return spark.createDataFrame(rows, ["features", "label", "weight", "is_val"])


@pytest.fixture(scope="session")
def two_inputs_df(spark):
    """Two inputs (a sparse 4-vector, a 2x3 array) and two regression labels, 256 rows: for
    the multi-input / multi-output estimator tests (same data for Torch and Keras)."""
    import numpy as np
    from pyspark.ml.linalg import Vectors
    rng = np.random.default_rng(3)
    rows = []
    for _ in range(256):
        vec, grid = rng.normal(size=4), rng.normal(size=(2, 3))
        rows.append((Vectors.sparse(4, {0: float(vec[0]), 2: float(vec[2])}),
                     grid.tolist(), float(vec[0] - vec[2]), float(grid.sum())))
    return spark.createDataFrame(rows, ["vec", "grid", "y1", "y2"])


def load_timeline(path):
    """{tensor: [(ph, phase), ...]} from a Chrome-trace file (which must be valid JSON)."""
    with open(path) as f:
        events = json.load(f)
    assert isinstance(events, list) and events, path
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    phases = defaultdict(list)
    for e in events:
        if e.get("ph") == "M":
            continue
        assert {"name", "ph", "ts", "pid"} <= set(e), e
        phases[rows.get(e["pid"], e["pid"])].append((e["ph"], e["name"]))
    return phases
