"""spark_hvd.torch training APIs through real jobs: DistributedOptimizer (averaging, Sum,
predivide, fp16, groups, backward_passes_per_step, sparse, clipping, warnings and errors,
unused and dynamically frozen parameters, process sets), broadcast of parameters, optimizer
state (SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, LBFGS) and objects, SyncBatchNorm against
a single-process reference, model parallelism, the timeline; join() with uneven data;
gradients in shared arenas."""

import os

import pytest


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np_", [2, 3])
def test_torch_training(job, tmp_path, np_):
    job(np_, "torch_training", tmp_path, timeout=140).assert_ok(np_)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_,transport", [(2, "shm"), (3, "shm"), (3, "tcp")])
def test_torch_join_uneven_batches(job, np_, transport):
    """Ranks with fewer batches join() and keep answering allreduces with zeros; weights match
    a single-process reference of that schedule, join() returns the last rank to join."""
    job(np_, "torch_join", timeout=80, transport=transport).assert_ok(np_)


@pytest.mark.timeout(60)
def test_torch_single_process(tmp_path):
    """A script started without the launcher is a job of size 1 (Horovod's behaviour):
    DistributedOptimizer installs no hooks, Adasum is accepted, init/shutdown/init works."""
    import subprocess
    import sys

    from conftest import REPO, WORKERS, job_env
    proc = subprocess.run([sys.executable, str(WORKERS / "torch_single.py")], cwd=REPO,
                          env=job_env(), capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0 and "OK rank=0" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.timeout(200)
@pytest.mark.parametrize("np_", [2, 3])
def test_torch_shared_gradients(job, np_):
    """Over shared memory, DistributedOptimizer's gradients are allocated in the core's shared
    arenas and reduced in place there; the trained weights are bitwise equal on every rank and
    to the same job with SPARK_HVD_SHARED_GRADIENTS=0 (gradients in torch's memory, copied
    through the shared segment), and a forked child allocates apart from the arenas."""
    shared = job(np_, "shared_arenas", "--mode", "torch", transport="shm", timeout=90)
    shared.assert_ok(np_)
    private = job(np_, "shared_arenas", "--mode", "torch", transport="shm", timeout=90,
                      env={"SPARK_HVD_SHARED_GRADIENTS": "0"})
    private.assert_ok(np_)
    for rank in range(np_):
        assert int(shared.field(rank, "inplace")) > 0, shared.describe()
        assert int(private.field(rank, "inplace")) == 0, private.describe()
        assert int(private.field(rank, "held")) == 0, private.describe()
        assert shared.field(rank, "weights") == private.field(rank, "weights")


@pytest.mark.timeout(200)
def test_torch_gradient_buckets_do_not_change_results(job):
    """SPARK_HVD_GRADIENT_BUCKET_BYTES only changes how gradients are batched for submission:
    each gradient alone (0), the default 256 KiB buckets and 1 MiB buckets train bitwise the
    same weights."""
    weights = {}
    for bucket in ("0", None, str(1 << 20)):
        env = {} if bucket is None else {"SPARK_HVD_GRADIENT_BUCKET_BYTES": bucket}
        run = job(2, "shared_arenas", "--mode", "torch", transport="shm", timeout=90, env=env)
        run.assert_ok(2)
        weights[bucket] = {run.field(rank, "weights") for rank in range(2)}
    assert len(set.union(*weights.values())) == 1, weights


@pytest.mark.timeout(200)
def test_torch_without_an_allocator_for_this_torch(job, tmp_path):
    """An installation with no allocator library for the running torch's minor (a wheel built
    for other minors): spark_hvd.torch says so once on the spark_hvd logger (INFO) and copies
    gradients through the shared segment instead; training gives the same weights."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    shutil.copytree(repo / "spark_hvd", tmp_path / "spark_hvd",
                    ignore=shutil.ignore_patterns("__pycache__", "libspark_hvd_torch_*.so"))
    probe = subprocess.run(
        [sys.executable, "-c", "import logging; logging.basicConfig(level=logging.INFO); "
         "from spark_hvd.torch import shared_gradients as s; print(s._library())"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert probe.returncode == 0 and probe.stdout.strip() == "None", probe.stderr
    assert "no shared-gradient allocator for torch" in probe.stderr, probe.stderr
    assert probe.stderr.count("shared-gradient allocator") == 1, probe.stderr
    without = job(2, "shared_arenas", "--mode", "torch", transport="shm", timeout=90,
                  env={"PYTHONPATH": str(tmp_path)})
    without.assert_ok(2)
    shared = job(2, "shared_arenas", "--mode", "torch", transport="shm", timeout=90)
    shared.assert_ok(2)
    for rank in range(2):
        assert int(without.field(rank, "inplace")) == 0, without.describe()
        assert int(shared.field(rank, "inplace")) > 0, shared.describe()
        assert without.field(rank, "weights") == shared.field(rank, "weights")
