"""spark_hvd.tensorflow / spark_hvd.keras training APIs through real jobs:
DistributedGradientTape, Keras DistributedOptimizer in model.fit against a single-process
reference (also with backward_passes_per_step), the callbacks' effects, load_model,
SyncBatchNormalization against a whole-batch reference, the TF1 optimizer wrapper, objects and
argument errors (tests/workers/tf_training.py); and a process started without the launcher."""

import subprocess
import sys

import pytest

from conftest import REPO, WORKERS, job_env

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


@pytest.mark.timeout(150)
def test_tf_training(job, tmp_path):
    job(2, "tf_training", tmp_path, timeout=140, env=TF_ENV).assert_ok(2)


@pytest.mark.timeout(120)
def test_tf_v1_optimizer_in_session(job):
    """TF1 DistributedOptimizer in a MonitoredTrainingSession. backward_passes_per_step=N: the
    weights move every N-th pass by the averaged sum, the global step counts passes, and an
    Adam ends with identical weights on both ranks. op=Adasum: the weights match a simulation
    of every rank's momentum step combined with Adasum."""
    r = job(2, "tf_v1_passes", timeout=110, env=TF_ENV)
    r.assert_ok(2)
    assert r.field(0, "adam") == r.field(1, "adam")


@pytest.mark.timeout(90)
def test_tf_single_process():
    """Size 1 without the launcher: API surface and docstrings, ops are identities,
    init/shutdown/init, no collective for gradients, DistributedOptimizer's step overhead."""
    proc = subprocess.run([sys.executable, str(WORKERS / "tf_single.py")], cwd=REPO,
                          env=job_env(TF_ENV), capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0 and "OK rank=0" in proc.stdout, proc.stdout + proc.stderr
