"""Where the engine threads run (tests/workers/features.py, mode shared_cpu). Not beside other
tests in make test (no mostly_waiting marker): what the scheduler does with the second CPU is
part of what is checked."""

import pytest

from conftest import run_job


@pytest.mark.timeout(60)
@pytest.mark.parametrize("widen", ["1", "0"])
def test_engines_on_one_cpu(widen):
    """Two ranks' engine threads on one CPU (the scheduler's wake-up placement does this): in a
    large shared-memory allreduce the one that may run elsewhere moves to another allowed CPU;
    with none allowed the collective completes where they are. Affinity masks are left as they
    were."""
    r = run_job(2, "features", "shared_cpu", widen, transport="shm", timeout=50)
    r.assert_ok(2)
    shared = r.field(0, "shared")
    rank0, rank1 = (r.field(rank, "cpu").split(",") for rank in (0, 1))  # after each trial
    assert rank1 == [shared] * 5
    if widen == "0":
        assert rank0 == [shared] * 5
    elif int(r.field(0, "cpus")) > 1:
        # Read after each collective: the scheduler may move an engine back in between, rarely.
        stayed = rank0.count(shared)
        assert stayed <= 2, f"rank 0's engine stayed on CPU {shared} after {stayed} of 5: {rank0}"
