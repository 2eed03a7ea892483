"""spark_hvd.tensorflow collectives through real jobs: every op x dtype x dims x process set,
eagerly and inside tf.function, grouped forms, scaling, compression, IndexedSlices, gradients
of every op, and every error path in both modes (tests/workers/tf_collectives.py)."""

import os
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.timeout(170)
def test_tf_collectives_with_synchronous_kernels(job):
    """The op library's kernels completed before they return (SPARK_HVD_TF_SYNC_KERNELS=1: what
    it falls back to where TensorFlow's done callbacks cannot be kept past the call, see
    native/tensorflow/collective_ops.cc) pass the same matrix, errors included."""
    job(2, "tf_collectives", timeout=160,
        env=dict(TF_ENV, SPARK_HVD_TF_SYNC_KERNELS="1")).assert_ok(2)


@pytest.mark.timeout(120)
def test_tf_synchronous_kernels_report_a_session_deadlock(job):
    """What the synchronous kernels cannot do: a tf.compat.v1 graph of independent collectives
    that the ranks' executors start in different orders, on one inter-op thread, blocks each
    rank on a collective the other has not started. The core's deadlock check ends it with an
    error naming both ranks' collectives (the asynchronous kernels run it: test_tf_collectives).
    """
    job(2, "tf_collectives", "--session-deadlock", timeout=110,
        env=dict(TF_ENV, SPARK_HVD_TF_SYNC_KERNELS="1")).assert_ok(2)


def test_tf_graph_op_library_is_built():
    """Setup builds the op library (build.py; on TensorFlow's C API, so it needs no TensorFlow
    to build): a missing one would silently fall back to tf.numpy_function everywhere."""
    lib = Path(__file__).resolve().parents[1] / "spark_hvd" / "_core" / "libspark_hvd_tf.so"
    assert lib.exists(), f"{lib} was not built; run `python build.py`"


@pytest.mark.parametrize("library", ["missing", "not an op library", "no such op", "disabled"])
def test_tf_graph_op_fallback_is_announced(tmp_path, library):
    """Without a usable op library graphs fall back to tf.numpy_function, with a warning that
    says how to build it (none when SPARK_HVD_TF_OPS=0 asks for the fallback)."""
    core = Path(__file__).resolve().parents[1] / "spark_hvd" / "_core" / "libspark_hvd_core.so"
    path = {"missing": tmp_path / "absent.so", "not an op library": tmp_path / "junk.so",
            "no such op": core, "disabled": core}[library]
    (tmp_path / "junk.so").write_text("not a shared object")
    code = f"""
import warnings
import spark_hvd.tensorflow.collectives as C
C._GRAPH_OPS_PATH = {str(path)!r}
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    assert C.graph_ops() is None
print("WARNINGS", [str(w.message) for w in seen])
"""
    env = dict(TF_ENV, SPARK_HVD_TF_OPS="0" if library == "disabled" else "1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("WARNINGS")][0]
    if library == "disabled":
        assert line == "WARNINGS []"
    else:
        assert "build.py" in line and str(path) in line, line
