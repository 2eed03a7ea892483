"""A rank that stops moving (SIGSTOP) on one machine, over TCP and shared memory: frozen for
longer than the peer timeout it is not taken for lost (its kernel still answers: the timeout
bounds a silent host, not a busy or paused process), and frozen in the middle of a collective it
ends the job after SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS, where the stall inspector, which
watches negotiation, cannot see it. Lost hosts and links: tests/multihost/test_lost_hosts.py."""

import re

import pytest

from conftest import run_job

pytestmark = pytest.mark.mostly_waiting   # beside the bed in make test (scripts/run_tests.py)

STALL_SHUTDOWN = 3.0
SLACK = 7.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_frozen_rank_is_not_a_lost_one(transport):
    """Rank 1 stops itself for 4 s (after 5 allreduces) in a stream of allreduces with a 1 s peer timeout (and no
    stall shutdown): once resumed, every op completes with right sums."""
    r = run_job(2, "lost_peer", 1 << 18, 60, "", 0, 1, 5, 4, transport=transport,
                env={"SPARK_HVD_PEER_TIMEOUT_SECONDS": 1}, timeout=100)
    assert any(line.startswith("STOPPING") for line in r.lines(1)), r.describe()
    r.assert_ok(2)
    assert float(r.field(0, "seconds")) > 4, r.describe()  # it did wait for the frozen rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_frozen_rank_ends_the_job_at_stall_shutdown(transport):
    """Rank 1 stops itself for good (after 3 allreduces) while streaming 4M-float allreduces with rank 0: rank 0
    raises HorovodInternalError naming rank 1 within the stall shutdown time, and the launcher
    (which kills the frozen rank) exits non-zero."""
    r = run_job(2, "lost_peer", 1 << 22, 0, "", 0, 1, 3, 0, transport=transport,
                env={"SPARK_HVD_STALL_CHECK_TIME_SECONDS": 1,
                     "SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS": STALL_SHUTDOWN,
                     "SPARK_HVD_KILL_GRACE_SECONDS": 2}, timeout=100)
    assert r.returncode != 0, r.describe()
    stopped = [line for line in r.lines(1) if line.startswith("STOPPING")]
    errors = r.markers(0, "ERROR")
    assert stopped and errors, r.describe()
    stopped_at = float(re.search(r"at=(\S+)", stopped[0]).group(1))
    failed_at = float(re.search(r"at=(\S+)", errors[0]).group(1))
    assert failed_at - stopped_at <= STALL_SHUTDOWN + SLACK, r.describe()
    # Inside a collective the no-progress bound fires; in negotiation, the stall inspector.
    error = errors[0]
    assert re.search(r"no data moved to or from rank 1\b|rank 1\b.* has not submitted", error), error
    assert "SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS" in error, error
