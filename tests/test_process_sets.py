"""Process sets: the op matrix on dynamic sets, the add/remove API and its errors, invalid
static sets, and sets used side by side (tests/workers/process_sets.py). The op matrix on
static sets runs in test_collectives.py."""

import pytest

from conftest import run_job

DYNAMIC = {"SPARK_HVD_DYNAMIC_PROCESS_SETS": "1"}
# Hangs are bugs here: turn a stall into an error on every rank within seconds.
STALL_TO_ERROR = {"SPARK_HVD_STALL_CHECK_TIME_SECONDS": "1",
                  "SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS": "4"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np_,transport", [(3, "shm"), (2, "tcp")])
def test_op_matrix_on_dynamic_sets(np_, transport):
    """Every op x dtype on two sets added with add_process_set (and removed at the end)."""
    r = run_job(np_, "collectives", "--sets", "dynamic", transport=transport, env=DYNAMIC,
                timeout=160)
    r.assert_ok(np_)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_", [2, 3])
def test_dynamic_api(np_):
    """add_process_set / remove_process_set: ids, membership queries, ops on each set,
    duplicate / out-of-range / mismatched adds, ops on a removed set, re-adding, many cycles."""
    r = run_job(np_, "process_sets", "dynamic_api", transport="shm", env=DYNAMIC, timeout=50)
    r.assert_ok(np_)


@pytest.mark.timeout(60)
def test_invalid_static_sets():
    """init(process_sets=...) with a set given twice or a rank outside the job is a ValueError;
    a later init with valid sets works."""
    r = run_job(3, "process_sets", "static_errors", transport="shm", timeout=50)
    r.assert_ok(3)


@pytest.mark.timeout(60)
def test_unnamed_ops_on_subsets():
    """barrier() and unnamed allreduces on a subset, then unnamed ops on the global set."""
    r = run_job(3, "process_sets", "unnamed_on_subsets", transport="shm", env=STALL_TO_ERROR,
                timeout=50)
    r.assert_ok(3)


@pytest.mark.timeout(60)
def test_same_names_in_disjoint_sets():
    """Sets [0] and [1, 2] allreduce tensors named grad.0..2 at the same time (Horovod
    negotiates per process set, so this is allowed there)."""
    r = run_job(3, "process_sets", "same_name_disjoint", transport="shm", env=STALL_TO_ERROR,
                timeout=50)
    r.assert_ok(3)
