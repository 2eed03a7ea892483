"""The TensorFlow and Keras examples run as documented: spark-hvd-run -np 2 python examples/..."""

import re

import pytest

from conftest import REPO

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


def final_accuracy(r):
    final = [line for line in r.lines(0) if line.startswith("FINAL")]
    assert final, r.describe()
    return final[0], float(re.search(r"accuracy=(\S+)", final[0]).group(1))


@pytest.mark.timeout(120)
def test_keras_mnist(job, tmp_path):
    """model.fit with DistributedOptimizer and the callbacks: learns, checkpoints on rank 0
    only, prints on rank 0 only."""
    ckpt = tmp_path / "ckpt"
    r = job(2, str(REPO / "examples" / "keras" / "mnist.py"), "--epochs", "2",
            "--train-samples", "1200", "--test-samples", "300", "--checkpoint-dir", ckpt,
            timeout=110, env=TF_ENV)
    assert r.returncode == 0, r.describe()
    _, accuracy = final_accuracy(r)
    assert accuracy > 0.5, r.describe()
    assert not r.lines(1), "rank 1 printed:\n" + "\n".join(r.lines(1))
    assert sorted(p.name for p in ckpt.iterdir()) == ["checkpoint-1.keras", "checkpoint-2.keras"]


@pytest.mark.timeout(120)
def test_tf_gradient_tape_mnist(job, tmp_path):
    r = job(2, str(REPO / "examples" / "tensorflow" / "mnist_gradient_tape.py"), "--steps", "40",
            "--train-samples", "1200", "--test-samples", "300", "--log-every", "20",
            "--checkpoint-dir", tmp_path, timeout=110, env=TF_ENV)
    assert r.returncode == 0, r.describe()
    line, accuracy = final_accuracy(r)
    assert accuracy > 0.5 and "same_on_all_ranks=True" in line, r.describe()
    assert (tmp_path / "final.weights.h5").exists()


@pytest.mark.timeout(120)
def test_tf_v1_session_mnist(job, tmp_path):
    """The TF1 recipe: tf.compat.v1 graph, DistributedOptimizer, BroadcastGlobalVariablesHook
    in a MonitoredTrainingSession that checkpoints on rank 0."""
    r = job(2, str(REPO / "examples" / "tensorflow" / "mnist_v1_session.py"), "--steps", "60",
            "--train-samples", "1200", "--test-samples", "300", "--log-every", "20",
            "--checkpoint-dir", tmp_path, timeout=110, env=TF_ENV)
    assert r.returncode == 0, r.describe()
    line, accuracy = final_accuracy(r)
    assert accuracy > 0.5 and "same_on_all_ranks=True" in line, r.describe()
    assert any(p.name.startswith("model.ckpt-60") for p in tmp_path.iterdir())
