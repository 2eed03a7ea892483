"""Signals reach a rank blocked in a collective (issue 20, item 5): waits run in 50 ms slices on
the main thread, so Python's handlers run while the peer is late. Real 2-rank jobs through the
launcher (tests/workers/signals.py, tests/workers/signals_pytest_case.py)."""

import re

import pytest

pytestmark = pytest.mark.mostly_waiting   # beside the bed in make test (scripts/run_tests.py)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_signal_interrupts_a_blocked_wait(job, framework):
    """SIGINT (KeyboardInterrupt) and a SIGALRM handler's exception raise within a second in
    allreduce_, synchronize and allreduce while the peer sleeps 6 s; the interrupted ops then
    complete when it arrives (results in place, the handle waited for again), a later allreduce
    works, and shutdown with a never-matched interrupted op is clean (exit 0)."""
    r = job(2, "signals", framework, timeout=110)
    r.assert_ok(2)
    assert int(r.field(0, "worst_ms")) < 1000


@pytest.mark.timeout(120)
def test_pytest_timeout_fires_in_a_blocked_collective(job):
    """pytest-timeout's signal method fails a test stuck in a collective after its limit (1 s),
    not when the peer arrives 10 s later; the peer's op then completes with rank 0's abandoned
    one (kept in flight) and both ranks shut down (rank 0's pytest exits 1)."""
    r = job(2, "signals_pytest_case", timeout=110)
    out0 = "\n".join(r.lines(0))
    assert "Timeout" in out0, r.describe()
    m = re.search(r"1 failed in ([0-9.]+)s", out0)
    assert m, r.describe()
    # pytest's time includes init and the 1 s limit; the peer arrives 10 s after init.
    assert float(m.group(1)) < 9, r.describe()
    assert any("1 passed" in line for line in r.lines(1)), r.describe()
