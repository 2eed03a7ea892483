"""spark_hvd.tensorflow collectives through real jobs: every op x dtype x dims x process set,
eagerly and inside tf.function, grouped forms, scaling, compression, IndexedSlices, gradients
of every op, and every error path in both modes (tests/workers/tf_collectives.py)."""

import pytest

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


@pytest.mark.timeout(170)
@pytest.mark.parametrize("np_", [2, 3])
def test_tf_collectives(job, np_):
    job(np_, "tf_collectives", timeout=160, env=TF_ENV).assert_ok(np_)
