"""spark_hvd.keras on the Keras backend named by KERAS_BACKEND (tensorflow, torch or jax): a
classifier trained by ``model.fit`` with DistributedOptimizer and the callbacks, from the same
initial weights and on the same data whatever the backend, so the tests can compare backends.

Checks, on every rank: the root's initial weights reach every rank (rank 1 starts from other
weights), the weights are bitwise equal on both ranks after training (the gradients were
averaged), epoch metrics differ between ranks before MetricAverageCallback and are their mean
after it, the warmup and schedule callbacks set the learning rates they promise, and the value
collectives return the backend's tensors. Rank 0 writes the final accuracy and loss to OUT.

Usage: keras_backends.py OUT_JSON
"""

import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

BACKEND = keras.backend.backend()
if BACKEND == "torch":
    import torch
    torch.set_num_threads(1)
    if torch.cuda.is_available():  # Keras's torch backend then trains on the current GPU
        torch.cuda.set_device(int(os.environ.get("SPARK_HVD_LOCAL_RANK", "0"))
                              % torch.cuda.device_count())
elif BACKEND == "tensorflow":
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

import spark_hvd.keras as hvd  # noqa: E402
from spark_hvd.common import gpu_counters  # noqa: E402
from _wutil import Checks  # noqa: E402

FEATURES, CLASSES, ROWS, TEST_ROWS = 8, 4, 1024, 512
BATCH, EPOCHS, WARMUP, BASE_LR = 32, 4, 2, 0.05


def blobs(rows, seed):
    """Four Gaussian blobs in 8 dimensions, overlapping enough that accuracy is not 100%."""
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(0).normal(0, 1.0, (CLASSES, FEATURES))
    y = rng.integers(0, CLASSES, rows)
    x = centres[y] + rng.normal(0, 1.0, (rows, FEATURES))
    return x.astype(np.float32), y.astype(np.int32)


def make_model(weights_seed):
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(CLASSES, activation="softmax")])
    # Initial weights from NumPy: identical on every backend for the same seed (Keras' own
    # initializers draw from each backend's generator).
    rng = np.random.default_rng(weights_seed)
    model.set_weights([rng.normal(0, 0.3, w.shape).astype(np.float32)
                       for w in model.get_weights()])
    return model


def digest(model):
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()


class Recorder(keras.callbacks.Callback):
    """Keeps the epoch logs as they are when it runs, and the learning rate of every batch."""

    def __init__(self):
        super().__init__()
        self.epoch_logs, self.batch_lrs, self.start_digest = [], [], None

    def on_train_batch_begin(self, batch, logs=None):
        if self.start_digest is None:   # after BroadcastGlobalVariablesCallback's on_train_begin
            self.start_digest = digest(self.model)

    def on_train_batch_end(self, batch, logs=None):
        hvd._backend.current().sync_model_state(self.model)
        self.batch_lrs.append(float(keras.ops.convert_to_numpy(
            self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append({k: float(v) for k, v in (logs or {}).items()})


def main():
    out_path = sys.argv[1]
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    c = Checks(rank)
    c.check(hvd._backend.name() == BACKEND == os.environ["KERAS_BACKEND"], "backend in use")

    x, y = blobs(ROWS, seed=1)
    x_test, y_test = blobs(TEST_ROWS, seed=2)
    shard = slice(rank, None, size)
    model = make_model(weights_seed=10 + rank)   # rank 1 starts elsewhere: broadcast matters
    root_start = digest(make_model(weights_seed=10))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(BASE_LR * size, momentum=0.9))
    # TensorFlow: the collectives are Python kernels, which XLA cannot compile. JAX compiles
    # its step (jit_compile "auto"), the gradients leaving it through the ordered callback.
    jit = {"jit_compile": False} if BACKEND == "tensorflow" else {}
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], **jit)

    local, averaged = Recorder(), Recorder()
    steps = (ROWS // size) // BATCH
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), local,
                 hvd.callbacks.MetricAverageCallback(), averaged,
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=BASE_LR * size,
                                                          warmup_epochs=WARMUP,
                                                          steps_per_epoch=steps),
                 hvd.callbacks.LearningRateScheduleCallback(initial_lr=BASE_LR * size,
                                                            multiplier=0.5, start_epoch=2)]
    model.fit(x[shard], y[shard], batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=callbacks)

    # Broadcast at the start, averaged gradients after: bitwise the same weights everywhere.
    c.check(local.start_digest == root_start, "rank 0's initial weights at the first step")
    digests = hvd.allgather_object(digest(model))
    c.check(len(set(digests)) == 1, f"weights bitwise equal on every rank: {digests}")

    # MetricAverageCallback: local epoch losses differ, the averaged ones are their mean.
    local_losses = hvd.allgather_object([e["loss"] for e in local.epoch_logs])
    mean = np.mean(np.array(local_losses), axis=0)
    c.check(not np.allclose(local_losses[0], local_losses[1]), "local losses differ by rank")
    c.check(np.allclose([e["loss"] for e in averaged.epoch_logs], mean, rtol=1e-6),
            "averaged losses are the ranks' mean")

    # Warmup: from BASE_LR (initial_lr / size, one batch in) up to BASE_LR * size on the last
    # warmup batch; then constant (the schedule from epoch 2: 0.5 ** 0); halved in epoch 3.
    lrs = np.array(local.batch_lrs).reshape(EPOCHS, steps)
    warm = lrs[:WARMUP].reshape(-1)
    c.check(np.all(np.diff(warm) > 0), "warmup rises batch by batch")
    c.check(np.isclose(warm[-1], BASE_LR * size, rtol=1e-5), f"warmup ends at the rate {warm[-1]}")
    c.check(np.allclose(lrs[2], BASE_LR * size, rtol=1e-5), "constant after warmup")
    c.check(np.allclose(lrs[3], BASE_LR * size * 0.5, rtol=1e-5), "schedule halves at epoch 3")
    final_lr = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    c.check(np.isclose(final_lr, BASE_LR * size * 0.5, rtol=1e-5), "the optimizer's final rate")
    # The torch and JAX backends never load TensorFlow (Keras itself does not need it).
    c.check(BACKEND == "tensorflow" or "tensorflow" not in sys.modules,
            "TensorFlow not imported")

    # Value collectives give the backend's tensors.
    total = hvd.allreduce(np.full(3, rank + 1.0, np.float32), op=hvd.Sum)
    c.check(keras.ops.is_tensor(total) and np.allclose(keras.ops.convert_to_numpy(total),
                                                       size * (size + 1) / 2),
            f"allreduce Sum gives a {BACKEND} tensor")
    gathered = keras.ops.convert_to_numpy(hvd.allgather(np.full((1, 2), rank, np.int32)))
    c.check(gathered.tolist() == [[r, r] for r in range(size)], "allgather")
    root = keras.ops.convert_to_numpy(hvd.broadcast(np.full(2, rank, np.float32), 1))
    c.check(root.tolist() == [1.0, 1.0], "broadcast")

    loss, accuracy = model.evaluate(x_test, y_test, batch_size=128, verbose=0)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"backend": BACKEND, "accuracy": float(accuracy), "loss": float(loss),
                       "losses": [e["loss"] for e in averaged.epoch_logs],
                       # Where the weights lived and what the core's GPU path did (tests/gpu).
                       "device": str(getattr(model.weights[0].value, "device", "cpu")),
                       "gpu_counters": dict(gpu_counters())}, f)
    c.finish(backend=BACKEND, accuracy=f"{accuracy:.4f}", loss=f"{loss:.5f}")


if __name__ == "__main__":
    main()
