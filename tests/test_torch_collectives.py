"""spark_hvd.torch collectives through real jobs: every op x dtype x dims x process set, async,
in-place, grouped, scaling, layouts, every error path, and gradients (closed form and finite
differences). One launch per size runs the whole matrix (tests/workers/torch_collectives.py)."""

import pytest


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np_", [2, 3])
def test_torch_collectives(job, np_):
    job(np_, "torch_collectives", timeout=140).assert_ok(np_)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np_", [2, 3])
def test_torch_collectives_over_tcp(job, np_):
    """The same matrix with shared memory disabled (the adapter must not depend on it)."""
    job(np_, "torch_collectives", timeout=140, transport="tcp").assert_ok(np_)
