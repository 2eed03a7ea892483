"""DistributedOptimizer(backward_passes_per_step=2) on the Keras backend named by KERAS_BACKEND:
``model.fit`` of a linear model, 4 batches per rank, the same on every backend.

Every rank checks: the weights after training equal what the definition gives, computed here
in NumPy (every 2 batches, each rank's 2 gradients summed, averaged across the ranks, divided
by 2 with ``average_aggregated_gradients``, one SGD step), for both settings of
``average_aggregated_gradients``; the weights are bitwise equal on every rank;
``optimizer.iterations`` counted every batch (4); and, on torch and JAX, the gradients crossed
between the ranks once per 2 batches (the backend's grouped allreduce counted where spark_hvd
hands it to the core). A Keras optimizer made with ``gradient_accumulation_steps=2`` (Keras'
own accumulation, averaged over its steps) reduces once per 2 batches too, and one made with
``gradient_accumulation_steps=3`` is refused with backward_passes_per_step=2, naming both.

Usage: keras_accumulation.py
"""

import hashlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import spark_hvd.keras as hvd  # noqa: E402
from _wutil import Checks  # noqa: E402

BACKEND = keras.backend.backend()
FEATURES, BATCH, BATCHES, PASSES, LR = 4, 2, 4, 2, 0.1

# The gradient allreduces spark_hvd hands the core (torch, JAX), counted where they leave the
# backend's code: the accumulation must call them once per update, not once per batch.
calls = {"n": 0}


def count_calls(module, attr):
    real = getattr(module, attr)

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)
    setattr(module, attr, counted)


if BACKEND == "jax":
    from spark_hvd import numpy as np_ops
    count_calls(np_ops, "grouped_allreduce")
elif BACKEND == "torch":
    from spark_hvd.torch import collectives
    count_calls(collectives, "grouped_allreduce_async")


def data(rank):
    rng = np.random.default_rng(100 + rank)
    x = rng.integers(-3, 4, (BATCH * BATCHES, FEATURES)).astype(np.float32)
    y = rng.integers(-3, 4, (BATCH * BATCHES, 1)).astype(np.float32)
    return x, y


W0 = np.arange(1, FEATURES + 1, dtype=np.float32).reshape(FEATURES, 1) / 10


def expected(size, average):
    """The weights the definition gives, in float64."""
    w = W0.astype(np.float64)
    per_rank = [data(r) for r in range(size)]
    for update in range(BATCHES // PASSES):
        total = np.zeros_like(w)
        for x, y in per_rank:
            for b in range(update * PASSES, (update + 1) * PASSES):
                xb = x[b * BATCH:(b + 1) * BATCH].astype(np.float64)
                yb = y[b * BATCH:(b + 1) * BATCH].astype(np.float64)
                total += 2.0 / BATCH * xb.T @ (xb @ w - yb)   # d/dw mean((xw - y)^2)
        grad = total / size
        if average:
            grad /= PASSES
        w = w - LR * grad
    return w


def train(optimizer, rank):
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(1, use_bias=False)])
    model.set_weights([W0])
    model.compile(optimizer=optimizer, loss="mean_squared_error")
    x, y = data(rank)
    before = calls["n"]
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model, calls["n"] - before


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    c = Checks(rank)
    cases = [("backward_passes_per_step=2", False, lambda: hvd.DistributedOptimizer(
                  keras.optimizers.SGD(LR), backward_passes_per_step=PASSES)),
             ("backward_passes_per_step=2, average_aggregated_gradients", True,
              lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(LR),
                                               backward_passes_per_step=PASSES,
                                               average_aggregated_gradients=True))]
    if BACKEND != "tensorflow":
        cases.append(("Keras' gradient_accumulation_steps=2", True,
                      lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(
                          LR, gradient_accumulation_steps=PASSES))))
    for what, average, make in cases:
        optimizer = make()
        model, reduces = train(optimizer, rank)
        got = model.get_weights()[0]
        want = expected(size, average)
        c.check(np.allclose(got, want, rtol=1e-5, atol=1e-6),
                f"{what}: the weights the definition gives ({got.ravel()} vs {want.ravel()})")
        digest = hashlib.sha256(np.ascontiguousarray(got).tobytes()).hexdigest()[:16]
        everyone = hvd.allgather_object(digest)
        c.check(len(set(everyone)) == 1, f"{what}: bitwise equal on every rank {everyone}")
        iterations = int(keras.ops.convert_to_numpy(optimizer.iterations))
        c.check(iterations == BATCHES, f"{what}: iterations counts every batch ({iterations})")
        if BACKEND != "tensorflow":
            c.check(reduces == BATCHES // PASSES,
                    f"{what}: gradients reduced once per {PASSES} batches ({reduces} times)")
    # Two accumulations that disagree (or would stack, on TensorFlow) are refused by name.
    try:
        hvd.DistributedOptimizer(keras.optimizers.SGD(LR, gradient_accumulation_steps=3),
                                 backward_passes_per_step=PASSES)
    except ValueError as e:
        c.check("gradient_accumulation_steps=3" in str(e) and "give only one" in str(e),
                f"conflicting accumulation refused: {e}")
    else:
        c.fail("backward_passes_per_step=2 with gradient_accumulation_steps=3 was accepted")
    c.finish(backend=BACKEND)


if __name__ == "__main__":
    main()
