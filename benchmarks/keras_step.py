#!/usr/bin/env python3
"""A Keras 3 train step with its gradients allreduced through the native ``SparkHvdAllreduce``
op against the same step through ``tf.numpy_function`` (the fallback) and against no
communication, side by side in one 2-rank job.

    .venv/bin/python benchmarks/keras_step.py             # 15 alternating repetitions, ~1 minute
    .venv/bin/python benchmarks/keras_step.py --reps 31

The model is benchmarks/scaling.py's keras_mlp (784-1024-1024-1024-10, 11.6 MB of gradients,
batch 128, one intra- and one inter-op thread per rank). Each variant is a ``tf.function``
step: forward, ``tape.gradient``, one grouped allreduce of the 8 gradients, SGD with momentum
(what ``spark_hvd.keras.DistributedOptimizer`` does inside ``model.fit``). The three step
functions are traced in the same process, and their timed repetitions (10 steps after the
ranks meet) alternate, so they see the same machine load; rank 0 prints medians, the
communication cost of each variant (step minus the no-communication step) and the resulting
scaling efficiency (no-communication step / step).
"""

import argparse
import os
import sys
import time


def worker(reps, steps):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    from keras import layers

    import spark_hvd.numpy as hnp
    import spark_hvd.tensorflow as hvd
    from spark_hvd.tensorflow import collectives

    hvd.init()
    if collectives.graph_ops() is None:
        sys.exit("the SparkHvdAllreduce op library is not available; run `python build.py`")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((784,))] +
                             [layers.Dense(1024, activation="relu") for _ in range(3)] +
                             [layers.Dense(10)])
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x = tf.random.normal([128, 784])
    y = tf.random.uniform([128], 0, 10, tf.int32)

    def make_step(reduce):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            if reduce:
                grads = hvd.grouped_allreduce(grads)
            opt.apply(grads, model.trainable_variables)
            return loss
        step()  # trace now: the op choice is made at trace time
        return step

    steps_by_name = {"native op": make_step(True)}
    collectives._graph_ops = False  # trace the next one as the fallback does
    steps_by_name["numpy_function"] = make_step(True)
    collectives._graph_ops = None
    steps_by_name["no communication"] = make_step(False)

    times = {name: [] for name in steps_by_name}
    order = list(steps_by_name)
    for rep in range(reps):
        for name in (order if rep % 2 == 0 else order[::-1]):
            hnp.allreduce(np.zeros(1, np.float32), name="keras_step.meet")
            t0 = time.perf_counter()
            for _ in range(steps):
                steps_by_name[name]()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    if hvd.rank() == 0:
        med = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
        base = med["no communication"]
        print(f"Keras mlp train step, 2 ranks, median of {reps} x {steps} steps\n")
        print("| variant | step ms | communication ms | efficiency |")
        print("|---|---|---|---|")
        for name, ms in med.items():
            print(f"| {name} | {ms:.2f} | {ms - base:.2f} | {base / ms * 100:.1f} % |")
        print(f"\nnative op vs numpy_function: {med['numpy_function'] - med['native op']:.2f} ms "
              "less per step")
    hvd.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.reps, args.steps)
    run = os.path.join(os.path.dirname(sys.executable), "spark-hvd-run")
    launcher = [run] if os.path.exists(run) else [sys.executable, "-m", "spark_hvd.runner"]
    cmd = launcher + ["-np", "2", sys.executable, os.path.abspath(__file__), "--worker",
                      "--reps", str(args.reps), "--steps", str(args.steps)]
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
