"""spark_hvd.tensorflow collectives through real jobs: every op x dtype x dims x process set,
eagerly and inside tf.function, grouped forms, scaling, compression, IndexedSlices, gradients
of every op, and every error path in both modes (tests/workers/tf_collectives.py)."""

import pytest

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


@pytest.mark.timeout(170)
@pytest.mark.parametrize("np_", [2, 3])
def test_tf_collectives(job, np_):
    job(np_, "tf_collectives", timeout=160, env=TF_ENV).assert_ok(np_)


@pytest.mark.timeout(170)
def test_tf_collectives_without_graph_op(job):
    """The tf.numpy_function fallback (no op library, or SPARK_HVD_TF_OPS=0) passes the same
    matrix; the worker checks which op its traced allreduces use."""
    job(2, "tf_collectives", timeout=160, env=dict(TF_ENV, SPARK_HVD_TF_OPS="0")).assert_ok(2)


def test_tf_graph_op_library_is_built():
    """Setup builds the op library against the installed TensorFlow (build.py): a missing one
    would silently fall back to tf.numpy_function everywhere."""
    from pathlib import Path
    lib = Path(__file__).resolve().parents[1] / "spark_hvd" / "_core" / "libspark_hvd_tf.so"
    assert lib.exists(), f"{lib} was not built; run `python build.py` with TensorFlow installed"
