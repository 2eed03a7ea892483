"""The elastic states (TorchState, KerasState, TensorFlowState, ObjectState), the
ElasticSampler and the Keras state callbacks in real jobs through the launcher, at a fixed
size (tests/workers/elastic_states.py): sync makes every rank rank 0's, a new worker's empty
optimizer included; mismatched states raise on every rank instead of hanging; the sampler's
shards are disjoint and complete; a peer lost inside a tf.function is a HorovodInternalError
for hvd.elastic.run. The sampler's arithmetic across resets: test_elastic_sampler.py."""

import pytest

from conftest import run_job


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_", [2, 3])
def test_torch_state_sync(np_):
    run_job(np_, "elastic_states", "torch_sync", transport="shm", timeout=80).assert_ok(np_)


@pytest.mark.timeout(90)
def test_torch_state_mismatch_raises_on_every_rank():
    run_job(2, "elastic_states", "torch_mismatch", transport="shm", timeout=80).assert_ok(2)


@pytest.mark.timeout(60)
def test_torch_and_object_state_at_size_one():
    run_job(1, "elastic_states", "size1", timeout=50).assert_ok(1)


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
