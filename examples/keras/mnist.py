"""The classic Horovod Keras MNIST recipe on spark_hvd (Keras 3, TensorFlow backend).

    spark-hvd-run -np 2 python examples/keras/mnist.py --epochs 3
    spark-hvd-run -np 2 python examples/keras/mnist.py --data mnist.npz --checkpoint-dir ckpt

Without ``--data`` it trains on synthetic MNIST-shaped data (28x28 grey images of 10 classes,
learnable, nothing downloaded). ``--data`` takes an ``.npz`` with ``x_train``, ``y_train``,
``x_test``, ``y_test`` (the layout of Keras' ``mnist.npz``).

The Horovod steps are marked "Horovod:"; everything else is plain Keras.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import spark_hvd.keras as hvd  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="spark_hvd Keras MNIST example")
    p.add_argument("--batch-size", type=int, default=64, help="batch size per rank")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01, help="learning rate for one rank")
    p.add_argument("--warmup-epochs", type=int, default=1)
    p.add_argument("--fp16-allreduce", action="store_true", help="fp16 gradient compression")
    p.add_argument("--data", default=None, help=".npz with x_train/y_train/x_test/y_test")
    p.add_argument("--train-samples", type=int, default=6000, help="synthetic training size")
    p.add_argument("--test-samples", type=int, default=1000, help="synthetic test size")
    p.add_argument("--checkpoint-dir", default=None, help="rank 0 saves a model per epoch")
    p.add_argument("--num-threads", type=int, default=1, help="TF threads per rank")
    return p.parse_args(argv)


def synthetic_mnist(n, seed):
    """MNIST-shaped data that can be learned: each class is a fixed random blocky pattern,
    samples are that pattern shifted by a pixel or two, plus noise."""
    rng = np.random.default_rng(1234)  # the class patterns: the same for every split
    blocks = (rng.random((10, 7, 7)) > 0.7).astype(np.float32)
    patterns = np.kron(blocks, np.ones((4, 4), np.float32))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n)
    images = np.empty((n, 28, 28), np.float32)
    for i, k in enumerate(labels):
        dy, dx = rng.integers(-2, 3, size=2)
        images[i] = np.roll(patterns[k], (dy, dx), axis=(0, 1))
    images += rng.normal(0, 0.3, size=images.shape).astype(np.float32)
    return images, labels


def load(args):
    if args.data:
        with np.load(args.data) as f:
            xtr, ytr, xte, yte = (f["x_train"], f["y_train"], f["x_test"], f["y_test"])
        xtr, xte = xtr.astype(np.float32) / 255.0, xte.astype(np.float32) / 255.0
    else:
        xtr, ytr = synthetic_mnist(args.train_samples, seed=1)
        xte, yte = synthetic_mnist(args.test_samples, seed=2)
    return (xtr[..., None], np.asarray(ytr, np.int64)), (xte[..., None], np.asarray(yte, np.int64))


def make_model():
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(8, 5, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(16, 5, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(10, activation="softmax"),
    ])


def main(argv=None):
    args = parse_args(argv)

    # Horovod: initialize, then pin one GPU per process (if any) and the CPU threads.
    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    tf.config.threading.set_intra_op_parallelism_threads(args.num_threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.num_threads)
    keras.utils.set_random_seed(42 + hvd.rank())

    (xtr, ytr), (xte, yte) = load(args)
    # Horovod: each rank trains on its own shard of the data.
    xtr, ytr = xtr[hvd.rank()::hvd.size()], ytr[hvd.rank()::hvd.size()]

    model = make_model()
    # Horovod: scale the learning rate by the number of ranks, and average gradients.
    scaled_lr = args.lr * hvd.size()
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(scaled_lr, momentum=0.9),
                                   compression=compression)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])

    callbacks = [
        # Horovod: start every rank from rank 0's weights.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: average the epoch's metrics over the ranks (before checkpointing).
        hvd.callbacks.MetricAverageCallback(),
        # Horovod: ramp the learning rate up to the scaled one over the first epochs.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr,
                                                 warmup_epochs=args.warmup_epochs,
                                                 verbose=1),
    ]
    # Horovod: only rank 0 writes checkpoints.
    if args.checkpoint_dir and hvd.rank() == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))

    # Horovod: progress output on rank 0 only.
    verbose = 2 if hvd.rank() == 0 else 0
    model.fit(xtr, ytr, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
              validation_data=(xte, yte), verbose=verbose)
    loss, accuracy = model.evaluate(xte, yte, batch_size=256, verbose=0)
    # Horovod: every rank evaluated the same test set with the same weights.
    accuracy = float(hvd.allreduce(np.float32(accuracy), name="final_accuracy"))
    if hvd.rank() == 0:
        print(f"FINAL accuracy={accuracy:.4f} ranks={hvd.size()}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
