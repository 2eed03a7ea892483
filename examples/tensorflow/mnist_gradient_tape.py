"""Horovod's TensorFlow 2 recipe on spark_hvd: a custom training loop with
``DistributedGradientTape`` inside a ``tf.function``.

    spark-hvd-run -np 2 python examples/tensorflow/mnist_gradient_tape.py --steps 200

Trains on synthetic MNIST-shaped data (nothing downloaded; see examples/keras/mnist.py). The
Horovod steps are marked "Horovod:".
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import spark_hvd.tensorflow as hvd  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "keras"))
from mnist import make_model, synthetic_mnist  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="spark_hvd TensorFlow 2 MNIST example")
    p.add_argument("--batch-size", type=int, default=64, help="batch size per rank")
    p.add_argument("--steps", type=int, default=300, help="training steps (all ranks)")
    p.add_argument("--lr", type=float, default=0.001, help="learning rate for one rank")
    p.add_argument("--train-samples", type=int, default=6000)
    p.add_argument("--test-samples", type=int, default=1000)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--checkpoint-dir", default=None, help="rank 0 saves the weights at the end")
    p.add_argument("--num-threads", type=int, default=1, help="TF threads per rank")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    # Horovod: initialize, pin one GPU per process (if any) and the CPU threads.
    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    tf.config.threading.set_intra_op_parallelism_threads(args.num_threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.num_threads)
    keras.utils.set_random_seed(hvd.rank())

    x, y = synthetic_mnist(args.train_samples, seed=1)
    xte, yte = synthetic_mnist(args.test_samples, seed=2)
    # Horovod: each rank shuffles its own shard.
    shard = slice(hvd.rank(), None, hvd.size())
    dataset = (tf.data.Dataset.from_tensor_slices((x[shard, ..., None], y[shard]))
               .repeat().shuffle(1000, seed=hvd.rank()).batch(args.batch_size))

    model = make_model()
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    # Horovod: scale the learning rate by the number of ranks.
    opt = keras.optimizers.Adam(args.lr * hvd.size())

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        # Horovod: average the gradients over the ranks (one grouped allreduce).
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # Horovod: after the first step (the optimizer has created its state) make every
        # rank start from rank 0's weights and optimizer state.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    # Horovod: the same number of steps on every rank.
    for step, (images, labels) in enumerate(dataset.take(args.steps)):
        loss = training_step(images, labels, step == 0)
        if step % args.log_every == 0 and hvd.rank() == 0:
            print(f"Step #{step}\tLoss: {float(loss):.6f}", flush=True)

    accuracy = float(keras.metrics.sparse_categorical_accuracy(
        yte, model(xte[..., None], training=False)).numpy().mean())
    # Horovod: the weights are identical, so is the accuracy; check it across the ranks.
    accuracies = hvd.allgather_object(accuracy)
    if hvd.rank() == 0:
        if args.checkpoint_dir:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            model.save_weights(os.path.join(args.checkpoint_dir, "final.weights.h5"))
        print(f"FINAL accuracy={accuracy:.4f} ranks={hvd.size()} "
              f"same_on_all_ranks={len(set(accuracies)) == 1}", flush=True)
    return accuracy


if __name__ == "__main__":
    main()
