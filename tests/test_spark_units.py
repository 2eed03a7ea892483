"""spark_hvd.spark's pure parts: placement, master parsing, GPU binding, the TLS refusal,
failure selection, the driver/task channel. No Spark, no ranks."""

from __future__ import annotations

import io
import threading
import time

import pytest

from spark_hvd.spark import RunError, _controller, _placement, _session
from spark_hvd.spark._channel import (EOF, STDERR, STDOUT, DriverChannel, TaskChannel,
                                      decode_lines, encode_lines)

pytestmark = pytest.mark.timeout(60)


# -- placement ------------------------------------------------------------------------------------

def test_one_executor_is_one_host():
    slots = _placement.slots_by_partition(["h:1"] * 3)
    assert [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == \
        [(0, 0, 3, 0, 1), (1, 1, 3, 0, 1), (2, 2, 3, 0, 1)]


def test_ranks_are_host_major_in_order_of_first_partition():
    slots = _placement.slots_by_partition(["b:2", "a:1", "b:2", "a:1", "c:3"])
    assert [s.rank for s in slots] == [0, 2, 1, 3, 4]
    assert [s.hostname for s in slots] == ["b:2", "a:1", "b:2", "a:1", "c:3"]
    assert [(s.local_rank, s.local_size) for s in slots] == [(0, 2), (0, 2), (1, 2), (1, 2),
                                                             (0, 1)]
    # Horovod's cross ranks: the hosts that have a process with this local rank.
    assert [(s.cross_rank, s.cross_size) for s in slots] == [(0, 3), (1, 3), (0, 2), (1, 2),
                                                             (2, 3)]


def test_executors_of_one_machine_get_consecutive_ranks():
    # Two machines with two executors each, their tasks interleaved by Spark: the executors of
    # 10.0.0.2 come first (its task was first), each executor's ranks consecutive.
    addresses = ["10.0.0.2:7001", "10.0.0.3:7001", "10.0.0.2:7002", "10.0.0.3:7002",
                 "10.0.0.2:7001", "10.0.0.3:7001", "10.0.0.2:7002", "10.0.0.3:7002"]
    slots = _placement.slots_by_partition(addresses)
    by_rank = sorted(slots, key=lambda s: s.rank)
    assert [s.hostname for s in by_rank] == ["10.0.0.2:7001"] * 2 + ["10.0.0.2:7002"] * 2 + \
        ["10.0.0.3:7001"] * 2 + ["10.0.0.3:7002"] * 2
    assert [s.rank for s in slots] == [0, 4, 2, 6, 1, 5, 3, 7]


def test_host_of_and_host_id():
    assert _placement.host_of("10.0.0.5:43211") == "10.0.0.5"
    assert _placement.host_of("[::1]:5") == "::1"
    assert _placement.host_of("worker-3") == "worker-3"
    assert _placement.host_id("a b:1") == "a_b:1"


@pytest.mark.parametrize("mine,host,expected", [
    (["0"], [["0"], ["1"]], "0,1"),
    (["1"], [["0"], ["1"]], "0,1"),
    (["2", "3"], [["0", "1"], ["2", "3"]], "2,3"),   # several per task: only its own
    (["0"], [["0"], ["0"]], "0"),                    # a shared GPU (fractional amounts)
    ([], [[], []], ""),
])
def test_visible_devices(mine, host, expected):
    assert _placement.visible_devices(mine, host) == expected


def test_visible_devices_rejects_non_cuda_addresses():
    with pytest.raises(ValueError, match="not a CUDA device index"):
        _placement.visible_devices(["gpu0"], [["gpu0"]])


@pytest.mark.parametrize("master,cpus,expected", [
    ("local", 1, 1), ("local[4]", 1, 4), ("local[4]", 2, 2), ("local[3, 2]", 1, 3),
    ("local-cluster[2,2,1024]", 1, 4), ("local-cluster[2, 3, 512]", 2, 2),
    ("local[*]", 1, None), ("spark://127.0.0.1:7077", 1, None), ("yarn", 1, None),
])
def test_master_slots(master, cpus, expected):
    assert _placement.parse_master_slots(master, cpus) == expected


def test_master_slots_star_with_cpu_count():
    assert _placement.parse_master_slots("local[*]", 1, cpu_count=8) == 8


# -- session checks (a stand-in session: only its conf is read) -----------------------------------

class FakeConf:
    def __init__(self, values):
        self.values = values

    def get(self, key, default=None):
        return self.values.get(key, default)


class FakeSession:
    __module__ = "pyspark.sql.connect.session"  # looks like Spark Connect: no SparkContext

    def __init__(self, **conf):
        self.conf = FakeConf(conf)


def test_tls_cluster_is_refused_unless_allowed(monkeypatch):
    monkeypatch.delenv(_controller.ALLOW_UNENCRYPTED_ENV, raising=False)
    _controller.check_ssl(FakeSession())
    with pytest.raises(RunError, match="spark.ssl.enabled.*not encrypted"):
        _controller.check_ssl(FakeSession(**{"spark.ssl.enabled": "true"}))
    _controller.check_ssl(FakeSession(**{"spark.ssl.enabled": "true",
                                         _controller.ALLOW_UNENCRYPTED_CONF: "true"}))
    monkeypatch.setenv(_controller.ALLOW_UNENCRYPTED_ENV, "1")
    _controller.check_ssl(FakeSession(**{"spark.ssl.enabled": "true"}))


def test_spark_hvd_settings_with_and_without_the_spark_prefix(monkeypatch):
    # spark-submit --conf passes on only spark.* keys: spark.spark_hvd.<name> is the form for
    # clusters, spark_hvd.<name> (set on a session) still works.
    _controller.check_ssl(FakeSession(**{"spark.ssl.enabled": "true",
                                         "spark." + _controller.ALLOW_UNENCRYPTED_CONF: "1"}))
    for key in ("spark.spark_hvd.networkInterface", "spark_hvd.networkInterface"):
        assert _controller.network_interface(FakeSession(**{key: " eth1 "}), None) == "eth1"
    # Horovod's nics win; none of them leaves the variables the ranks get as they are.
    session = FakeSession(**{"spark.spark_hvd.networkInterface": "eth1"})
    assert _controller.network_interface(session, ["ib0", "eth2"]) == "ib0,eth2"
    assert _controller.network_interface(session, {"ib1", "ib0"}) == "ib0,ib1"
    assert _controller.network_interface(FakeSession(), None) is None
    monkeypatch.delenv("SPARK_HVD_SPARK_HEARTBEAT_TIMEOUT", raising=False)
    monkeypatch.delenv("HOROVOD_SPARK_HEARTBEAT_TIMEOUT", raising=False)
    assert _controller._heartbeat_timeout(FakeSession()) == _controller.DEFAULT_HEARTBEAT_TIMEOUT
    session = FakeSession(**{"spark.spark_hvd.heartbeatTimeout": "4.5"})
    assert _controller._heartbeat_timeout(session) == 4.5
    monkeypatch.setenv("SPARK_HVD_SPARK_HEARTBEAT_TIMEOUT", "7")
    assert _controller._heartbeat_timeout(session) == 7.0
    monkeypatch.setenv("SPARK_HVD_SPARK_HEARTBEAT_TIMEOUT", "0")
    with pytest.raises(ValueError, match="heartbeat timeout must be positive"):
        _controller._heartbeat_timeout(session)


def test_lost_ranks_message_names_ranks_hosts_and_the_timeout():
    lost = {3: {"host": "10.0.0.3", "hostname": "node-3", "silent": 11.2},
            2: {"host": "10.0.0.3", "hostname": "node-3", "silent": 11.0},
            5: {"host": "10.0.0.4", "hostname": "10.0.0.4", "silent": 4.0}}
    message = _controller.lost_ranks_message(lost, 10.0)
    assert message.startswith("ranks [2, 3] on host 10.0.0.3 (node-3); rank 5 on host "
                              "10.0.0.4 were lost: their Spark tasks sent no heartbeat for "
                              "11 s (heartbeat timeout 10 s, spark.spark_hvd.heartbeatTimeout)")


def test_connect_session_facts_come_from_conf():
    s = FakeSession(**{"spark.master": "local-cluster[2,2,1024]"})
    assert _session.is_connect(s)
    assert _session.default_num_proc(s) == 4
    assert _session.total_slots(s) == 4
    assert _session.default_num_proc(FakeSession(**{"spark.default.parallelism": "6"})) == 6
    with pytest.raises(ValueError, match="pass num_proc"):
        _session.default_num_proc(FakeSession(**{"spark.master": "spark://h:7077"}))


def test_too_few_slots_on_a_local_master_fails_at_once():
    c = _controller.RunController(lambda: None, num_proc=5,
                                  spark=FakeSession(**{"spark.master": "local[2]"}))
    t0 = time.monotonic()
    with pytest.raises(RunError, match=r"num_proc=5.*offers 2 task slot\(s\).*local\[2\]"):
        c._check()
    assert time.monotonic() - t0 < 1


def test_forwarded_env_keeps_tuning_not_bootstrap(monkeypatch):
    monkeypatch.setenv("SPARK_HVD_FUSION_THRESHOLD", "1024")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "2")
    monkeypatch.setenv("SPARK_HVD_RANK", "3")
    monkeypatch.setenv("SPARK_HVD_SECRET", "ab")
    env = _controller.forwarded_env({"FOO": 1, "SPARK_HVD_FUSION_THRESHOLD": "2048"})
    assert env["FOO"] == "1" and env["SPARK_HVD_FUSION_THRESHOLD"] == "2048"
    assert env["HOROVOD_CYCLE_TIME"] == "2"
    assert "SPARK_HVD_RANK" not in env and "SPARK_HVD_SECRET" not in env
    with pytest.raises(ValueError):
        _controller.forwarded_env({"X": None})


def test_use_mpi_is_refused():
    import spark_hvd.spark
    with pytest.raises(ValueError, match="MPI is not supported"):
        spark_hvd.spark.run(lambda: None, use_mpi=True)


# -- failures -------------------------------------------------------------------------------------

def test_pick_failure_prefers_the_root_cause():
    errors = {
        0: {"rank": 0, "kind": "internal", "time": 1.0},
        1: {"rank": 1, "kind": "user", "time": 2.0},
        2: {"rank": 2, "kind": "crash", "time": 0.5},
        3: {"rank": 3, "kind": "user", "time": 1.5},
    }
    assert _controller.pick_failure(errors)["rank"] == 3
    del errors[1], errors[3]
    assert _controller.pick_failure(errors)["rank"] == 2
    assert _controller.pick_failure({}) is None


def test_failure_found_in_spark_error_text():
    text = ("Job aborted due to stage failure: ... PythonException: Traceback ...\n"
            "spark_hvd.spark._task.TaskFailed: [spark_hvd rank failure 3] rank 3 on h failed: "
            "Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'a'\n\n"
            " SQLSTATE: 38000\n\tat org.apache.spark.Foo")
    rank, message = _controller.failure_from_spark_error(text)
    assert rank == 3
    assert message.endswith("KeyError: 'a'") and "SQLSTATE" not in message
    assert _controller.failure_from_spark_error("no marker") == (None, "")


def test_assemble_results_orders_ranks_and_chunks():
    import cloudpickle
    data = [cloudpickle.dumps(("r", r)) for r in range(3)]
    rows = []
    for r in (2, 0, 1):
        half = len(data[r]) // 2
        rows += [{"rank": r, "seq": 1, "chunk": data[r][half:]},
                 {"rank": r, "seq": 0, "chunk": data[r][:half]}]
    assert _controller.assemble_results(rows, 3) == [("r", 0), ("r", 1), ("r", 2)]
    with pytest.raises(RunError, match=r"ranks \[3\] returned no result"):
        _controller.assemble_results(rows, 4)


# -- channel --------------------------------------------------------------------------------------

def test_line_encoding_roundtrip():
    lines = [(STDOUT, b"a\n"), (STDERR, b"b c\n"), (STDOUT, b"\n")]
    assert decode_lines(encode_lines(lines)) == lines
    assert EOF not in encode_lines(lines)


class ListSink:
    def __init__(self):
        self.lines = []

    def write_line(self, line):
        self.lines.append(line)


def test_channel_carries_output_status_and_abort():
    out, err = ListSink(), ListSink()
    driver = DriverChannel("j1", b"x" * 32, 2, "127.0.0.1", "127.0.0.1",
                           {STDOUT: out, STDERR: err})
    try:
        tasks = [TaskChannel(driver.addr, b"x" * 32, "j1", r).start() for r in range(2)]
        aborted = threading.Event()
        tasks[1].watch("abort", lambda v: aborted.set())
        for i in range(700):  # more than one window of chunks
            tasks[0].stdout.write_line(f"[0]<stdout>: line {i}\n".encode())
            if i % 100 == 0:
                time.sleep(0.03)
        tasks[1].stderr.write_line(b"[1]<stderr>: no newline")
        tasks[1].log("hello")
        assert driver.wait_all("started", 5) == {0, 1}
        assert tasks[1].put("error", b'{"rank": 1, "kind": "user"}')
        driver.abort("because")
        assert aborted.wait(5)
        for t in tasks:
            t.close()
        assert driver.wait_output(5)
        assert out.lines == [f"[0]<stdout>: line {i}\n".encode() for i in range(700)]
        assert err.lines == [b"[1]<stderr>: no newline\n", b"spark_hvd.spark: hello\n"]
        assert driver.errors() == {1: {"rank": 1, "kind": "user"}}
    finally:
        driver.close()


def test_task_channel_with_wrong_secret_falls_back_to_the_log():
    driver = DriverChannel("j2", b"x" * 32, 1, "127.0.0.1", "127.0.0.1",
                           {STDOUT: ListSink(), STDERR: ListSink()})
    buf = io.BytesIO()
    try:
        task = TaskChannel(driver.addr, b"y" * 32, "j2", 0, connect_timeout=2, fallback=buf)
        task.stdout.write_line(b"[0]<stdout>: kept\n")
        assert not task.wait_ready(10)
        assert not task.put("started", b"1")
        task.close()
        assert buf.getvalue() == b"[0]<stdout>: kept\n"
    finally:
        driver.close()


def test_controller_refuses_illegal_transitions():
    from spark_hvd.spark._controller import IllegalTransition, RunController, State
    c = RunController(lambda: None, num_proc=1)
    with pytest.raises(IllegalTransition, match="not started -> running is not a transition"):
        c._enter(State.RUNNING)
    for state in (State.STARTING, State.RUNNING, State.RESTARTING, State.RUNNING,
                  State.FINISHED):
        c._enter(state)
    assert [s for s, _ in c.history] == [State.STARTING, State.RUNNING, State.RESTARTING,
                                         State.RUNNING]
    for after_the_end in State:  # a terminal state is final
        with pytest.raises(IllegalTransition, match="from finished: none"):
            c._enter(after_the_end)
    c = RunController(lambda: None, num_proc=1)
    c._enter(State.STARTING)
    with pytest.raises(IllegalTransition, match="starting -> finished"):
        c._enter(State.FINISHED)  # a run that never ran cannot finish
