"""A task that goes silent (its executor or machine lost) fails spark_hvd.spark.run within the
heartbeat timeout, on the real local Spark and without the multi-host bed: one rank freezes its
own task's Python worker (SIGSTOP), so that task sends no heartbeat and can report nothing,
while the rank itself lives on, as a rank on an unreachable machine would. The bed's
tests/multihost/test_spark_hosts.py kills whole hosts."""

from __future__ import annotations

import io
import os
import signal
import sys
import time

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

import cloudpickle  # noqa: E402

import spark_hvd.spark  # noqa: E402
from spark_hvd.spark import RunError  # noqa: E402

from conftest import alive_pids  # noqa: E402

pytestmark = pytest.mark.timeout(180)
# The ranks cannot import this module: its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def freeze_own_task(victim, pid_file):
    """Every rank inits; ``victim`` freezes its task (the rank's parent) and waits."""
    import spark_hvd.numpy as hvd
    hvd.init()
    if hvd.rank() == victim:
        with open(pid_file, "w") as f:
            f.write(f"{os.getpid()} {os.getppid()}")
        os.kill(os.getppid(), signal.SIGSTOP)
    time.sleep(120)
    return "not reached"


def test_silent_task_is_lost_within_the_heartbeat_timeout(spark, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_HVD_SPARK_HEARTBEAT_TIMEOUT", "3")
    pid_file = tmp_path / "victim.pids"
    t0 = time.monotonic()
    try:
        with pytest.raises(RunError) as info:
            spark_hvd.spark.run(freeze_own_task, args=(1, str(pid_file)), num_proc=2,
                                spark=spark, stderr=io.StringIO())
        seconds = time.monotonic() - t0
    finally:
        # The frozen task and its rank cannot stop themselves: Spark kills the task's worker;
        # whatever is left goes here.
        pids = [int(p) for p in pid_file.read_text().split()] if pid_file.exists() else []
        for pid in reversed(pids):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
    error = info.value
    assert error.kind == "lost" and error.lost_ranks == [1] and error.rank == 1, error
    assert error.host == "127.0.0.1", error
    assert "rank 1 on host 127.0.0.1" in str(error) and "heartbeat timeout 3 s" in str(error)
    assert seconds < 45, seconds
    print(f"RunError after {seconds:.1f} s (heartbeat timeout 3 s): {error}")
    assert alive_pids(pids, timeout=10.0) == []
    # The session still works.
    assert len(spark_hvd.spark.run(lambda: 1, num_proc=2, spark=spark)) == 2
