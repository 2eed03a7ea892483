"""Errors: raised on every rank with a message that names the tensor and the ranks that
disagree, never a hang, and the job keeps working after each one (tests/workers/errors.py)."""

import numpy as np
import pytest

from conftest import run_job


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_,transport", [(2, "shm"), (3, "shm"), (3, "tcp")])
def test_errors_on_every_rank(np_, transport):
    """Mismatched shape (alone and inside a fused batch), dtype, op type, reduce op, prescale,
    broadcast root, allgather/alltoall trailing dims, reducescatter shape, grouped-op size (both
    directions); local errors: alltoall splits, invalid root, Adasum, unknown op, reducescatter
    Max, op+average, unsupported dtype, 0-d reducescatter, duplicate in-flight name, a process
    set the rank is not in, an unregistered set, dynamic sets disabled; before init and after
    shutdown. After each error a fresh allreduce succeeds on every rank."""
    r = run_job(np_, "errors", transport=transport, timeout=100)
    r.assert_ok(np_)


@pytest.mark.timeout(30)
def test_not_initialized_in_this_process():
    """Without init() every query and op is a ValueError telling the user to call init()."""
    import spark_hvd.numpy as hvd
    if hvd.is_initialized():
        pytest.skip("another test initialized spark_hvd in this process")
    for fn in (hvd.rank, hvd.size, hvd.local_rank, hvd.local_size, hvd.cross_rank,
               hvd.cross_size, hvd.is_homogeneous, hvd.shared_memory_enabled, hvd.stop_timeline,
               lambda: hvd.allreduce(np.ones(2), name="x"),
               lambda: hvd.allgather(np.ones(2), name="x"),
               lambda: hvd.broadcast(np.ones(2), 0, name="x"),
               lambda: hvd.alltoall(np.ones(2), name="x"),
               lambda: hvd.reducescatter(np.ones(2), name="x"),
               lambda: hvd.grouped_allreduce([np.ones(2)], name="x"),
               hvd.barrier, hvd.join,
               lambda: hvd.add_process_set([0]),
               lambda: hvd.ProcessSet([0]).size()):
        with pytest.raises(ValueError, match="init"):
            fn()
    assert hvd.gloo_built() and not hvd.gloo_enabled() and not hvd.mpi_enabled()
