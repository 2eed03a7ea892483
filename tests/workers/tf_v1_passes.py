"""tf.compat.v1 optimizers in a graph session (the TF1 recipe: MonitoredTrainingSession,
BroadcastGlobalVariablesHook, global step). backward_passes_per_step: the weights change only
on every N-th pass, by the rank-averaged sum of the passes' gradients (divided by N with
average_aggregated_gradients), the global step counts every pass, and an Adam (slots created
inside the conditional apply) keeps the ranks' weights identical. op=Adasum: every rank applies
its own gradients (momentum), the weights become their start plus the Adasum of the changes.

Usage: tf_v1_passes.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import spark_hvd.tensorflow as hvd  # noqa: E402
from _wutil import Checks, ref_adasum  # noqa: E402

v1 = tf.compat.v1


def pass_input(rank, step):
    return np.array([rank + 1.0, step + 1.0, (rank + 1) * (step + 1.0)], np.float32)


def train(c, n, rank, passes, average, make_optimizer, steps):
    """Runs ``steps`` passes of loss = sum(w * x); returns the weights after every pass."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [3])
        w = v1.get_variable("w", initializer=np.full(3, 0.5, np.float32))
        opt = hvd.DistributedOptimizer(make_optimizer(), backward_passes_per_step=passes,
                                       average_aggregated_gradients=average)
        step = v1.train.get_or_create_global_step()
        train_op = opt.minimize(tf.reduce_sum(w * x), global_step=step)
        weights, steps_seen = [], []
        with v1.train.MonitoredTrainingSession(hooks=[hvd.BroadcastGlobalVariablesHook(0)],
                                               log_step_count_steps=None) as sess:
            for s in range(steps):
                sess.run(train_op, {x: pass_input(rank, s)})
                weights.append(sess.run(w))
                steps_seen.append(int(sess.run(step)))
    c.check(steps_seen == list(range(1, steps + 1)), f"global step per pass: {steps_seen}")
    return weights


def adasum(c, n, rank, steps=3):
    """op=Adasum against a NumPy simulation of every rank's MomentumOptimizer; a variable
    registered local keeps this rank's own change."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float64, [3])
        w = v1.get_variable("w", initializer=np.full(3, 0.5))
        own = v1.get_variable("own", initializer=np.full(3, 0.25))
        opt = hvd.DistributedOptimizer(v1.train.MomentumOptimizer(0.1, 0.9), op=hvd.Adasum)
        opt.register_local_var(own)
        step = v1.train.get_or_create_global_step()
        train_op = opt.minimize(tf.reduce_sum((w * w + own * own) * x), global_step=step)
        with v1.train.MonitoredTrainingSession(hooks=[hvd.BroadcastGlobalVariablesHook(0)],
                                               log_step_count_steps=None) as sess:
            want, accum = np.full(3, 0.5), [np.zeros(3) for _ in range(n)]
            want_own, accum_own = np.full(3, 0.25), np.zeros(3)
            lr, momentum = float(np.float32(0.1)), float(np.float32(0.9))  # TF's casts
            for s in range(steps):
                sess.run(train_op, {x: pass_input(rank, s)})
                deltas = []
                for r in range(n):  # accum = momentum accum + grad; w -= lr accum
                    accum[r] = momentum * accum[r] + 2 * want * pass_input(r, s)
                    deltas.append(-lr * accum[r])
                want = want + ref_adasum(deltas)
                accum_own = momentum * accum_own + 2 * want_own * pass_input(rank, s)
                want_own = want_own - lr * accum_own
                got, got_own = sess.run([w, own])
                c.check(np.allclose(got, want, rtol=1e-10, atol=1e-12),
                        f"adasum after step {s + 1}: {got} != {want}")
                c.check(np.allclose(got_own, want_own, rtol=1e-10, atol=1e-12),
                        f"adasum local variable after step {s + 1}: {got_own} != {want_own}")
            c.check(int(sess.run(step)) == steps, "adasum: global step")


def main():
    v1.disable_eager_execution()
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    c = Checks(rank)
    for passes, average in ((2, False), (3, True)):
        steps = 2 * passes + 1
        got = c.run(f"sgd passes={passes}", train, c, n, rank, passes, average,
                    lambda: v1.train.GradientDescentOptimizer(1.0), steps)
        want, pending = np.full(3, 0.5), np.zeros(3)
        for s in range(steps):
            pending += np.mean([pass_input(r, s) for r in range(n)], axis=0)
            if (s + 1) % passes == 0:
                want = want - pending / (passes if average else 1)
                pending = np.zeros(3)
            c.check(np.allclose(got[s], want, atol=1e-5),
                    f"passes={passes} average={average} after pass {s + 1}: {got[s]} != {want}")
    adam = c.run("adam", train, c, n, rank, 2, False, lambda: v1.train.AdamOptimizer(0.1), 4)
    c.check(np.array_equal(adam[0], np.full(3, 0.5, np.float32)) and
            not np.array_equal(adam[1], adam[0]) and np.array_equal(adam[2], adam[1]),
            f"adam applies on every second pass only: {adam}")
    c.run("adasum", adasum, c, n, rank)
    c.finish(adam=",".join(f"{v:.7f}" for v in adam[-1]))


if __name__ == "__main__":
    main()
