"""spark_hvd.keras on Keras 3's TensorFlow, torch and JAX backends: the same 2-rank training
(tests/workers/keras_backends.py: DistributedOptimizer, the broadcast, metric-average,
warmup and schedule callbacks, the value collectives) through the launcher, one job per
backend with KERAS_BACKEND set before Keras is imported; the accuracy each backend reaches
compared with TensorFlow's; an unsupported backend refused on every rank.

Each job costs 8-15 s (mostly importing the framework), so the training runs once per backend
(a module fixture) and the tests read its results."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import run_job

pytest.importorskip("keras")
BACKENDS = ("tensorflow", "torch", "jax")


def _job(backend, tmp_path_factory):
    pytest.importorskip("tensorflow" if backend == "tensorflow" else backend)
    out = tmp_path_factory.mktemp(f"keras-{backend}") / "result.json"
    result = run_job(2, "keras_backends", out, env={"KERAS_BACKEND": backend}, timeout=240)
    return result, out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """backend -> (JobResult, its rank 0's result file), each backend run at most once."""
    cache = {}

    def get(backend):
        if backend not in cache:
            cache[backend] = _job(backend, tmp_path_factory)
        return cache[backend]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_with_callbacks_on_backend(jobs, backend):
    """Every rank's checks pass: root's start, bitwise equal weights, averaged metrics, the
    learning rates of the warmup and the schedule, collectives giving the backend's tensors,
    and (torch, JAX) no TensorFlow loaded."""
    result, out = jobs(backend)
    result.assert_ok(2)
    assert json.loads(out.read_text())["backend"] == backend


@pytest.mark.slow
@pytest.mark.parametrize("backend", ("torch", "jax"))
def test_accuracy_matches_tensorflow(jobs, backend):
    """Same initial weights (NumPy), same data, same order: the backends differ only in
    float32 rounding (each has its own kernels and summation order), which moves the loss by
    a few parts in 10^7 here. A test-set accuracy within one sample in 512 (0.2 %) and
    per-epoch losses within 1e-4 relative leave room for such rounding to flip a borderline
    sample, yet catch any real difference in the training (a gradient not averaged, a rate
    not applied: those move the loss by percents)."""
    result, out = jobs(backend)
    result.assert_ok(2)
    reference, reference_out = jobs("tensorflow")
    reference.assert_ok(2)
    mine, tf_run = json.loads(out.read_text()), json.loads(reference_out.read_text())
    assert abs(mine["accuracy"] - tf_run["accuracy"]) <= 1 / 512 + 1e-9, (mine, tf_run)
    assert mine["accuracy"] > 0.75, mine   # it learned (chance is 0.25)
    assert mine["losses"] == pytest.approx(tf_run["losses"], rel=1e-4)
    assert mine["loss"] == pytest.approx(tf_run["loss"], rel=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_passes_per_step_on_backend(backend):
    """DistributedOptimizer(backward_passes_per_step=2) in model.fit, with and without
    average_aggregated_gradients (and, on torch and JAX, a Keras optimizer's own
    gradient_accumulation_steps=2): the weights the definition gives (computed in NumPy, the
    same on every backend), bitwise equal on both ranks, iterations counting every batch, and
    on torch and JAX one gradient allreduce per 2 batches (tests/workers/keras_accumulation.py)."""
    pytest.importorskip("tensorflow" if backend == "tensorflow" else backend)
    result = run_job(2, "keras_accumulation", env={"KERAS_BACKEND": backend}, timeout=240)
    result.assert_ok(2)


def test_unsupported_backend_is_refused_on_every_rank(tmp_path):
    """Keras' NumPy backend (inference only) is not one spark_hvd.keras can train on: importing
    it fails on each rank with the backends it supports and how to pick one."""
    script = tmp_path / "import_keras.py"
    script.write_text("import spark_hvd.keras\n")
    result = run_job(2, str(script), env={"KERAS_BACKEND": "numpy"}, timeout=120)
    assert result.returncode != 0
    for rank in (0, 1):
        err = "\n".join(result.lines(rank, "stderr"))
        assert "ValueError: spark_hvd.keras supports the Keras backends tensorflow, torch, jax" \
            in err, result.describe()
        assert "runs Keras on 'numpy'" in err and "Set KERAS_BACKEND" in err


@pytest.mark.slow
@pytest.mark.parametrize("backend", ("torch", "jax"))
def test_keras_estimator_example_on_backend(backend, tmp_path):
    """examples/spark/keras_estimator.py with KERAS_BACKEND set: a KerasEstimator fit on a
    local[2] Spark (its 2 ranks on the driver's backend), transform in a Pipeline, the
    PipelineModel saved and reloaded predicting the same."""
    pytest.importorskip(backend)
    pytest.importorskip("pyspark")
    from test_spark_cluster import ESTIMATOR_EXAMPLE, _check_estimator_example, _env, _run
    example = ESTIMATOR_EXAMPLE.parent / "keras_estimator.py"
    env = {**_env(tmp_path), "KERAS_BACKEND": backend}
    result = _run([sys.executable, example, "--rows", "2000", "--epochs", "2",
                   "--store", tmp_path / "store"], env, timeout=360)
    _check_estimator_example(result)
    assert f"Keras backend: {backend}" in result.stdout
    assert f"KerasEstimator: training on Keras' {backend} backend" in result.stdout, \
        result.stdout[-3000:]
