"""Horovod's classic TensorFlow 1 recipe (``tf.compat.v1`` graph, ``MonitoredTrainingSession``)
on spark_hvd, as it still runs on TensorFlow 2.21.

    spark-hvd-run -np 2 python examples/tensorflow/mnist_v1_session.py --steps 200

TF 2.21 keeps ``tf.compat.v1`` graphs, sessions, hooks and ``tf.compat.v1.train`` optimizers;
Keras 3 layers cannot be used in such a graph, so the model is written with plain ops. Trains on
synthetic MNIST-shaped data (see examples/keras/mnist.py). The Horovod steps are marked
"Horovod:".
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import spark_hvd.tensorflow as hvd  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "keras"))
from mnist import synthetic_mnist  # noqa: E402

v1 = tf.compat.v1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="spark_hvd TensorFlow 1 (compat.v1) MNIST example")
    p.add_argument("--batch-size", type=int, default=64, help="batch size per rank")
    p.add_argument("--steps", type=int, default=300, help="training steps (all ranks)")
    p.add_argument("--lr", type=float, default=0.001, help="learning rate for one rank")
    p.add_argument("--train-samples", type=int, default=6000)
    p.add_argument("--test-samples", type=int, default=1000)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--checkpoint-dir", default=None, help="rank 0 writes checkpoints here")
    p.add_argument("--num-threads", type=int, default=2, help="TF threads per rank")
    return p.parse_args(argv)


def model(images, num_classes=10):
    """A small MLP in plain ops (variables live in the graph's global collection)."""
    x = tf.reshape(images, [-1, 784])
    init = v1.glorot_uniform_initializer(seed=None)
    w1 = v1.get_variable("w1", [784, 64], initializer=init)
    b1 = v1.get_variable("b1", [64], initializer=v1.zeros_initializer())
    w2 = v1.get_variable("w2", [64, num_classes], initializer=init)
    b2 = v1.get_variable("b2", [num_classes], initializer=v1.zeros_initializer())
    return tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2


def main(argv=None):
    args = parse_args(argv)
    v1.disable_eager_execution()
    # Horovod: initialize.
    hvd.init()

    x, y = synthetic_mnist(args.train_samples, seed=1)
    xte, yte = synthetic_mnist(args.test_samples, seed=2)
    # Horovod: each rank reads its own shard.
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]

    images = v1.placeholder(tf.float32, [None, 28, 28])
    labels = v1.placeholder(tf.int64, [None])
    v1.set_random_seed(hvd.rank())  # different initial weights: the broadcast must fix them
    logits = model(images)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                         logits=logits))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.float32))

    # Horovod: scale the learning rate by the number of ranks, average the gradients.
    opt = v1.train.AdamOptimizer(args.lr * hvd.size())
    opt = hvd.DistributedOptimizer(opt)
    global_step = v1.train.get_or_create_global_step()
    train_op = opt.minimize(loss, global_step=global_step)

    hooks = [
        # Horovod: broadcast rank 0's initial variables when the session starts.
        hvd.BroadcastGlobalVariablesHook(0),
        v1.train.StopAtStepHook(last_step=args.steps),
    ]
    # Horovod: only rank 0 writes checkpoints.
    checkpoint_dir = args.checkpoint_dir if hvd.rank() == 0 else None
    config = v1.ConfigProto(intra_op_parallelism_threads=args.num_threads,
                            inter_op_parallelism_threads=args.num_threads)
    rng = np.random.default_rng(hvd.rank())
    with v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir, hooks=hooks,
                                           config=config, save_summaries_steps=None,
                                           save_summaries_secs=None,
                                           log_step_count_steps=None) as sess:
        while not sess.should_stop():
            idx = rng.integers(0, len(x), args.batch_size)
            _, step, value = sess.run([train_op, global_step, loss],
                                      {images: x[idx], labels: y[idx]})
            if step % args.log_every == 0 and hvd.rank() == 0:
                print(f"Step #{step}\tLoss: {value:.6f}", flush=True)
        final = sess._tf_sess().run(accuracy, {images: xte, labels: yte})
        weights = sess._tf_sess().run(v1.trainable_variables())
    digest = float(sum(np.abs(w).sum() for w in weights))
    digests = hvd.allgather_object(digest)
    if hvd.rank() == 0:
        print(f"FINAL accuracy={final:.4f} ranks={hvd.size()} "
              f"same_on_all_ranks={len(set(digests)) == 1}", flush=True)
    return final


if __name__ == "__main__":
    main()
