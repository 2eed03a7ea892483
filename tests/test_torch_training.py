"""spark_hvd.torch training APIs through real jobs: DistributedOptimizer (averaging, Sum,
predivide, fp16, groups, backward_passes_per_step, sparse, clipping, warnings and errors,
unused and dynamically frozen parameters, process sets), broadcast of parameters, optimizer
state (SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, LBFGS) and objects, SyncBatchNorm against
a single-process reference, model parallelism, the timeline; join() with uneven data;
gradients in shared arenas."""

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
