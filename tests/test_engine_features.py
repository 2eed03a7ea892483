"""Engine features through the launcher: tensor fusion and the response cache, re-init,
timeline, stall inspector, join, configuration aliases, shutdown while others still run
(tests/workers/features.py)."""

import pytest

from conftest import load_timeline, run_job

# Beside the bed in make test (scripts/run_tests.py); where the engine threads run when they
# share a CPU is tested in test_engine_placement.py, which needs the CPUs to itself.
pytestmark = pytest.mark.mostly_waiting


# -- fusion and the response cache ----------------------------------------------------------

@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_,transport,env", [
    (1, "shm", {}),
    (2, "shm", {}),
    (3, "shm", {"SPARK_HVD_FUSION_THRESHOLD": "0"}),
    (3, "tcp", {}),
    (2, "tcp", {"SPARK_HVD_FUSION_THRESHOLD": "0"}),
    (3, "tcp", {"SPARK_HVD_CACHE_CAPACITY": "0"}),
    (2, "hosts", {"SPARK_HVD_CACHE_CAPACITY": "5", "SPARK_HVD_FUSION_THRESHOLD": "200"}),
    (2, "shm", {"SPARK_HVD_OVERLAP": "1"}),
    (3, "tcp", {"SPARK_HVD_OVERLAP": "0"}),
    (2, "shm", {"SPARK_HVD_CYCLE_TIME": "0"}),
], ids=["one-rank", "shm-2", "shm-3-nofusion", "tcp-3", "tcp-2-nofusion", "tcp-3-nocache",
        "hosts-2-tinycache-tinyfusion", "shm-2-overlap", "tcp-3-defer", "shm-2-nocycle"])
def test_fusion_and_cache(np_, transport, env):
    """120 small tensors of mixed dtypes/ops submitted asynchronously (odd ranks in reverse
    order) equal the one-by-one results bitwise and the NumPy reference; three rounds reuse the
    names (response cache), the last with new shapes under the same names. Also scaled ops
    fused together. One rank takes the core's shortcut for one-member sets."""
    r = run_job(np_, "features", "fusion", transport=transport, env=env, timeout=80)
    r.assert_ok(np_)
    if "SPARK_HVD_FUSION_THRESHOLD" in env:
        assert r.field(0, "threshold") == env["SPARK_HVD_FUSION_THRESHOLD"]
    if "SPARK_HVD_CACHE_CAPACITY" in env:
        assert r.field(0, "cache") == env["SPARK_HVD_CACHE_CAPACITY"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", ["1", "0"])
@pytest.mark.parametrize("np_,transport", [(2, "shm"), (3, "tcp")])
def test_progress_without_waiting(np_, transport, overlap):
    """Async ops finish while every rank sleeps without waiting or polling, whether the engine
    overlaps (runs collectives as soon as a burst pauses) or defers (collects until awaited,
    capped at 100 cycle times, 50 ms)."""
    r = run_job(np_, "features", "progress", transport=transport,
                env={"SPARK_HVD_OVERLAP": overlap}, timeout=50)
    r.assert_ok(np_)
    assert r.field(0, "overlap") == overlap


@pytest.mark.parametrize("name,value,message", [
    ("SPARK_HVD_OVERLAP", "sometimes", "SPARK_HVD_OVERLAP must be auto, 1 or 0"),
    ("SPARK_HVD_SHM_SINGLE_COPY_MIN_BYTES", "16M",
     "SPARK_HVD_SHM_SINGLE_COPY_MIN_BYTES='16M' is not a number"),
    ("SPARK_HVD_SHM_SINGLE_COPY_MIN_BYTES", "-1",
     "SPARK_HVD_SHM_SINGLE_COPY_MIN_BYTES must be >= 0"),
    ("SPARK_HVD_SHM_CHUNK_BYTES", "-4096", "SPARK_HVD_SHM_CHUNK_BYTES must be >= 0"),
    ("SPARK_HVD_SHM_PIPE_BYTES", "4 MiB", "SPARK_HVD_SHM_PIPE_BYTES='4 MiB' is not a number"),
    ("SPARK_HVD_TCP_BUFFER_BYTES", "-1", "SPARK_HVD_TCP_BUFFER_BYTES must be >= 0"),
    ("SPARK_HVD_PEER_TIMEOUT_SECONDS", "-5", "SPARK_HVD_PEER_TIMEOUT_SECONDS must be >= 0"),
    ("SPARK_HVD_PEER_TIMEOUT_SECONDS", "30s", "SPARK_HVD_PEER_TIMEOUT_SECONDS='30s' is not a number"),
])
def test_bad_setting_is_refused(name, value, message):
    """A bad setting fails init with a message naming the variable (the launcher then stops
    the other rank, which may or may not have printed its own)."""
    r = run_job(2, "features", "progress", transport="tcp", env={name: value}, timeout=50)
    assert r.returncode != 0
    assert message in r.stdout + r.stderr, r.describe()


# -- re-init --------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_,transport", [(2, "shm"), (2, "tcp"), (3, "hosts")])
def test_reinit(np_, transport):
    """init -> ops -> shutdown three times in one process, with static process sets each time."""
    r = run_job(np_, "features", "reinit", transport=transport, timeout=50)
    r.assert_ok(np_)


# -- timeline -------------------------------------------------------------------------------

def assert_balanced(phases):
    for tensor, seq in phases.items():
        stack = []
        for ph, name in seq:
            if ph == "B":
                stack.append(name)
            elif ph == "E":
                assert stack and stack.pop() == name, f"{tensor}: unbalanced {seq}"
        assert not stack, f"{tensor}: unfinished phases {stack}"


OPS = {"allreduce_one": "ALLREDUCE", "allgather_one": "ALLGATHER",
       "broadcast_one": "BROADCAST", "alltoall_one": "ALLTOALL",
       "reducescatter_one": "REDUCESCATTER"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_timeline(tmp_path, transport):
    """SPARK_HVD_TIMELINE records from init; start_timeline() switches to a new file (with
    cycle marks), stop_timeline() ends it. Both files are valid JSON with a row per op and
    tensor named as Horovod's ("allreduce.<name>"), NEGOTIATE_<OP> and the op's phase in it, the fusion-buffer copies for fused tensors (TCP; the
    shared-memory group reduces fused tensors in place), and balanced B/E events."""
    env_file, api_file = tmp_path / "env.json", tmp_path / "api.json"
    r = run_job(3, "features", "timeline", api_file, transport=transport,
                env={"SPARK_HVD_TIMELINE": env_file}, timeout=50)
    r.assert_ok(3)
    for path, prefix in ((env_file, "env."), (api_file, "api.")):
        phases = load_timeline(path)
        assert_balanced(phases)
        # Tensors rank 0 submitted while this file was not being written must have no phases
        # in it. (Other ranks' "rank N ready" marks for them may have arrived at rank 0 just
        # before it switched files: those are right to be there.)
        other = "api." if prefix == "env." else "env."
        # Rows are named as Horovod's: "<op>.<tensor name>".
        stray = {n: seq for n, seq in phases.items() if isinstance(n, str)
                 and n.split(".", 1)[1].startswith(("after_stop.", other))
                 and any(ph != "i" for ph, _ in seq)}
        assert not stray, stray
        for op, phase in OPS.items():
            row = f"{phase.lower()}.{prefix}{op}"
            got = {p for _, p in phases[row]}
            assert {f"NEGOTIATE_{phase}", phase} <= got, (row, got)
        for k in range(3):
            got = {p for _, p in phases[f"allreduce.{prefix}fused.{k}"]}
            want = {"NEGOTIATE_ALLREDUCE", "ALLREDUCE"}
            if transport == "tcp":
                want |= {"MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"}
            assert want <= got, (k, got)
    cycles = [p for _, p in load_timeline(api_file).get(0, [])]
    assert "CYCLE_START" in cycles


@pytest.mark.timeout(60)
def test_timeline_launcher_flag(tmp_path):
    """--timeline-filename reaches the ranks; HOROVOD_TIMELINE is honoured as an alias."""
    path = tmp_path / "flag.json"
    r = run_job(2, "features", "timeline", transport="shm", launcher_args=[
        "--timeline-filename", path], timeout=50)
    r.assert_ok(2)
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE"} <= {
        p for _, p in load_timeline(path)["allreduce.env.allreduce_one"]}
    path = tmp_path / "alias.json"
    r = run_job(2, "features", "timeline", transport="tcp", env={"HOROVOD_TIMELINE": path},
                timeout=50)
    r.assert_ok(2)
    assert "allreduce.env.fused.0" in load_timeline(path)


# -- stall inspector ------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_stall_warning():
    """A rank 3 s late with a tensor makes rank 0 warn, naming the tensor and the missing rank;
    the op then completes."""
    r = run_job(3, "features", "stall_warning", 3, transport="shm",
                env={"SPARK_HVD_STALL_CHECK_TIME_SECONDS": 1}, timeout=50)
    r.assert_ok(3)
    warnings = [line for line in r.lines(0, "stderr") if "Stall detected" in line]
    assert warnings, r.describe()
    # The missing rank is named with its host ("rank 2 on localhost has not submitted it").
    assert any("'late_tensor'" in w and "ranks [0, 1]" in w and "but rank 2 on " in w
               for w in warnings), warnings


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_stall_shutdown(transport):
    """Ranks that wait for tensors nobody else submits: after
    SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS every rank gets HorovodInternalError (not a hang),
    for the stalled op and later ones."""
    r = run_job(3, "features", "stall_shutdown", transport=transport,
                env={"SPARK_HVD_STALL_CHECK_TIME_SECONDS": 1,
                     "SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS": 2,
                     # a deadlock, which the deadlock check would end first
                     "SPARK_HVD_DEADLOCK_CHECK_SECONDS": 0}, timeout=50)
    r.assert_ok(3)
    for k in range(3):
        assert float(r.field(k, "elapsed")) < 15


# -- deadlock check -------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("case,np_,transport", [
    ("order", 2, "shm"), ("order", 2, "tcp"), ("order", 3, "hosts"),
    ("cached", 2, "shm"), ("cached", 3, "tcp"),
    ("sets", 3, "shm"), ("skipped", 3, "hosts"),
])
def test_deadlock_check(case, np_, transport):
    """Ranks blocked in collectives that can never match (submitted in different orders, a
    skipped op, a process set op one member never submits): every rank gets
    HorovodInternalError naming each rank's pending op, within a few seconds, with the stall
    inspector at its defaults (warning at 60 s, no shutdown)."""
    r = run_job(np_, "features", "deadlock", case, transport=transport,
                env={"SPARK_HVD_DYNAMIC_PROCESS_SETS": 1}, timeout=50)
    r.assert_ok(np_)
    for k in range(np_):
        assert float(r.field(k, "elapsed")) < 20
    # Every rank is named with what it waits for.
    msg = r.field(0, "msg")
    for k in range(np_):
        assert f"rank_{k}" in msg, msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_no_deadlock_while_a_rank_computes(transport):
    """A rank that computes longer than the check's delay before submitting, and a rank whose
    second thread submits what the others wait for, are not deadlocks: the ops complete."""
    r = run_job(3, "features", "no_deadlock", transport=transport,
                env={"SPARK_HVD_DEADLOCK_CHECK_SECONDS": 2}, timeout=50)
    r.assert_ok(3)


# -- elastic primitives ----------------------------------------------------------------------

@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["shm", "tcp", "hosts"])
def test_notices_seen_at_the_same_step(transport):
    """Host-change notices posted on rank 0 at random times become visible on every rank after
    the same step (what makes elastic's check_host_updates agree without a collective)."""
    r = run_job(3, "features", "notices", transport=transport, timeout=80)
    r.assert_ok(3)
    steps = {r.field(k, "steps") for k in range(3)}
    assert len(steps) == 1, steps
    assert "None" not in steps.pop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_abort_from_another_thread_then_reinit(transport):
    """shvd_abort from a second thread fails every rank's pending op at once, naming the
    reason, and the processes init() again afterwards."""
    r = run_job(3, "features", "abort_then_reinit", transport=transport,
                env={"SPARK_HVD_DEADLOCK_CHECK_SECONDS": 0}, timeout=50)
    r.assert_ok(3)
    for k in range(3):
        assert float(r.field(k, "elapsed")) < 5


# -- the calling-thread path ---------------------------------------------------------------

@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport,threads", [("shm", "1"), ("shm", "2"), ("tcp", "1")])
def test_small_allreduces_on_the_calling_thread(transport, threads):
    """On one host, cached synchronous allreduces and barriers run on the thread that waits for
    them (no hand-off to the engine thread), while a second thread's asynchronous or
    synchronous ops go on beside them: every result exact. Over TCP they take the engine's
    path."""
    r = run_job(3, "features", "calling_thread", threads, transport=transport, timeout=80)
    r.assert_ok(3)
    here = [int(r.field(k, "here")) for k in range(3)]
    if transport == "shm":
        assert all(n >= 250 for n in here), here
    else:
        assert here == [0, 0, 0], here


# -- join -----------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_,order,transport", [
    (2, "ascending", "shm"),
    (3, "ascending", "shm"),
    (3, "descending", "shm"),
    (3, "ascending", "tcp"),
    (2, "equal", "hosts"),
])
def test_join(np_, order, transport):
    """Ranks with uneven step counts: joined ranks contribute zeros to Sum and Average (divided
    by the full size), fused tensors included; join() returns the last rank to join on every
    rank; the job goes on after everyone joined, and join() works again."""
    r = run_job(np_, "features", "join", order, transport=transport, timeout=50)
    r.assert_ok(np_)
    if order != "equal":
        steps = [3 + 2 * k for k in range(np_)]
        if order == "descending":
            steps = steps[::-1]
        last = max(range(np_), key=lambda k: steps[k])
        assert {r.field(k, "last") for k in range(np_)} == {str(last)}


# -- response cache -------------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_cached_name_on_two_process_sets():
    """A name answered last on a process set is answered for the global set when the global
    round comes (the cache's fast path checks the set; without that check this job hangs)."""
    r = run_job(4, "features", "scoped_name_clash", transport="shm",
                env={"SPARK_HVD_DYNAMIC_PROCESS_SETS": 1}, timeout=80)
    r.assert_ok(4)


# -- configuration aliases ------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_horovod_aliases(tmp_path):
    """HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME, HOROVOD_CACHE_CAPACITY and
    HOROVOD_TIMELINE configure the engine: with the fusion threshold at 0 the grouped tensors
    are reduced one by one (no fusion-buffer copies in the timeline)."""
    path = tmp_path / "aliases.json"
    r = run_job(2, "features", "config", "0", "7.5", "9", str(path), transport="tcp",
                env={"HOROVOD_FUSION_THRESHOLD": 0, "HOROVOD_CYCLE_TIME": 7.5,
                     "HOROVOD_CACHE_CAPACITY": 9, "HOROVOD_TIMELINE": path}, timeout=50)
    r.assert_ok(2)
    phases = load_timeline(path)
    for k in range(4):
        got = {p for _, p in phases[f"allreduce.cfg_group.{k}"]}
        assert "ALLREDUCE" in got and "MEMCPY_IN_FUSION_BUFFER" not in got, got
    # Control: the default threshold fuses them.
    path = tmp_path / "default.json"
    r = run_job(2, "features", "config", "", "", "", str(path), transport="tcp",
                env={"HOROVOD_TIMELINE": path}, timeout=50)
    r.assert_ok(2)
    phases = load_timeline(path)
    assert "MEMCPY_IN_FUSION_BUFFER" in {p for _, p in phases["allreduce.cfg_group.0"]}


@pytest.mark.timeout(60)
def test_our_names_win_over_horovod_aliases():
    r = run_job(2, "features", "config", "4096", "1.5", "", transport="shm",
                env={"HOROVOD_FUSION_THRESHOLD": 0, "SPARK_HVD_FUSION_THRESHOLD": 4096,
                     "HOROVOD_CYCLE_TIME": 9, "SPARK_HVD_CYCLE_TIME": 1.5}, timeout=50)
    r.assert_ok(2)


# -- shutdown while others still run --------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_,who,transport", [(2, 0, "shm"), (3, 1, "shm"), (3, 0, "tcp")])
def test_shutdown_while_others_run(np_, who, transport):
    """One rank calls shutdown() after the first op; the others' later (sync and async) ops
    fail naming the rank that shut down, and every shutdown() returns."""
    r = run_job(np_, "features", "early_shutdown", who, transport=transport, timeout=50)
    r.assert_ok(np_)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_", [2, 3])
def test_exit_without_shutdown(np_):
    """Ranks that just exit (atexit shuts spark_hvd down) while rank 0 still submits an op."""
    r = run_job(np_, "features", "exit_without_shutdown", transport="shm", timeout=50)
    r.assert_ok(np_)


# -- the synchronous path's record cache ------------------------------------------------------

def test_unnamed_sync_allreduces_are_not_cached():
    """A synchronous allreduce's packed record is kept for reuse only when the user named the
    op: unnamed ops get a new generated name each call, and their one-use records would push
    the named ones out of the cache (NumPy and torch)."""
    code = """
import numpy as np, torch
import spark_hvd.numpy as hnp, spark_hvd.torch as hvd
from spark_hvd.common import _ops
hvd.init()
a, t = np.ones(3, np.float32), torch.ones(3)
for _ in range(1500):
    hnp.allreduce_(a)
    hvd.allreduce_(t)
assert len(_ops._SYNC_RECORDS) == 0, len(_ops._SYNC_RECORDS)
for _ in range(5):
    hnp.allreduce_(a, name="named_np")
    hvd.allreduce_(t, name="named_torch")
assert len(_ops._SYNC_RECORDS) == 2, len(_ops._SYNC_RECORDS)
assert a.tolist() == [1.0] * 3 and t.tolist() == [1.0] * 3
print("OK")
"""
    import subprocess
    from conftest import PY, REPO, job_env
    done = subprocess.run([PY, "-c", code], cwd=REPO, env=job_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr
