"""spark_hvd.spark.run_elastic: the sizes it takes from Spark's dynamic allocation (units), and
an elastic run on a real ``local-cluster[2,1,1024]`` (two executor JVMs of one core each,
started by spark-submit) whose executor the test kills while it trains: the survivor goes on
from its last commit, Spark's re-run of the lost task joins back, and a user exception ends the
run with its traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from spark_hvd.spark._elastic import elastic_sizes
from spark_hvd.spark._slot_task import executor_key

REPO = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "spark_workers" / "elastic_job.py"


# -- sizes from dynamic allocation (Horovod #2023) ---------------------------------------------

def _parallelism(n):
    return lambda: n


def test_sizes_without_dynamic_allocation_are_horovods():
    s = elastic_sizes(None, None, None, {}, _parallelism(6))
    assert (s.num_proc, s.min_np, s.max_np) == (6, 6, 6)
    assert s.source == "spark.default.parallelism"
    s = elastic_sizes(4, None, None, {}, _parallelism(6))
    assert (s.num_proc, s.min_np, s.max_np, s.source) == (4, 4, 4, "given")
    s = elastic_sizes(4, 2, None, {"spark.dynamicAllocation.enabled": "false"}, _parallelism(6))
    assert (s.num_proc, s.min_np, s.max_np) == (4, 2, 4)
    s = elastic_sizes(2, 1, 8, {}, _parallelism(6))
    assert (s.num_proc, s.min_np, s.max_np) == (2, 1, 8)


def test_sizes_from_dynamic_allocation():
    conf = {"spark.dynamicAllocation.enabled": "true", "spark.dynamicAllocation.minExecutors":
            "1", "spark.dynamicAllocation.maxExecutors": "5",
            "spark.dynamicAllocation.initialExecutors": "2", "spark.executor.cores": "4",
            "spark.task.cpus": "2"}
    s = elastic_sizes(None, None, None, conf, _parallelism(99))
    # 2 slots per executor: start with 2 executors, at least 1, at most 5.
    assert (s.num_proc, s.min_np, s.max_np) == (4, 2, 10)
    assert "spark.dynamicAllocation" in s.source and "max 5" in s.source
    # spark.executor.instances counts for the start, as in Spark's own rule.
    s = elastic_sizes(None, None, None, {**conf, "spark.executor.instances": "3"},
                      _parallelism(99))
    assert (s.num_proc, s.min_np, s.max_np) == (6, 2, 10)
    # Arguments win; the rest still comes from the configuration.
    s = elastic_sizes(6, None, None, conf, _parallelism(99))
    assert (s.num_proc, s.min_np, s.max_np) == (6, 2, 10)
    s = elastic_sizes(None, 3, 4, conf, _parallelism(99))
    assert (s.num_proc, s.min_np, s.max_np) == (4, 3, 4)


def test_sizes_from_dynamic_allocation_defaults():
    # Spark's defaults: minExecutors 0, maxExecutors unbounded, one core per executor.
    s = elastic_sizes(None, None, None, {"spark.dynamicAllocation.enabled": "true"},
                      _parallelism(99))
    assert (s.num_proc, s.min_np, s.max_np) == (1, 1, 1)
    s = elastic_sizes(None, None, None, {"spark.dynamicAllocation.enabled": "true",
                                         "spark.dynamicAllocation.maxExecutors": "2147483647",
                                         "spark.dynamicAllocation.initialExecutors": "3"},
                      _parallelism(99))
    assert (s.num_proc, s.min_np, s.max_np) == (3, 1, 3)   # unbounded: every slot is a job
    assert "max unbounded" in s.source


def test_sizes_from_a_session(spark):
    from spark_hvd.spark import _session
    conf = _session.dynamic_allocation_conf(spark)   # local[2]: no dynamic allocation set
    assert "spark.dynamicAllocation.enabled" not in conf or conf[
        "spark.dynamicAllocation.enabled"] == "false"
    s = elastic_sizes(None, None, None, conf, lambda: _session.default_num_proc(spark))
    assert (s.num_proc, s.min_np, s.max_np, s.source) == (2, 2, 2, "spark.default.parallelism")


def test_too_few_slots_on_a_local_master_fail_at_once(spark):
    import spark_hvd.spark
    t0 = time.monotonic()
    with pytest.raises(spark_hvd.spark.RunError, match=r"num_proc=3.*offers 2 task slot"):
        spark_hvd.spark.run_elastic(lambda: None, num_proc=3, spark=spark)
    assert time.monotonic() - t0 < 10


def test_sizes_that_contradict_each_other_are_refused():
    with pytest.raises(ValueError, match="below min_num_proc"):
        elastic_sizes(2, 3, None, {}, _parallelism(4))
    with pytest.raises(ValueError, match="max_num_proc=2 is below num_proc=4"):
        elastic_sizes(4, 1, 2, {}, _parallelism(4))
    with pytest.raises(ValueError, match="at least 1"):
        elastic_sizes(2, 0, None, {}, _parallelism(4))


def test_executor_key_names_the_executor():
    url = "http://10.0.0.2:8081/logPage/?appId=app-1&executorId=3&logType=stderr"
    assert executor_key("10.0.0.2", {"SPARK_LOG_URL_STDERR": url}) == "executor-3@10.0.0.2"
    assert executor_key("h", {"SPARK_EXECUTOR_ID": "7"}) == "executor-7@h"
    assert executor_key("h", {"CONTAINER_ID": "container_1_0002"}) == \
        "executor-container_1_0002@h"
    assert executor_key("h", {}) == f"executor-pid{os.getppid()}@h"


def test_a_worker_killed_on_a_live_executor_does_not_bar_it():
    from spark_hvd.launch.elastic.policy import (HOST_LOST, PROCESS_LOST, RESET, Failure,
                                                 FailurePolicy)
    spark = FailurePolicy(process_lost_blacklists=False)   # run_elastic's
    decision = spark.decide(Failure(PROCESS_LOST, "executor-1@h", "killed by signal 9"))
    assert decision.action == RESET and decision.blacklist == ()
    assert spark.decide(Failure(HOST_LOST, "executor-1@h", "lost")).blacklist == \
        ("executor-1@h",)
    assert FailurePolicy().decide(Failure(PROCESS_LOST, "h", "x")).blacklist == ("h",)


def test_horovod_signature():
    import inspect

    import spark_hvd.spark
    import spark_hvd.spark.runner
    params = list(inspect.signature(spark_hvd.spark.run_elastic).parameters)
    assert params[:15] == ["fn", "args", "kwargs", "num_proc", "min_num_proc", "max_num_proc",
                           "start_timeout", "elastic_timeout", "reset_limit", "env", "stdout",
                           "stderr", "verbose", "nics", "prefix_output_with_timestamp"]
    assert params[15:17] == ["min_np", "max_np"]
    assert spark_hvd.spark.runner.run_elastic is spark_hvd.spark.run_elastic


# -- a real cluster ---------------------------------------------------------------------------

def _executor_of(pid: int, root: int):
    """The executor JVM (a descendant of ``root``, the spark-submit process) that ``pid`` runs
    under."""
    import psutil
    ours = {p.pid for p in psutil.Process(root).children(recursive=True)}
    for parent in psutil.Process(pid).parents():
        if parent.pid in ours and "CoarseGrainedExecutorBackend" in " ".join(parent.cmdline()):
            return parent
    raise AssertionError(f"no executor JVM of ours above pid {pid}")


def _workers(pid_dir: Path) -> list[dict]:
    out = []
    for f in pid_dir.glob("worker.*.json"):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            pass
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lost_executor_is_a_reset_and_its_task_joins_back(tmp_path):
    """Kill the executor of rank 1 mid-training: rank 0 goes on alone from its last commit,
    Spark runs the lost slot task again on the executor the cluster starts in its place, and
    that worker joins back (size 2 again); then a user exception ends a run with its
    traceback."""
    pytest.importorskip("torch")
    from test_spark_cluster import _env, _submit_args
    pid_dir = tmp_path / "workers"
    pid_dir.mkdir()
    report_path = tmp_path / "report.json"
    args = _submit_args("local-cluster[2,1,1024]", tmp_path, "spark.executor.memory=512m",
                        "spark.task.maxFailures=4") + [JOB, report_path, "both", pid_dir]
    out, err = open(tmp_path / "out", "w+"), open(tmp_path / "err", "w+")
    proc = subprocess.Popen([str(a) for a in args], env=_env(tmp_path), cwd=REPO, stdout=out,
                            stderr=err, start_new_session=True)
    killed_at = None
    try:
        deadline = time.monotonic() + 300
        while killed_at is None:
            assert proc.poll() is None, f"the job ended before the kill\n{_tail(tmp_path)}"
            assert time.monotonic() < deadline, f"no worker trained at size 2\n{_tail(tmp_path)}"
            victims = [w for w in _workers(pid_dir)
                       if w["rank"] == 1 and w["size"] == 2 and w["step"] >= 5]
            if victims:
                jvm = _executor_of(victims[0]["pid"], proc.pid)
                killed_at = time.time()
                jvm.send_signal(signal.SIGKILL)
            time.sleep(0.2)
        proc.wait(timeout=420)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = _tail(tmp_path, 10 ** 6)
    assert proc.returncode == 0, log[-8000:]
    report = json.loads(report_path.read_text())
    results = report["results"]
    assert results is not None, report
    # Back at size 2, with the same weights on both ranks.
    assert [r["rank"] for r in results] == [0, 1] and {r["size"] for r in results} == {2}, \
        results
    assert results[0]["weight"] == results[1]["weight"]
    # Rank 0's committed history: size 2, then 1 after the kill, then 2 again; every step once.
    sizes = results[0]["sizes"]
    assert len(sizes) == results[0]["steps"]
    times = [t for t, _ in sizes]
    assert times == sorted(times)
    seen = [n for i, (_, n) in enumerate(sizes) if i == 0 or sizes[i - 1][1] != n]
    assert seen == [2, 1, 2], seen
    shrunk = next(t for t, n in sizes if n == 1)
    regrown = next(t for t, n in sizes if n == 2 and t > shrunk)
    print(f"executor killed; first step at size 1 after {shrunk - killed_at:.2f} s, at size 2 "
          f"again after {regrown - killed_at:.1f} s")
    assert shrunk - killed_at < 30
    # The driver named the reset and its cause, and the re-run task.
    assert "reset 1 (round 2): lost rank 1 on executor-" in log, log[-8000:]
    assert "its Spark task was lost" in log or "connection" in log
    assert "Spark runs a lost slot task again (attempt 2)" in log, log[-8000:]
    # A user exception ends the next run, with its traceback, and is not retried.
    error = report["error"]
    assert error is not None and error["kind"] == "user" and error["rank"] == 1, error
    assert "ValueError: deliberate failure on rank 1" in error["message"]
    assert 'line' in error["detail"] and "raise_on" in error["detail"]
    assert report["user_error_seconds"] < 120


def _tail(tmp_path: Path, n: int = 6000) -> str:
    text = ""
    for name in ("out", "err"):
        p = tmp_path / name
        if p.exists():
            text += f"--- {name}\n" + p.read_text(errors="replace")[-n:]
    return text
