"""The PyTorch examples run as documented: spark-hvd-run -np 2 python examples/pytorch/..."""

import re

import numpy as np
import pytest

from conftest import REPO

EXAMPLES = REPO / "examples" / "pytorch"


@pytest.mark.timeout(120)
def test_mnist_synthetic(job, tmp_path):
    """Two epochs on synthetic MNIST: learns, checkpoints on rank 0 only, prints on rank 0."""
    ckpt = tmp_path / "ckpt"
    r = job(2, str(EXAMPLES / "mnist.py"), "--epochs", "2", "--train-samples", "2000",
            "--test-samples", "400", "--log-interval", "5", "--checkpoint-dir", ckpt,
            timeout=110)
    assert r.returncode == 0, r.describe()
    final = [line for line in r.lines(0) if line.startswith("FINAL")]
    assert final, r.describe()
    accuracy = float(re.search(r"accuracy=(\S+)", final[0]).group(1))
    assert accuracy > 0.5, r.describe()
    assert not r.lines(1), "rank 1 printed:\n" + "\n".join(r.lines(1))
    assert sorted(p.name for p in ckpt.iterdir()) == ["checkpoint-1.pt", "checkpoint-2.pt"]


@pytest.mark.timeout(120)
def test_mnist_from_file_fp16(job, tmp_path):
    """--data reads an mnist.npz-style file; --fp16-allreduce compresses gradients."""
    rng = np.random.default_rng(0)
    data = tmp_path / "mnist.npz"
    np.savez(data, x_train=rng.integers(0, 256, (256, 28, 28), dtype=np.uint8),
             y_train=rng.integers(0, 10, 256), x_test=rng.integers(0, 256, (64, 28, 28),
                                                                    dtype=np.uint8),
             y_test=rng.integers(0, 10, 64))
    r = job(2, str(EXAMPLES / "mnist.py"), "--epochs", "1", "--data", data,
            "--fp16-allreduce", "--batch-size", "32", timeout=110)
    assert r.returncode == 0, r.describe()
    assert any("Test set: Average loss" in line for line in r.lines(0)), r.describe()


@pytest.mark.timeout(120)
def test_synthetic_benchmark(job):
    r = job(2, str(EXAMPLES / "synthetic_benchmark.py"), "--num-iters", "2",
            "--num-batches-per-iter", "3", "--num-warmup-batches", "2", "--batch-size", "16",
            timeout=110)
    assert r.returncode == 0, r.describe()
    total = [line for line in r.lines(0) if line.startswith("Total img/sec on 2 rank(s)")]
    assert total and float(total[0].split(":")[1].split("+-")[0]) > 0, r.describe()
