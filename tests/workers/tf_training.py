"""spark_hvd.tensorflow / spark_hvd.keras training APIs: DistributedGradientTape (every option,
eager and traced), Keras DistributedOptimizer inside model.fit against a single-process
reference (plain and with backward_passes_per_step), the callbacks' effects (broadcast at the
start, averaged metrics, warmup and schedule learning rates, momentum correction,
BestModelCheckpoint), load_model, SyncBatchNormalization against a whole-batch reference,
the TF1 optimizer wrapper, objects, and argument errors.

Usage: tf_training.py TMPDIR

Every rank can rebuild every rank's data, so it computes the single-process reference itself.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import spark_hvd.keras as khvd  # noqa: E402
import spark_hvd.tensorflow as hvd  # noqa: E402
from _wutil import Checks, ref_adasum, seed_of  # noqa: E402


def data(rank, shape, tag, dtype=np.float32):
    rng = np.random.default_rng(seed_of(tag, rank, tuple(shape)))
    return rng.uniform(-1, 1, size=shape).astype(dtype)


def close(a, b, tol=1e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and np.allclose(a, b, rtol=tol, atol=tol)


def same_everywhere(c, what, arrays):
    digest = [np.asarray(a).tobytes() for a in arrays]
    everyone = hvd.allgather_object(digest)
    c.check(all(d == everyone[0] for d in everyone), f"{what}: differs between ranks")


# -- DistributedGradientTape ------------------------------------------------------------------

def tape_checks(c, n, rank):
    w = tf.Variable(data(0, (4, 3), "w", np.float64))
    emb = tf.Variable(data(0, (6, 3), "emb", np.float64))

    def loss_of(r, w, emb):
        x = tf.constant(data(r, (5, 4), "x", np.float64))
        ids = tf.constant([r % 6, (r + 2) % 6])
        return tf.reduce_sum(tf.tanh(x @ w) ** 2) + tf.reduce_sum(tf.gather(emb, ids) ** 2)

    def local_grads(r):
        with tf.GradientTape() as tape:
            loss = loss_of(r, w, emb)
        g = tape.gradient(loss, [w, emb])
        return [tf.convert_to_tensor(x).numpy() for x in g]

    refs = [local_grads(r) for r in range(n)]
    mean = [np.mean([g[i] for g in refs], 0) for i in range(2)]
    total = [np.sum([g[i] for g in refs], 0) for i in range(2)]

    def distributed(kw, traced):
        def step():
            with tf.GradientTape() as tape:
                loss = loss_of(rank, w, emb)
            tape = hvd.DistributedGradientTape(tape, **kw)
            return tape.gradient(loss, [w, emb])
        return tf.function(step)() if traced else step()

    cases = [("average", {}, mean, 1e-12), ("sum", {"op": hvd.Sum}, total, 1e-12),
             ("predivide", {"gradient_predivide_factor": 2.0}, mean, 1e-12),
             ("fp16", {"compression": hvd.Compression.fp16}, mean, 2e-2),
             ("groups_int", {"groups": 2}, mean, 1e-12),
             ("groups_list", {"groups": [[w, emb]]}, mean, 1e-12),
             ("sparse_as_dense", {"sparse_as_dense": True}, mean, 1e-12)]
    if not n & (n - 1):  # Adasum: power-of-two sets only (checked below otherwise)
        cases.append(("adasum", {"op": hvd.Adasum, "sparse_as_dense": True},
                      [ref_adasum([g[i] for g in refs]) for i in range(2)], 1e-10))
    for traced in (False, True):
        for name, kw, want, tol in cases:
            t = f"tape/{name}/{'function' if traced else 'eager'}"
            got = c.run(t, distributed, kw, traced)
            if got is None:
                continue
            if name == "average":
                c.check(isinstance(got[1], tf.IndexedSlices), f"{t}: embedding grad is "
                        f"{type(got[1]).__name__}, want IndexedSlices (allgathered)")
            if name == "sparse_as_dense":
                c.check(not isinstance(got[1], tf.IndexedSlices), f"{t}: not densified")
            for i in range(2):
                g = tf.convert_to_tensor(got[i]).numpy()
                c.check(close(g, want[i], tol), f"{t}/{i}: off by {np.abs(g - want[i]).max()}")
    # A tape wrapped before use (``with hvd.DistributedGradientTape(tf.GradientTape())``),
    # nested sources, and unconnected sources (None stays None).
    t = "tape/wrapped_before"
    other = tf.Variable(1.0, dtype=tf.float64)
    with hvd.DistributedGradientTape(tf.GradientTape()) as tape:
        loss = loss_of(rank, w, emb)
    got = c.run(t, tape.gradient, loss, {"w": w, "unused": other})
    if got is not None:
        c.check(got["unused"] is None and close(got["w"].numpy(), mean[0], 1e-12),
                f"{t}: {got}")
    c.check(isinstance(tape, tf.GradientTape), "tape is not a tf.GradientTape")
    if n & (n - 1):
        c.raises("tape/adasum", NotImplementedError, hvd.DistributedGradientTape, tf.GradientTape(),
                 op=hvd.Adasum, match="power-of-two")
    else:  # tf.IndexedSlices cannot be Adasum-combined: Horovod's error names the fix
        with tf.GradientTape() as tape:
            loss = loss_of(rank, w, emb)
        c.raises("tape/adasum_sparse", NotImplementedError,
                 hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient, loss, [w, emb],
                 match="sparse_as_dense")
    c.raises("tape/predivide_sum", ValueError, hvd.DistributedGradientTape, tf.GradientTape(),
             op=hvd.Sum, gradient_predivide_factor=2.0, match="gradient_predivide_factor")


# -- Keras DistributedOptimizer in model.fit --------------------------------------------------

B, STEPS, EPOCHS = 4, 3, 3


def make_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="tanh"),
                             keras.layers.Dense(2)])


def rank_data(r, tag):
    return data(r, (B * STEPS, 5), tag + "x"), data(r, (B * STEPS, 2), tag + "y")


def interleaved(n, tag, per_step):
    """The global batches in order: batch i is every rank's i-th batch, rank by rank."""
    parts = [rank_data(r, tag) for r in range(n)]
    xs, ys = [], []
    for i in range(STEPS // per_step if per_step > 1 else STEPS):
        for k in range(per_step):
            step = i * per_step + k
            for x, y in parts:
                xs.append(x[step * B:(step + 1) * B])
                ys.append(y[step * B:(step + 1) * B])
    return np.concatenate(xs), np.concatenate(ys)


class Probe(keras.callbacks.Callback):
    """Records what the callbacks before it did."""

    def __init__(self):
        super().__init__()
        self.start_weights = None
        self.lrs = []
        self.epoch_logs = []

    def on_train_begin(self, logs=None):
        self.start_weights = [v.numpy().copy() for v in self.model.trainable_variables]

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(self.model.optimizer.learning_rate.numpy()))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))


def fit_checks(c, n, rank, tmp):
    x, y = rank_data(rank, "fit")
    model = make_model(seed=100 + rank)  # different initial weights on every rank
    opt = khvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5))
    model.compile(opt, loss="mse")
    raw, averaged = Probe(), Probe()
    warmup = khvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2)
    # raw sees the broadcast start and the local metrics; averaged the averaged metrics and
    # the rate the warmup set for each batch
    callbacks = [khvd.callbacks.BroadcastGlobalVariablesCallback(0), raw,
                 khvd.callbacks.MetricAverageCallback(), warmup, averaged]
    history = c.run("fit", model.fit, x, y, batch_size=B, epochs=EPOCHS, shuffle=False,
                    verbose=0, callbacks=callbacks)
    c.check(history is not None and len(history.history.get("lr", [])) == EPOCHS,
            f"no lr in the history: {getattr(history, 'history', None)}")
    # broadcast at the start: every rank began with rank 0's weights
    start0 = [v.numpy() for v in make_model(seed=100).trainable_variables]
    c.check(raw.start_weights is not None and
            all(np.array_equal(a, b) for a, b in zip(raw.start_weights, start0)),
            "fit: did not start from rank 0's weights")
    same_everywhere(c, "fit: weights", [v.numpy() for v in model.variables])
    # averaged metrics: the mean of every rank's raw epoch logs
    everyone = hvd.allgather_object(raw.epoch_logs)
    for e, logs in enumerate(averaged.epoch_logs):
        want = np.mean([everyone[r][e]["loss"] for r in range(n)])
        c.check(abs(logs["loss"] - want) < 1e-6, f"metric average epoch {e}: {logs['loss']} "
                f"vs {want}")
    # warmup: Horovod's formula, batch by batch, then constant
    want_lrs = []
    for e in range(EPOCHS):
        for b in range(STEPS):
            if e < 2:
                epoch = e + b / STEPS + 1.0 / STEPS
                want_lrs.append(0.1 / n * (epoch * (n - 1) / 2 + 1))
            else:
                want_lrs.append(want_lrs[-1])
    c.check(close(averaged.lrs, want_lrs, 1e-6), f"warmup lrs {averaged.lrs} != {want_lrs}")
    # the same training on one process: each step on the union of the ranks' batches
    ref = make_model(seed=100)
    ref.compile(keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
    gx, gy = interleaved(n, "fit", 1)
    ref.fit(gx, gy, batch_size=B * n, epochs=EPOCHS, shuffle=False, verbose=0,
            callbacks=[khvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1,
                                                                 warmup_epochs=2)])
    for a, b in zip(model.trainable_variables, ref.trainable_variables):
        c.check(close(a.numpy(), b.numpy(), 1e-5), f"fit vs reference: off by "
                f"{np.abs(a.numpy() - b.numpy()).max()}")
    c.check(int(opt.iterations.numpy()) == EPOCHS * STEPS, f"iterations {opt.iterations}")

    # save / load_model: the optimizer is wrapped again and keeps its state
    path = os.path.join(tmp, f"model{rank}.keras")
    model.save(path)
    loaded = c.run("load_model", khvd.load_model, path)
    if loaded is not None:
        c.check(isinstance(loaded.optimizer, khvd.optimizer._DistributedOptimizer) and
                isinstance(loaded.optimizer, keras.optimizers.SGD),
                f"load_model optimizer {type(loaded.optimizer).__mro__}")
        c.check(int(loaded.optimizer.iterations.numpy()) == EPOCHS * STEPS,
                "load_model lost the optimizer state")
        c.run("fit after load_model", loaded.fit, x, y, batch_size=B, epochs=1, verbose=0,
              shuffle=False)
        same_everywhere(c, "after load_model", [v.numpy() for v in loaded.variables])
    plain = keras.models.load_model(path)
    c.check(not isinstance(plain.optimizer, khvd.optimizer._DistributedOptimizer),
            "plain keras.models.load_model returned a distributed optimizer")


def accumulation_checks(c, n, rank):
    """backward_passes_per_step=2 with averaging equals one step on twice the batch."""
    x, y = rank_data(rank, "acc")
    model = make_model(seed=7)
    opt = khvd.DistributedOptimizer(keras.optimizers.SGD(0.2), backward_passes_per_step=2,
                                    average_aggregated_gradients=True)
    model.compile(opt, loss="mse")
    steps = STEPS - STEPS % 2
    c.run("accumulate", model.fit, x[:steps * B], y[:steps * B], batch_size=B, epochs=1,
          shuffle=False, verbose=0)
    ref = make_model(seed=7)
    ref.compile(keras.optimizers.SGD(0.2), loss="mse")
    gx, gy = interleaved(n, "acc", 2)
    ref.fit(gx, gy, batch_size=2 * B * n, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.trainable_variables, ref.trainable_variables):
        c.check(close(a.numpy(), b.numpy(), 1e-5), f"accumulate vs reference: off by "
                f"{np.abs(a.numpy() - b.numpy()).max()}")
    c.check(int(opt.iterations.numpy()) == steps, f"accumulate: iterations {opt.iterations}")
    # IndexedSlices cannot be accumulated without sparse_as_dense
    emb = tf.Variable(np.ones((4, 2), np.float32))
    sparse_opt = khvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    grad = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([1]), tf.constant([4, 2]))
    c.raises("accumulate/sparse", ValueError, sparse_opt.apply_gradients, [(grad, emb)],
             match="sparse_as_dense")


def schedule_checks(c, n, rank, tmp):
    x, y = rank_data(rank, "sched")
    model = make_model(seed=3)
    model.compile(khvd.DistributedOptimizer(keras.optimizers.SGD(1.0, momentum=0.9)),
                  loss="mse")
    probe = Probe()
    best = khvd.callbacks.BestModelCheckpoint(monitor="loss")
    best.filepath = os.path.join(tmp, f"best{rank}.keras")
    sched = khvd.callbacks.LearningRateScheduleCallback(initial_lr=0.08, multiplier=0.5,
                                                       start_epoch=1)
    c.run("schedule fit", model.fit, x, y, batch_size=B, epochs=3, verbose=0, shuffle=False,
          callbacks=[sched, probe, best])
    # epoch 0 is before start_epoch: the optimizer's own rate
    want = [1.0] * STEPS + [0.08] * STEPS + [0.04] * STEPS
    c.check(close(probe.lrs, want, 1e-6), f"schedule lrs {probe.lrs} != {want}")
    c.check(os.path.exists(best.filepath), "BestModelCheckpoint saved nothing")
    # momentum correction scales SGD's velocity by new_lr / old_lr when the rate changes
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    v = tf.Variable(np.ones(3, np.float32))
    opt.apply_gradients([(tf.ones(3), v)])
    before = opt.momentums[0].numpy().copy()
    holder = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    holder.optimizer = opt
    cb = khvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5)
    cb.set_model(holder)
    cb.on_epoch_begin(1)
    cb.on_batch_begin(0)
    c.check(close(opt.momentums[0].numpy(), before * 0.5, 1e-6),
            f"momentum correction: {opt.momentums[0].numpy()} vs {before}")
    nobest = khvd.callbacks.BestModelCheckpoint()
    c.check(nobest.filepath is None and nobest.save_best_only, "BestModelCheckpoint defaults")
    c.raises("schedule/initial_lr", ValueError, khvd.callbacks.LearningRateScheduleCallback,
             None, 0.5)


# -- SyncBatchNormalization -------------------------------------------------------------------

def sync_bn_checks(c, n, rank):
    rows = [3 + r for r in range(n)]  # different batch sizes per rank
    xs = [data(r, (rows[r], 4, 3), "bn") * (r + 1) + r for r in range(n)]
    ws = [data(r, (rows[r], 4, 3), "bnw") for r in range(n)]
    layer = hvd.SyncBatchNormalization(momentum=0.5)
    ref = keras.layers.BatchNormalization(momentum=0.5)
    layer.build((None, 4, 3))
    ref.build((None, 4, 3))
    start = sum(rows[:rank])
    x_all, w_all = tf.constant(np.concatenate(xs)), tf.constant(np.concatenate(ws))
    with tf.GradientTape() as tape:
        tape.watch(x_all)
        ref_loss = tf.reduce_sum(ref(x_all, training=True) * w_all)
    ref_grad = tape.gradient(ref_loss, x_all).numpy()[start:start + rows[rank]]
    ref_out = ref(x_all, training=False).numpy()[start:start + rows[rank]]

    for traced in (False, True):
        t = f"sync_bn/{'function' if traced else 'eager'}"
        layer.moving_mean.assign(np.zeros(3, np.float32))
        layer.moving_variance.assign(np.ones(3, np.float32))
        x = tf.constant(xs[rank])

        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(layer(x, training=True) * tf.constant(ws[rank]))
            return tape.gradient(loss, x)
        grad = c.run(t, tf.function(step) if traced else step, x)
        if grad is not None:
            c.check(close(grad.numpy(), ref_grad, 1e-4),
                    f"{t}: grad off by {np.abs(grad.numpy() - ref_grad).max()}")
        c.check(close(layer.moving_mean.numpy(), ref.moving_mean.numpy(), 1e-5) and
                close(layer.moving_variance.numpy(), ref.moving_variance.numpy(), 1e-4),
                f"{t}: moving statistics {layer.moving_mean.numpy()} vs "
                f"{ref.moving_mean.numpy()}")
        out = layer(x, training=False).numpy()
        c.check(close(out, ref_out, 1e-4), f"{t}: inference output differs")
    c.raises("sync_bn/fused", ValueError, hvd.SyncBatchNormalization, fused=True)
    config = layer.get_config()
    c.check(type(hvd.SyncBatchNormalization.from_config(config)) is
            hvd.SyncBatchNormalization, "SyncBatchNormalization config round trip")


# -- TF1 optimizer, objects, value ops, errors ------------------------------------------------

def misc_checks(c, n, rank):
    # tf.compat.v1 optimizer wrapper (eagerly; the session recipe runs in the examples)
    v = tf.Variable(np.zeros(3, np.float32))
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0))
    c.check(isinstance(opt, tf.compat.v1.train.Optimizer), "v1 wrapper type")
    gv = c.run("v1/compute_gradients", opt.compute_gradients,
               lambda: tf.reduce_sum(v * tf.constant([1.0, 2.0, float(rank)])), [v])
    if gv:
        want = [1.0, 2.0, (n - 1) / 2.0]
        c.check(close(gv[0][0].numpy(), want), f"v1 averaged gradient {gv[0][0]}")
        c.run("v1/apply_gradients", opt.apply_gradients, gv)
        c.check(close(v.numpy(), [-w for w in want]), f"v1 apply: {v.numpy()}")
    # backward_passes_per_step eagerly: nothing moves on the first pass, the second applies
    # the rank-averaged sum of both passes' gradients
    acc_v = tf.Variable(np.zeros(3, np.float32))
    acc_opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                       backward_passes_per_step=2)
    for p in range(2):
        pairs = acc_opt.compute_gradients(
            lambda: tf.reduce_sum(acc_v * tf.constant([1.0, float(p), float(rank)])), [acc_v])
        acc_opt.apply_gradients(pairs)
        want = [0.0] * 3 if p == 0 else [-2.0, -1.0, -float(n - 1)]
        c.check(close(acc_v.numpy(), want), f"v1 bpps=2 eager pass {p}: {acc_v.numpy()}")
    table = tf.Variable(np.ones((4, 2), np.float32))
    sparse_opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                          backward_passes_per_step=2)
    c.raises("v1/bpps sparse", ValueError, sparse_opt.compute_gradients,
             lambda: tf.reduce_sum(tf.gather(table, [0, 2])), [table], match="sparse_as_dense")
    c.raises("v1/bpps0", ValueError, hvd.DistributedOptimizer,
             tf.compat.v1.train.GradientDescentOptimizer(1.0), backward_passes_per_step=0)
    # hvd.tensorflow.DistributedOptimizer hands Keras optimizers to spark_hvd.keras
    kopt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    c.check(isinstance(kopt, khvd.optimizer._DistributedOptimizer) and
            isinstance(kopt, keras.optimizers.Adam), "tf DistributedOptimizer(keras)")
    c.raises("keras/double_wrap", ValueError, khvd.DistributedOptimizer, kopt, match="already")
    c.raises("keras/not_optimizer", ValueError, khvd.DistributedOptimizer, object())
    c.raises("tf/not_optimizer", ValueError, hvd.DistributedOptimizer, object())
    if n & (n - 1):
        c.raises("keras/adasum", NotImplementedError, khvd.DistributedOptimizer,
                 keras.optimizers.SGD(), op=hvd.Adasum, match="power-of-two")
    else:
        c.run("keras/adasum", khvd.DistributedOptimizer, keras.optimizers.SGD(), op=hvd.Adasum)
    c.raises("keras/bpps0", ValueError, khvd.DistributedOptimizer, keras.optimizers.SGD(),
             backward_passes_per_step=0)
    c.raises("broadcast_global_variables/eager", RuntimeError, hvd.broadcast_global_variables,
             0, match="broadcast_variables")
    c.raises("keras/broadcast_global_variables", RuntimeError,
             khvd.broadcast_global_variables, 0)
    # a custom Keras optimizer is wrapped too
    class Halving(keras.optimizers.Optimizer):
        def update_step(self, gradient, variable, learning_rate):
            self.assign_sub(variable, 0.5 * gradient)
    cv = tf.Variable(np.zeros(2, np.float32))
    custom = khvd.DistributedOptimizer(Halving(learning_rate=1.0))
    c.run("custom optimizer", custom.apply_gradients,
          [(tf.constant([float(rank), 2.0]), cv)])
    c.check(close(cv.numpy(), [-(n - 1) / 4.0, -1.0]), f"custom optimizer: {cv.numpy()}")
    # objects
    obj = c.run("broadcast_object", hvd.broadcast_object, {"rank": rank, "a": [1, 2]}, 0)
    c.check(obj == {"rank": 0, "a": [1, 2]}, f"broadcast_object {obj}")
    fn = hvd.broadcast_object_fn(root_rank=n - 1)
    c.check(fn(rank) == n - 1, "broadcast_object_fn")
    c.check(hvd.allgather_object(rank * 10) == [r * 10 for r in range(n)], "allgather_object")
    # Keras value-level ops
    got = khvd.allreduce(np.full(3, rank, np.float32), op=hvd.Sum)
    c.check(close(got.numpy(), [n * (n - 1) / 2] * 3), f"keras allreduce {got}")
    c.check(khvd.allgather(np.array([rank])).numpy().tolist() == list(range(n)),
            "keras allgather")
    c.check(khvd.broadcast(np.array([rank, 5]), n - 1).numpy().tolist() == [n - 1, 5],
            "keras broadcast")
    got = khvd.reducescatter(np.ones((n, 2), np.float32) * rank, op=hvd.Sum)
    c.check(close(got.numpy(), [[n * (n - 1) / 2] * 2]), f"keras reducescatter {got}")
    c.check(khvd.size() == n and khvd.rank() == rank and khvd.local_size() >= 1,
            "keras topology")


# -- local variables (model parallelism) -------------------------------------------------------

def local_layers(r):
    """A shared layer (rank 0's values: the others get them by broadcast or hold them already)
    and rank r's own layer, with rank r's values."""
    shared = keras.layers.Dense(3, activation="tanh", name="shared")
    own = keras.layers.Dense(2, name="own")
    shared.build((None, 4))
    own.build((None, 3))
    for layer, who, tag in ((shared, 0, "shared"), (own, r, "own")):
        layer.kernel.assign(data(who, tuple(layer.kernel.shape), tag + "k"))
        layer.bias.assign(data(who, tuple(layer.bias.shape), tag + "b"))
    return shared, own


def local_variable_checks(c, n, rank):
    """Local variables: never averaged, divided by the set size unless scale_local_gradients
    is False; the callback's local_variables keep their weights and optimizer state."""
    def batch(r, tag):
        return tf.constant(data(r, (5, 4), tag + "x")), tf.constant(data(r, (5, 2), tag + "y"))

    def grads_of(r, layers, tag):
        shared, own = layers
        x, y = batch(r, tag)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((own(shared(x)) - y) ** 2)
        variables = shared.trainable_weights + own.trainable_weights
        return [g.numpy() for g in tape.gradient(loss, variables)]

    everyone = [grads_of(r, local_layers(r), "tape") for r in range(n)]
    mean = [np.mean([g[i] for g in everyone], 0) for i in range(4)]
    mine = everyone[rank]
    shared, own = local_layers(rank)
    variables = shared.trainable_weights + own.trainable_weights

    def step(wrap, traced):
        def run():
            x, y = batch(rank, "tape")
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum((own(shared(x)) - y) ** 2)
            return wrap(tape).gradient(loss, variables)
        return tf.function(run)() if traced else run()

    def register_kernel(tape):
        tape = hvd.DistributedGradientTape(tape)
        tape.register_local_source(own.kernel)
        return tape

    cases = [("partial", lambda t: hvd.PartialDistributedGradientTape(t, local_layers=[own]),
              mean[:2] + [g / n for g in mine[2:]]),
             ("partial_unscaled", lambda t: hvd.PartialDistributedGradientTape(
                 t, local_layers=own, scale_local_gradients=False), mean[:2] + mine[2:]),
             ("register_local_source", register_kernel, mean[:2] + [mine[2] / n, mean[3]]),
             ("no_local_layers", lambda t: hvd.PartialDistributedGradientTape(t), mean)]
    for traced in (False, True):
        for name, wrap, want in cases:
            t = f"local/tape/{name}/{'function' if traced else 'eager'}"
            got = c.run(t, step, wrap, traced)
            for i, g in enumerate(got or []):
                c.check(close(g.numpy(), want[i], 1e-6), f"{t}/{i}: off by "
                        f"{np.abs(g.numpy() - want[i]).max()}")
    # a subclassed model whose local layer only gets its variables in the first step
    class TwoLayers(keras.Model):
        def __init__(self):
            super().__init__()
            self.shared = keras.layers.Dense(3, activation="tanh", name="shared")
            self.own = keras.layers.Dense(2, name="own")

        def call(self, x):
            return self.own(self.shared(x))

    sub = TwoLayers()
    tape_layers = [sub.own]  # not built yet: no variables

    def sub_step():
        x, y = batch(rank, "tape")
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((sub(x) - y) ** 2)
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=tape_layers)
        return tape.gradient(loss, sub.trainable_variables)
    got = c.run("local/tape/unbuilt", sub_step)
    if got:
        weights = [v.numpy() for v in sub.trainable_variables]
        gathered = hvd.allgather_object([g.numpy() for g in got])
        # the ranks' weights differ (unseeded), so the own layer is checked against this
        # rank's plain gradients and the shared one for being the same everywhere
        with tf.GradientTape() as tape:
            x, y = batch(rank, "tape")
            loss = tf.reduce_sum((sub(x) - y) ** 2)
        own_grads = [g.numpy() for g in tape.gradient(loss, sub.trainable_variables)]
        c.check(len(weights) == 4 and close(got[2].numpy(), own_grads[2] / n, 1e-6) and
                close(got[3].numpy(), own_grads[3] / n, 1e-6),
                "local/tape/unbuilt: the own layer's gradients were averaged")
        if n > 1:
            c.check(np.array_equal(gathered[0][0], gathered[1][0]),
                    "local/tape/unbuilt: the shared layer's gradients differ between ranks")
    # a local embedding: its tf.IndexedSlices gradient stays sparse and is scaled
    emb = tf.Variable(np.ones((4, 2), np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(emb, [rank % 4, 3]) * float(rank + 1))
    tape = hvd.DistributedGradientTape(tape)
    tape.register_local_source(emb)
    got = c.run("local/tape/sparse", tape.gradient, loss, [emb])
    if got:
        c.check(isinstance(got[0], tf.IndexedSlices) and
                close(got[0].values.numpy(), np.full((2, 2), (rank + 1) / n)) and
                got[0].indices.numpy().tolist() == [rank % 4, 3],
                f"local/tape/sparse: {got[0]}")
    # Keras optimizer with backward_passes_per_step=2, traced: nothing moves on the first
    # pass; the second applies the averaged sum for the shared variable and this rank's sum
    # divided by the set size for the local one
    va, vb = tf.Variable(np.zeros(2, np.float32)), tf.Variable(np.zeros(2, np.float32))
    acc_opt = khvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    acc_opt.register_local_var(vb)
    acc_step = tf.function(lambda ga, gb: acc_opt.apply([ga, gb], [va, vb]))
    for p in range(2):
        c.run(f"local/passes/{p}", acc_step, tf.constant([1.0, float(rank + p)]),
              tf.constant([float(rank + 1), float(p)]))
        if p == 0:
            c.check(close(va.numpy(), [0, 0]) and close(vb.numpy(), [0, 0]),
                    f"local/passes: moved after one pass {va.numpy()} {vb.numpy()}")
    c.check(close(va.numpy(), [-2.0, -float(n)]) and
            close(vb.numpy(), [-2.0 * (rank + 1) / n, -1.0 / n]),
            f"local/passes: {va.numpy()} {vb.numpy()}")
    c.raises("local/tape/not_a_layer", ValueError, hvd.PartialDistributedGradientTape,
             tf.GradientTape(), local_layers=[own, own.kernel], match="tf.keras.layers.Layer")
    c.raises("local/optimizer/not_a_layer", ValueError, khvd.PartialDistributedOptimizer,
             keras.optimizers.SGD(), local_layers="own", match="tf.keras.layers.Layer")

    # tf.compat.v1 optimizer: register_local_var
    a, b = tf.Variable(np.zeros(2, np.float32)), tf.Variable(np.zeros(2, np.float32))
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0))
    opt.register_local_var(a)
    gv = c.run("local/v1", opt.compute_gradients,
               lambda: tf.reduce_sum((a + b) * tf.constant([1.0, float(rank)])), [a, b])
    if gv:
        c.check(close(gv[0][0].numpy(), [1.0 / n, rank / n]) and
                close(gv[1][0].numpy(), [1.0, (n - 1) / 2.0]),
                f"local/v1: {[g.numpy() for g, _ in gv]}")

    # model.fit with PartialDistributedOptimizer and the callback's local_variables: the
    # shared layer starts from rank 0's weights and momentum, the own layer from this rank's,
    # and every step matches a simulation of all ranks.
    def model_of(layers):
        model = keras.Sequential([keras.Input((4,)), *layers])
        model.build((None, 4))
        return model

    def momentum_start(optimizer, model, r):
        optimizer.build(model.trainable_variables)
        for i, (v, m) in enumerate(zip(model.trainable_variables, optimizer.momentums)):
            m.assign(data(r, tuple(v.shape), f"momentum{i}"))

    steps = 3
    xs = [data(r, (5 * steps, 4), "fitx") for r in range(n)]
    ys = [data(r, (5 * steps, 2), "fity") for r in range(n)]
    # the simulation: every rank's model, shared gradients averaged, own ones divided by n
    sims = [model_of(local_layers(r)) for r in range(n)]
    sim_opts = [keras.optimizers.SGD(0.1, momentum=0.5) for _ in range(n)]
    for r in range(n):
        momentum_start(sim_opts[r], sims[r], r)
        for m0, m in zip(sim_opts[0].momentums[:2], sim_opts[r].momentums[:2]):
            m.assign(m0)  # the shared layer's momentum is rank 0's after the broadcast
    for k in range(steps):
        per_rank = []
        for r in range(n):
            with tf.GradientTape() as tape:
                pred = sims[r](xs[r][5 * k:5 * (k + 1)])
                loss = tf.reduce_mean((pred - ys[r][5 * k:5 * (k + 1)]) ** 2)
            per_rank.append(tape.gradient(loss, sims[r].trainable_variables))
        for r in range(n):
            shared_mean = [tf.add_n([g[i] for g in per_rank]) / n for i in range(2)]
            sim_opts[r].apply(shared_mean + [g / n for g in per_rank[r][2:]],
                              sims[r].trainable_variables)
    # the real thing: rank r's shared layer starts elsewhere and takes rank 0's by broadcast
    shared, own = local_layers(rank)
    if rank:
        for v in shared.trainable_weights:
            v.assign(v + 1.0)
    model = model_of([shared, own])
    opt = khvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5),
                                           local_layers=[own])
    momentum_start(opt, model, rank)
    model.compile(opt, loss="mse", jit_compile=False)
    callback = khvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[own.kernel])
    callback.register_local_var(own.bias)
    c.run("local/fit", model.fit, xs[rank], ys[rank], batch_size=5, epochs=1, shuffle=False,
          verbose=0, callbacks=[callback])
    for v, w in zip(model.trainable_variables, sims[rank].trainable_variables):
        c.check(close(v.numpy(), w.numpy(), 1e-5), f"local/fit {v.path}: off by "
                f"{np.abs(v.numpy() - w.numpy()).max()}")
    same_everywhere(c, "local/fit shared", [v.numpy() for v in shared.trainable_weights])
    if n > 1:
        owns = hvd.allgather_object([v.numpy().tobytes() for v in own.trainable_weights])
        c.check(owns[0] != owns[1], "local/fit: the own layers became equal")


def main():
    tmp = sys.argv[1]
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    c = Checks(rank)
    for part in (tape_checks, fit_checks, accumulation_checks, schedule_checks,
                 sync_bn_checks, misc_checks, local_variable_checks):
        args = (c, n, rank, tmp) if part in (fit_checks, schedule_checks) else (c, n, rank)
        c.run(part.__name__, part, *args)
    hvd.shutdown()
    c.finish(size=n)


if __name__ == "__main__":
    main()
