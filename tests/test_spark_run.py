"""spark_hvd.spark.run on a real local Spark, through a classic and a Spark Connect session.

One JVM serves the whole module: a classic ``local[2]`` session that also runs the Spark
Connect server (on 127.0.0.1), and a Connect client session to it.
"""

from __future__ import annotations

import io
import os
import re

import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

import cloudpickle  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "spark_workers"))
import fns  # noqa: E402

import spark_hvd.spark  # noqa: E402
from spark_hvd.spark import RunError  # noqa: E402

from conftest import alive_pids

cloudpickle.register_pickle_by_value(fns)
pytestmark = pytest.mark.timeout(240)


def _pids(pid_dir: Path) -> list[int]:
    return [int(p) for f in pid_dir.glob("rank*.pids") for p in f.read_text().split()]




def test_results_output_and_env(spark):
    out, err = io.StringIO(), io.StringIO()
    results = spark_hvd.spark.run(fns.rank_info, args=("classic", ["FOO", "SPARK_HVD_CYCLE_TIME"]),
                                  num_proc=2, env={"FOO": "bar"}, stdout=out, stderr=err,
                                  spark=spark)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 and r["sum"] == 3.0 and r["tag"] == "classic" for r in results)
    assert [(r["local_rank"], r["local_size"], r["cross_size"]) for r in results] == \
        [(0, 2, 1), (1, 2, 1)]
    assert results[1]["env"]["FOO"] == "bar"
    for r in range(2):
        assert f"[{r}]<stdout>: hello rank={r} tag=classic\n" in out.getvalue()
        assert f"[{r}]<stderr>: to stderr rank={r}\n" in err.getvalue()


def test_the_documented_example(spark):
    import doctest
    globs = {"__name__": "__main__", "spark_hvd": spark_hvd}  # fn pickled by value
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(spark_hvd.spark.run, "run", globs=globs):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
    assert runner.summarize(verbose=False).attempted >= 2


def test_driver_tuning_variables_reach_the_ranks(spark, monkeypatch):
    monkeypatch.setenv("SPARK_HVD_CYCLE_TIME", "3")
    results = spark_hvd.spark.run(fns.env_of, args=(["SPARK_HVD_CYCLE_TIME", "SPARK_HVD_RANK"],),
                                  num_proc=2, spark=spark)
    assert results == [{"SPARK_HVD_CYCLE_TIME": "3", "SPARK_HVD_RANK": "0"},
                       {"SPARK_HVD_CYCLE_TIME": "3", "SPARK_HVD_RANK": "1"}]


def test_the_task_relays_the_rendezvous_init_uses(spark):
    # A rank gathering through rendezvous_from_env() meets the others through the task's relay
    # of init()'s rendezvous keys; with keys of its own it would wait out start_timeout.
    assert spark_hvd.spark.run(fns.gather_through_init_rendezvous, num_proc=2, spark=spark,
                               start_timeout=30) == [["rank0", "rank1"]] * 2


def test_default_num_proc_and_timestamps(spark):
    out = io.StringIO()
    assert spark_hvd.spark.run(fns.chatty, args=(1,), spark=spark, stdout=out,
                               stderr=io.StringIO(), prefix_output_with_timestamp=True) == [0, 1]
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \[1\]<stdout>: out 0 of rank 1$",
                     out.getvalue(), re.M), out.getvalue()


def test_exception_in_one_rank(spark, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RunError) as info:
        spark_hvd.spark.run(fns.fail_on, args=(1, str(tmp_path)), num_proc=2, spark=spark,
                            stderr=io.StringIO())
    seconds = time.monotonic() - t0
    e = info.value
    assert (e.rank, e.kind, e.state) == (1, "user", "running")
    assert str(e).startswith("rank 1 (host 127.0.0.1) failed: ValueError: deliberate failure")
    assert "Traceback (most recent call last)" in str(e) and "in fail_on" in str(e)
    assert seconds < 60, seconds
    pids = _pids(tmp_path)
    assert len(pids) == 4  # two ranks, each with a child process of its own
    assert alive_pids(pids, timeout=10.0) == []


def test_killed_rank_fails_the_job_within_seconds(spark, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RunError) as info:
        spark_hvd.spark.run(fns.die_on, args=(1, str(tmp_path)), num_proc=2, spark=spark,
                            stderr=io.StringIO())
    assert info.value.rank == 1 and info.value.kind == "crash"
    assert "killed by signal 9 (SIGKILL)" in str(info.value)
    assert time.monotonic() - t0 < 60
    assert alive_pids(_pids(tmp_path), timeout=10.0) == []


def test_too_few_slots_is_an_immediate_clear_error(spark):
    t0 = time.monotonic()
    with pytest.raises(RunError, match=r"num_proc=3.*offers 2 task slot\(s\).*Lower num_proc"):
        spark_hvd.spark.run(fns.empty, num_proc=3, spark=spark)
    assert time.monotonic() - t0 < 20  # no barrier wait: Spark alone takes seconds when busy


def test_spark_connect_session(connect, tmp_path):
    out = io.StringIO()
    results = spark_hvd.spark.run(fns.rank_info, args=("connect",), num_proc=2, spark=connect,
                                  stdout=out, stderr=io.StringIO())
    assert [(r["rank"], r["sum"], r["tag"]) for r in results] == [(0, 3.0, "connect"),
                                                                  (1, 3.0, "connect")]
    assert "[1]<stdout>: hello rank=1 tag=connect\n" in out.getvalue()
    with pytest.raises(RunError) as info:
        spark_hvd.spark.run(fns.fail_on, args=(0, str(tmp_path)), num_proc=2, spark=connect,
                            stderr=io.StringIO())
    assert info.value.rank == 0 and "deliberate failure on rank 0" in str(info.value)
    assert alive_pids(_pids(tmp_path), timeout=10.0) == []
    with pytest.raises(RunError, match="offers 2 task slot"):
        spark_hvd.spark.run(fns.empty, num_proc=4, spark=connect)


def test_works_when_executors_cannot_reach_the_driver_channel(spark, monkeypatch, tmp_path):
    # As for a Spark Connect client the cluster cannot reach: no live output, but results and
    # failures (from Spark's own error) still come back.
    from spark_hvd.spark import _session
    monkeypatch.setattr(_session, "channel_hosts", lambda s: ("127.0.0.1", "127.0.0.9"))
    assert spark_hvd.spark.run(fns.chatty, args=(1,), num_proc=2, spark=spark) == [0, 1]
    with pytest.raises(RunError) as info:
        spark_hvd.spark.run(fns.fail_on, args=(1, str(tmp_path)), num_proc=2, spark=spark)
    assert info.value.rank == 1
    assert "ValueError: deliberate failure on rank 1" in str(info.value)
    assert "in fail_on" in str(info.value)
    assert alive_pids(_pids(tmp_path), timeout=20) == []


def test_controller_states_of_finished_and_errored_runs(spark, tmp_path):
    from spark_hvd.spark._controller import RunController, State
    log = io.StringIO()
    ok = RunController(fns.chatty, args=(1,), num_proc=2, spark=spark, stdout=io.StringIO(),
                       stderr=log, verbose=2)
    assert ok.run() == [0, 1]
    assert ok.state is State.FINISHED and ok.error is None
    assert [state for state, _ in ok.history] == [State.STARTING, State.RUNNING]
    for step in ("not started -> starting", "starting -> running", "running -> finished"):
        assert f"job {ok.job_id}: {step}" in log.getvalue(), log.getvalue()

    # A rank fails: the run ends in ERRORED, and the error says it failed while running.
    failed = RunController(fns.fail_on, args=(1, str(tmp_path)), num_proc=2, spark=spark,
                           stderr=io.StringIO())
    with pytest.raises(RunError) as info:
        failed.run()
    assert failed.state is State.ERRORED and failed.error is info.value
    assert [state for state, _ in failed.history] == [State.STARTING, State.RUNNING]
    assert (info.value.state, info.value.rank) == ("running", 1)
    assert alive_pids(_pids(tmp_path), timeout=10.0) == []

    # Too few task slots: ERRORED straight from STARTING; no stage ran.
    short = RunController(fns.empty, num_proc=4, spark=spark)
    with pytest.raises(RunError, match="offers 2 task slot") as info:
        short.run()
    assert short.state is State.ERRORED and info.value.state == "starting"
    assert [state for state, _ in short.history] == [State.STARTING]


@pytest.mark.parametrize("kind", ["classic", "connect"])
def test_a_watcher_thread_cancels_the_tagged_stage(request, kind, tmp_path):
    """What the start and liveness watches and the elastic end rely on: jobs tagged in one
    thread are cancelled from another. (A classic SparkSession.interruptTag from another
    thread cancels nothing: the fit that outlived a lost executor waited 10 s at its end.)"""
    import threading
    from spark_hvd.spark import _session
    spark = request.getfixturevalue("spark" if kind == "classic" else "connect")
    started = str(tmp_path / "started")

    def sleeper(batches):
        import time as _time
        open(started, "w").close()
        _time.sleep(180)
        yield from batches

    outcome = {}

    def stage():
        try:
            with _session.tagged_jobs(spark, "spark_hvd_test_cancel"):
                spark.range(0, 1, 1, 1).mapInArrow(sleeper, "id long").collect()
            outcome["result"] = "finished"
        except Exception as e:  # noqa: BLE001 - Py4J and Connect errors alike
            outcome["result"] = f"cancelled: {str(e).splitlines()[0][:200]}"

    thread = threading.Thread(target=stage, daemon=True)
    thread.start()
    deadline = time.monotonic() + 90
    while not os.path.exists(started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.path.exists(started), "the tagged stage's task never started"
    cancelled_at = time.monotonic()
    _session.cancel_tagged(spark, "spark_hvd_test_cancel")
    thread.join(60)
    assert not thread.is_alive(), "the tagged stage was not cancelled within 60 s"
    assert outcome["result"].startswith("cancelled"), outcome
    assert time.monotonic() - cancelled_at < 60
    # The session runs jobs again, untagged ones untouched by the tag.
    assert spark.range(3).count() == 3
