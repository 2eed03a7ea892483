"""The elastic states (TorchState, KerasState, TensorFlowState, ObjectState), the
ElasticSampler and the Keras state callbacks in real jobs through the launcher, at a fixed
size (tests/workers/elastic_states.py): sync makes every rank rank 0's, a new worker's empty
optimizer included; mismatched states raise on every rank instead of hanging; the sampler's
shards are disjoint and complete; a peer lost inside a tf.function is a HorovodInternalError
for hvd.elastic.run. The sampler's arithmetic across resets, and the states at size 1:
test_elastic_sampler.py."""

import re

import pytest

from conftest import run_job


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_", [2, 3])
def test_torch_state_sync(np_):
    run_job(np_, "elastic_states", "torch_sync", transport="shm", timeout=80).assert_ok(np_)


@pytest.mark.timeout(90)
def test_torch_state_mismatch_raises_on_every_rank():
    run_job(2, "elastic_states", "torch_mismatch", transport="shm", timeout=80).assert_ok(2)


@pytest.mark.timeout(200)
def test_keras_states_and_callbacks():
    pytest.importorskip("tensorflow")
    run_job(2, "elastic_states", "keras_sync", transport="shm", timeout=190).assert_ok(2)


@pytest.mark.timeout(200)
def test_tf_function_lost_peer_is_horovod_internal_error():
    """Rank 1 exits without a word: rank 0's tf.function collectives (the op library's
    allreduce, a tf.numpy_function broadcast) and model.fit fail with an error that
    hvd.elastic.run's wrapper raises as HorovodInternalError naming rank 1."""
    pytest.importorskip("tensorflow")
    r = run_job(2, "elastic_states", "tf_lost_peer", transport="shm", timeout=190,
                env={"SPARK_HVD_PEER_TIMEOUT_SECONDS": 5})
    r.assert_ok(1, returncode=None)
    assert r.markers(0), r.describe()


# -- through hvd.elastic.run in an elastic job ------------------------------------------------

def _elastic_job(worker, launcher_args, env, timeout=250):
    """``spark-hvd-run LAUNCHER_ARGS python tests/workers/WORKER.py``: (exit code, output)."""
    import subprocess
    import sys

    from conftest import REPO, WORKERS, job_env
    cmd = [sys.executable, "-m", "spark_hvd.runner", *launcher_args, sys.executable,
           str(WORKERS / f"{worker}.py")]
    proc = subprocess.run(cmd, cwd=REPO, env=job_env({"SPARK_HVD_START_TIMEOUT": 60, **env}),
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _discovery_after(tmp_path, marker):
    """A discovery script listing localhost:2, and 127.0.0.1:1 once ``marker`` exists."""
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho localhost:2\n[ -e {marker} ] && echo 127.0.0.1:1\n"
                      "exit 0\n")
    script.chmod(0o755)
    return str(script)


def _sampler_job(launcher_args, env):
    returncode, out = _elastic_job("elastic_sampler_train", launcher_args, env)
    epochs = re.findall(r"EPOCH rank=\d+ size=\d+ epoch=\d+ bad=(\d+)", out)
    done = re.findall(r"DONE rank=(\d+) size=(\d+) steps=\d+ weights_equal=(\w+)", out)
    assert returncode == 0 and epochs and set(epochs) == {"0"}, out
    return sorted(done), out


@pytest.mark.timeout(200)
def test_sampler_exactly_once_when_a_rank_is_killed():
    """3 ranks on two hosts; the one on 127.0.0.1 is SIGKILLed mid-epoch between commits: the
    2 survivors finish 3 epochs, each epoch's committed samples exactly once (the lost rank's
    committed ones included), equal weights."""
    done, out = _sampler_job(["-np", "3", "--min-np", "2", "-H", "localhost:2,127.0.0.1:1"],
                             {"KILL_HOST": "127.0.0.1", "KILL_STEP": 20})
    assert done == [("0", "2", "True"), ("1", "2", "True")], out


@pytest.mark.timeout(200)
def test_sampler_exactly_once_when_a_worker_joins(tmp_path):
    """2 ranks; at step 10 the discovery script starts listing a third host: the new worker
    (fresh optimizer, fresh sampler) syncs from rank 0 and the 3 ranks finish with every
    epoch's samples exactly once and equal weights."""
    marker = tmp_path / "grow"
    done, out = _sampler_job(["-np", "2", "--min-np", "2", "--max-np", "3",
                              "--host-discovery-script", _discovery_after(tmp_path, marker)],
                             {"GROW_MARKER": str(marker), "GROW_STEP": 10})
    assert done == [(str(r), "3", "True") for r in range(3)], out


@pytest.mark.timeout(240)
def test_sampler_exactly_once_across_a_removal_and_an_addition(tmp_path):
    """3 ranks; the one on 127.0.0.1 is SIGKILLed mid-epoch, its host blacklisted for 1-2 s,
    then the discovery script lists it again and a new worker there joins: the ranks finish
    at size 3, every epoch's committed samples exactly once (the lost rank's included, and
    none repeated by the newcomer), equal weights."""
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\necho 127.0.0.1:1\n")
    script.chmod(0o755)
    done, out = _sampler_job(["-np", "3", "--min-np", "2", "--max-np", "3",
                              "--host-discovery-script", str(script),
                              "--blacklist-cooldown-range", "1", "2"],
                             {"KILL_HOST": "127.0.0.1", "KILL_STEP": 16,
                              "KILL_ONCE": str(tmp_path / "killed")})
    assert done == [(str(r), "3", "True") for r in range(3)], out
    assert "blacklisted host 127.0.0.1" in out and "reset 2" in out, out


def _keras_job(launcher_args, env):
    returncode, out = _elastic_job("elastic_keras_train", launcher_args, env)
    epochs = re.findall(r"EPOCH rank=0 size=\d+ epoch=(\d+)", out)
    done = re.findall(r"DONE rank=(\d+) size=(\d+) epoch=(\d+) fits=\d+ weights_equal=(\w+)",
                      out)
    assert returncode == 0 and epochs == [str(e) for e in range(6)], out
    return sorted(done), out


KERAS_BACKENDS = ["tensorflow", "torch", "jax"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_keras_fit_survives_a_lost_rank_with_the_right_epochs(backend):
    """A rank killed inside model.fit: the survivors' fit fails with the backend's error (a
    TensorFlow op's, torch's, or JAX's from the gradients' io_callback), which
    hvd.elastic.run takes for HorovodInternalError; they restore, resume with
    fit(initial_epoch=state.epoch) and train each of the 6 epochs once (#2844)."""
    pytest.importorskip("tensorflow" if backend == "tensorflow" else backend)
    done, out = _keras_job(["-np", "3", "--min-np", "2", "-H", "localhost:2,127.0.0.1:1"],
                           {"KILL_HOST": "127.0.0.1", "KILL_EPOCH": 2, "KERAS_BACKEND": backend})
    assert done == [("0", "2", "6", "True"), ("1", "2", "6", "True")], out
    assert out.count(f"backend={backend}") == 2, out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_keras_new_worker_with_an_unbuilt_optimizer_joins(tmp_path, backend):
    """A worker joins at epoch 1: its Adam has no slots yet; the sync builds them and gives it
    rank 0's; the 3 ranks train the remaining epochs once each, with equal weights."""
    pytest.importorskip("tensorflow" if backend == "tensorflow" else backend)
    marker = tmp_path / "grow"
    done, out = _keras_job(["-np", "2", "--min-np", "2", "--max-np", "3",
                            "--host-discovery-script", _discovery_after(tmp_path, marker)],
                           {"GROW_MARKER": str(marker), "GROW_EPOCH": 1,
                            "KERAS_BACKEND": backend})
    assert out.count(f"backend={backend}") == 3, out
    assert done == [(str(r), "3", "6", "True") for r in range(3)], out
