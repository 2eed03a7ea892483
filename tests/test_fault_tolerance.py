"""Faults and intruders: a rank killed with SIGKILL mid-collective, and connections that do not
know the job secret."""

from pathlib import Path

import pytest

from conftest import alive_pids, run_job


def _read_pids(pid_dir):
    return {f.name: int(f.read_text()) for f in pid_dir.glob("*.pid")}


# The two shared-memory allreduce paths, forced whatever the size threshold; and hierarchical
# allreduce across the two simulated hosts (16 MiB: pipelined, its cross-host step on a thread
# of its own).
SHM_PATH_ENV = {"single_copy": {"SPARK_HVD_SHM_SINGLE_COPY_MIN_BYTES": 0},
                "slots": {"SPARK_HVD_SHM_SINGLE_COPY": 0},
                "hierarchical": {"HOROVOD_HIERARCHICAL_ALLREDUCE": 1}, None: {}}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_,victim,mode,transport,shm_path", [
    (2, 1, "negotiate", "shm", None),
    (2, 0, "negotiate", "shm", None),
    (2, 1, "transfer", "shm", "single_copy"),
    (2, 0, "transfer", "shm", "single_copy"),
    (2, 1, "transfer", "shm", "slots"),
    (3, 2, "transfer", "shm", "single_copy"),
    (2, 1, "negotiate", "tcp", None),
    (2, 0, "negotiate", "tcp", None),
    (2, 1, "transfer", "tcp", None),
    (2, 0, "transfer", "tcp", None),
    (3, 1, "negotiate", "shm", None),
    (3, 2, "transfer", "tcp", None),
    (3, 0, "transfer", "hosts", None),
    (4, 3, "transfer", "hosts", "hierarchical"),
    (4, 0, "transfer", "hosts", "hierarchical"),
])
def test_peer_killed(tmp_path, np_, victim, mode, transport, shm_path):
    """The victim SIGKILLs itself while the others wait in negotiation ("negotiate") or stream
    4M-float allreduces with it ("transfer"; on shared memory through either allreduce path).
    Every survivor raises HorovodInternalError within 10 s of the kill, for the blocked op, a
    pending async op and every later op, and shuts down promptly; the launcher exits non-zero;
    no process of the job is left behind."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = {"PID_DIR": pid_dir, "KILL_TIME_FILE": tmp_path / "killed_at",
           # Survivors ignore SIGTERM so they can report; the launcher SIGKILLs after this.
           "SPARK_HVD_KILL_GRACE_SECONDS": 20, **SHM_PATH_ENV[shm_path]}
    r = run_job(np_, "fault", victim, mode, transport=transport, env=env, timeout=80)
    survivors = [k for k in range(np_) if k != victim]
    for k in survivors:
        assert r.markers(k), f"rank {k} did not report\n{r.describe()}"
        assert float(r.field(k, "detect")) < 10.0, r.describe()
    for k in survivors:
        assert not [line for line in r.lines(k) if line.startswith("FAIL")], r.describe()
    assert r.returncode != 0, r.describe()
    assert "rank %d was killed by signal 9" % victim in r.stderr, r.describe()
    pids = _read_pids(pid_dir)
    assert len(pids) == np_, pids
    left = alive_pids(pids.values(), timeout=10)
    assert not left, f"processes left behind: {left}\n{r.describe()}"
    # Nor shared-memory segments (they are unlinked as soon as every peer has mapped them).
    job = r.field(survivors[0], "job")
    leaked = [p.name for p in Path("/dev/shm").glob(f"shvd-{job}*")] if job else []
    assert not leaked, leaked


# -- the job secret -------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_", [2, 3])
def test_strangers_refused(np_):
    """Raw garbage, a wrong-secret client and a silent connection to the rendezvous server, and
    a wrong-secret handshake plus a silent connection queued on rank 0's data listener ahead
    of the real peers: all refused, and the job then starts and runs normally."""
    r = run_job(np_, "security", "strangers", transport="shm", timeout=50)
    r.assert_ok(np_)
    # The silent strangers cost at most the core's 2 s handshake timeout, not the job.
    assert float(r.field(0, "init_s")) < 10, r.describe()


@pytest.mark.timeout(60)
def test_wrong_secret_cannot_join():
    """A rank whose SPARK_HVD_SECRET is wrong is rejected by the rendezvous; the other ranks
    time out naming the missing rank instead of running without it."""
    r = run_job(2, "security", "wrong_secret", transport="tcp",
                env={"SPARK_HVD_START_TIMEOUT": 4}, timeout=50)
    r.assert_ok(2)
