"""The task side of spark_hvd.spark.run without Spark: real ranks, a fake barrier.

Each test plays a barrier stage with threads, one per task, each with a fake
``BarrierTaskContext`` (``allGather`` on a ``threading.Barrier``), and the driver's real channel.
What runs is the real thing: child processes with the bootstrap environment, the rendezvous
proxy, the native core, output forwarding, error reports and the abort of the other ranks.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import types
from pathlib import Path

import cloudpickle
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "spark_workers"))
import fns  # noqa: E402

from spark_hvd.spark import _task  # noqa: E402
from spark_hvd.spark._channel import STDERR, STDOUT, DriverChannel, TaskChannel  # noqa: E402
from spark_hvd.spark._controller import assemble_results, pick_failure  # noqa: E402

from conftest import alive_pids

pytest.importorskip("pyarrow")
cloudpickle.register_pickle_by_value(fns)
pytestmark = pytest.mark.timeout(120)


class ListSink:
    def __init__(self):
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def write_line(self, line: bytes) -> None:
        with self._lock:
            self.lines.append(line.decode().rstrip("\n"))


class FakeStage:
    """A barrier stage of len(addresses) tasks; partition p runs on executor addresses[p]."""

    def __init__(self, addresses, gpus=None, attempt=0):
        self.addresses = addresses
        self.gpus = gpus
        self.attempt = attempt
        self.barrier = threading.Barrier(len(addresses), timeout=60)
        self.slots = [None] * len(addresses)

    def context(self, pid):
        stage = self

        class Ctx:
            def partitionId(self):
                return pid

            def attemptNumber(self):
                return stage.attempt

            def getTaskInfos(self):
                return [types.SimpleNamespace(address=a) for a in stage.addresses]

            def resources(self):
                if stage.gpus is None:
                    return {}
                return {"gpu": types.SimpleNamespace(addresses=stage.gpus[pid])}

            def allGather(self, message):
                stage.slots[pid] = message
                stage.barrier.wait()
                out = list(stage.slots)
                stage.barrier.wait()
                return out

        return Ctx()


class Job:
    """Runs ``fn`` on a fake stage; ``results``/``errors`` per partition, output lines."""

    def __init__(self, fn, args=(), addresses=("127.0.0.1:7077",) * 2, env=None, gpus=None,
                 start_timeout=30, attempt=0, before=None):
        self.out, self.err = ListSink(), ListSink()
        n = len(addresses)
        self.channel = DriverChannel("testjob", b"s" * 32, n, "127.0.0.1", "127.0.0.1",
                                     {STDOUT: self.out, STDERR: self.err})
        self.spec = _task.TaskSpec(
            job_id="testjob", secret=b"s" * 32, num_proc=n,
            payload=cloudpickle.dumps((fn, tuple(args), {})), channel_addr=self.channel.addr,
            start_timeout=start_timeout, env=dict(env or {}), timestamp=False,
            executable=sys.executable, verbose=1)
        self.stage = FakeStage(list(addresses), gpus, attempt)
        if before is not None:
            before(self)
        self.rows: dict[int, list] = {}
        self.errors: dict[int, BaseException] = {}
        self.seconds = None

    def _task(self, pid):
        try:
            self.rows[pid] = [b.to_pylist()[0] for b in
                              _task.run_task(self.spec, self.stage.context(pid))]
        except BaseException as e:  # noqa: BLE001
            self.errors[pid] = e
            self.stage.barrier.abort()  # as Spark kills the stage's other tasks

    def run(self):
        t0 = time.monotonic()
        threads = [threading.Thread(target=self._task, args=(p,))
                   for p in range(len(self.stage.addresses))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        self.seconds = time.monotonic() - t0
        assert not any(t.is_alive() for t in threads), "a task did not finish"
        self.channel.wait_output(timeout=5)
        return self

    def results(self):
        return assemble_results([r for rows in self.rows.values() for r in rows],
                                len(self.stage.addresses))

    def close(self):
        self.channel.close()


@pytest.fixture
def job():
    jobs = []

    def make(*args, **kwargs):
        j = Job(*args, **kwargs)
        jobs.append(j)
        return j.run()

    yield make
    for j in jobs:
        j.close()




def test_results_in_rank_order_with_output_and_env(job):
    j = job(fns.rank_info, args=("t1", ["FOO", "CUDA_VISIBLE_DEVICES", "SPARK_HVD_SIZE"]),
            env={"FOO": "bar"})
    assert not j.errors, j.errors
    results = j.results()
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 and r["sum"] == 3.0 for r in results)
    assert [(r["local_rank"], r["local_size"], r["cross_size"]) for r in results] == \
        [(0, 2, 1), (1, 2, 1)]
    # No GPU resource: CUDA_VISIBLE_DEVICES stays as the executor (here this process) has it.
    assert results[0]["env"] == {"FOO": "bar", "SPARK_HVD_SIZE": "2",
                                 "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
    for r in range(2):
        assert f"[{r}]<stdout>: hello rank={r} tag=t1" in j.out.lines
        assert f"[{r}]<stderr>: to stderr rank={r}" in j.err.lines


def test_ranks_are_host_major_over_executors(job):
    # Partitions alternate between two executors: ranks 0,1 go to the first one, 2,3 to the
    # second, whatever the partition order.
    addresses = ["127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1001", "127.0.0.1:1002"]
    j = job(fns.rank_info, addresses=addresses)
    assert not j.errors, j.errors
    by_partition = {p: rows[0]["rank"] for p, rows in j.rows.items()}
    assert by_partition == {0: 0, 1: 2, 2: 1, 3: 3}
    results = j.results()
    assert [(r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"])
            for r in results] == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    assert all(r["sum"] == 10.0 for r in results)


def test_init_twice_is_two_rendezvous_rounds(job):
    j = job(fns.reinit)
    assert not j.errors, j.errors
    assert j.results() == [[2.0, 2.0], [2.0, 2.0]]


def test_function_without_init_and_big_result(job):
    j = job(fns.big_result, args=(3 << 20,))
    assert not j.errors, j.errors
    results = j.results()
    assert all(len(r) == 16 + (3 << 20) for r in results)
    assert max(len(rows) for rows in j.rows.values()) == 4  # 1 MiB chunks


def test_exception_fails_fast_with_traceback_and_no_leftovers(job, tmp_path):
    j = job(fns.fail_on, args=(1, str(tmp_path)))
    assert set(j.errors) == {0, 1}
    assert j.seconds < 30, "the healthy rank was not stopped"
    assert "deliberate failure on rank 1" in str(j.errors[1])
    assert _task.FAILURE_MARKER in str(j.errors[1])
    report = pick_failure(j.channel.errors())
    assert report["rank"] == 1 and report["kind"] == "user"
    assert "ValueError: deliberate failure on rank 1" in report["detail"]
    assert "in fail_on" in report["detail"]
    # The traceback also reached the driver as rank 1's stderr.
    assert any(line.startswith("[1]<stderr>: ValueError: deliberate") for line in j.err.lines)
    pids = [int(p) for f in tmp_path.glob("rank*.pids") for p in f.read_text().split()]
    assert len(pids) == 4
    assert alive_pids(pids, timeout=10.0) == []


def test_killed_rank_fails_within_seconds(job, tmp_path):
    j = job(fns.die_on, args=(0, str(tmp_path)))
    assert set(j.errors) == {0, 1}
    assert j.seconds < 30
    report = pick_failure(j.channel.errors())
    assert report["rank"] == 0 and report["kind"] == "crash"
    assert "SIGKILL" in report["summary"]
    pids = [int(p) for f in tmp_path.glob("rank*.pids") for p in f.read_text().split()]
    assert alive_pids(pids, timeout=10.0) == []


def test_init_on_some_ranks_only_is_an_error(job):
    j = job(fns.init_only_on, args=(0,))
    assert 0 in j.errors
    assert "but rank 1 already returned from fn" in str(j.errors[0])


def test_gpu_resources_become_visible_devices(job):
    addresses = ["127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:2"]
    j = job(fns.env_of, args=(["CUDA_VISIBLE_DEVICES"],), addresses=addresses,
            gpus=[["3"], ["1"], ["0"]])
    assert not j.errors, j.errors
    # One GPU per task: the executor's GPUs in local-rank order, so local_rank picks its own.
    assert [r["CUDA_VISIBLE_DEVICES"] for r in j.results()] == ["3,1", "3,1", "0"]


def test_user_env_wins_over_gpu_binding(job):
    j = job(fns.env_of, args=(["CUDA_VISIBLE_DEVICES"],), env={"CUDA_VISIBLE_DEVICES": "7"},
            addresses=["127.0.0.1:1"])
    assert j.results() == [{"CUDA_VISIBLE_DEVICES": "7"}]


def test_output_without_a_reachable_driver_goes_to_the_executor_log(tmp_path, capfd):
    stage = FakeStage(["127.0.0.1:1"])
    spec = _task.TaskSpec(job_id="j", secret=b"k" * 32, num_proc=1,
                          payload=cloudpickle.dumps((fns.chatty, (2,), {})),
                          channel_addr=None, start_timeout=30, env={}, timestamp=False,
                          executable=sys.executable, verbose=1)
    rows = [b.to_pylist()[0] for b in _task.run_task(spec, stage.context(0))]
    assert assemble_results(rows, 1) == [0]
    err = capfd.readouterr().err
    assert "[0]<stdout>: out 1 of rank 0" in err and "[0]<stderr>: err 1 of rank 0" in err


def test_error_report_is_json_with_the_failing_rank(job):
    j = job(fns.fail_on, args=(0,))
    errors = j.channel.errors()
    assert errors[0]["kind"] == "user"
    json.dumps(errors)  # reports stay plain data
    assert os.environ.get("SPARK_HVD_RANK") is None  # the test process was not touched


def test_a_retried_attempt_does_not_rerun_a_user_error(job, tmp_path):
    def earlier_attempt_failed(j):
        earlier = TaskChannel(j.channel.addr, b"s" * 32, "testjob", 1).start()
        assert earlier.put_global("user_error", b"rank 1: ValueError: boom")
        earlier.close()

    j = job(fns.record_pids, args=(str(tmp_path), 0), attempt=1, before=earlier_attempt_failed)
    assert set(j.errors) == {0, 1}
    assert "not running fn again on rank" in str(j.errors[0])
    assert "ValueError: boom" in str(j.errors[0])
    assert list(tmp_path.iterdir()) == []  # fn never ran
    assert any("Spark task attempt 2" in line for line in j.err.lines)
