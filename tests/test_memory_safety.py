"""The core reads and writes an op's tensors until the op completes, whatever the caller does
with its handle (issue 20, item 1: discarded handles killed both ranks with SIGSEGV/SIGABRT).
Real 2-rank jobs through the launcher (tests/workers/memory_safety.py); each case ends with
tensors of a known pattern reusing the freed memory, which must stay intact."""

import pytest


@pytest.mark.timeout(120)
@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_dropped_handles(job, framework):
    """200 allreduce_async handles dropped at once (the issue's repro), then every async op
    (in place, grouped, staged non-contiguous input, core-allocated results) dropped too: no
    crash, no overwritten memory, in-place results still land, the dropped handles' buffers are
    released once their ops completed."""
    job(2, "memory_safety", "discard", framework, timeout=110).assert_ok(2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_duplicate_name_with_dropped_handle(job, framework):
    """Horovod's *_duplicate_name_error tests (allreduce, allgather, broadcast, alltoall,
    reducescatter): the duplicate is refused with a clear error, both ranks survive and later
    collectives work."""
    job(2, "memory_safety", "duplicate", framework, timeout=110).assert_ok(2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_shutdown_with_ops_in_flight(job, framework):
    """shutdown() with matched and never-matched ops in flight returns promptly, frees nothing
    the core still uses, and the ranks exit 0."""
    job(2, "memory_safety", "shutdown", framework, timeout=110).assert_ok(2)


@pytest.mark.timeout(150)
def test_tf_eager_interrupted_collectives(job):
    """TensorFlow eager collectives (no async API) interrupted by a signal handler while the
    peer is late: the exception comes within about a second, the dropped tensors stay valid
    until the ops complete when the peer arrives, and the job keeps working."""
    job(2, "memory_safety", "interrupted", "tf", timeout=140).assert_ok(2)
