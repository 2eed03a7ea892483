"""spark_hvd.tensorflow collectives: every op x dtype x dims (1-3) x process set, eagerly and
inside tf.function, grouped forms, scaling, compression, IndexedSlices, gradients of every op
(closed form, eager and traced), and every error path in both modes.

Usage: tf_collectives.py

Each rank can rebuild every other rank's input (deterministic per rank and case), so it checks
its results against a float64 reference itself. In tf.function mode every check traces a
function named ``step``: unnamed ops in consecutive traces reuse the same names with other
shapes and dtypes, as a retrace on a smaller last batch does.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import spark_hvd.tensorflow as hvd  # noqa: E402
from _wutil import Checks, make_input, ref_adasum, scatter_counts, scatter_slice  # noqa: E402

DTYPES = [tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16,
          tf.float32, tf.float64, tf.bool]
FLOATS = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
SHAPES = [(17,), (5, 7), (3, 4, 5)]
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max,
       "Product": hvd.Product}
MODES = ("eager", "function")


def make(rank, shape, dtype, tag, kind="sum"):
    """Rank ``rank``'s input as a NumPy array of ``dtype`` (bfloat16 via float32)."""
    if dtype == tf.bfloat16:
        return make_input(rank, shape, np.float32, tag, kind).astype(dtype.as_numpy_dtype)
    return make_input(rank, shape, dtype.as_numpy_dtype, tag, kind)


def tol(dtype, n, scale=1.0):
    if dtype == tf.float16:
        return 2e-3, n * 2.0 ** -7 * scale
    if dtype == tf.bfloat16:
        return 1.6e-2, n * 2.0 ** -4 * scale
    if dtype == tf.float32:
        return 1e-5, 1e-5 * n * scale
    if dtype == tf.float64:
        return 1e-12, 1e-12 * n * scale
    return 0.0, 0.0


def ref_allreduce(xs, op, dtype, pre=1.0, post=1.0):
    if dtype == tf.bool:
        s = np.stack(xs)
        return s.any(0) if op in ("Sum", "Average", "Max") else s.all(0)
    s = np.stack([x.astype(np.float64) * pre for x in xs])
    if not dtype.is_floating:  # the core scales integers in double and truncates
        s = np.trunc(s)
    r = {"Sum": s.sum(0), "Average": s.sum(0), "Min": s.min(0), "Max": s.max(0),
         "Product": s.prod(0)}[op]
    factor = post / len(xs) if op == "Average" else post
    r = r * factor
    return r if dtype.is_floating else np.trunc(r)


def call(mode, fn, *args):
    """``fn(*args)`` eagerly, or traced as a tf.function named ``step``."""
    if mode == "eager":
        return fn(*args)

    def step(*a):
        return fn(*a)
    return tf.function(step)(*args)


class Suite:
    """The op matrix on one process set, in one mode."""

    def __init__(self, c, label, ps, members, mode):
        self.c, self.ps, self.members, self.mode = c, ps, members, mode
        self.n = len(members)
        self.me = members.index(hvd.rank())
        self.label = f"{label}/{mode}"
        # Traces are slow: the full dims matrix runs eagerly, 2-D tensors in tf.function (the
        # kernels are the same).
        self.shapes = SHAPES if mode == "eager" else SHAPES[1:2]

    def expect(self, what, got, want, dtype, rtol=None, atol=None):
        if got is None:
            return
        got = np.asarray(got.numpy() if hasattr(got, "numpy") else got)
        want = np.asarray(want)
        if rtol is None:
            rtol, atol = tol(dtype, self.n, float(np.abs(want).max()) if want.size and
                             dtype.is_floating else 1.0)
        ok = got.shape == want.shape and (
            np.array_equal(got, want.astype(got.dtype)) if not dtype.is_floating else
            np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol))
        self.c.check(ok, f"{self.label}/{what}: got {got.ravel()[:6]} {got.shape}, want "
                         f"{want.ravel()[:6]} {want.shape}")

    def batch(self, name, cases):
        """Runs ``cases`` (tag, thunk, want, dtype) and checks them: eagerly one by one, or
        all in one tf.function (many collectives in one graph, in program order)."""
        if self.mode == "eager":
            results = [self.c.run(tag, thunk) for tag, thunk, _, _ in cases]
        else:
            def step():
                return [thunk() for _, thunk, _, _ in cases]
            results = self.c.run(f"{self.label}/{name}", tf.function(step)) or \
                [None] * len(cases)
        for (tag, _, want, dtype), got in zip(cases, results):
            if isinstance(want, tuple):
                self.expect(tag, got, want[0], dtype, *want[1:])
            else:
                self.expect(tag, got, want, dtype)
        return results

    def inputs(self, shape, dtype, tag, kind="sum"):
        return [make(r, shape, dtype, tag, kind) for r in range(self.n)]

    def buffers(self):
        """Results of large ops (their buffers are pooled and reused once no result refers to
        them) stay intact while held, across many later ops of the same size, eagerly and in
        tf.function; released results' buffers are reused safely."""
        shape, dtype = (129, 257), tf.float32  # 132 KB: above the pool's lower bound
        kept = []
        for i in range(10):
            xs = self.inputs(shape, dtype, f"pool{i}")
            got = call(self.mode, lambda t, i=i: hvd.allreduce(t, op=hvd.Sum,
                                                               name=f"pool.{self.label}.{i}",
                                                               process_set=self.ps),
                       tf.constant(xs[self.me]))
            if i % 2 == 0:
                kept.append((i, got, ref_allreduce(xs, "Sum", dtype)))
            del got
        for i, got, want in kept:
            self.expect(f"pooled result {i} after later ops", got, want, dtype)

    def graph_op(self):
        """Traced allreduces use the native SparkHvdAllreduce op (tf.numpy_function when
        SPARK_HVD_TF_OPS=0). It reduces an input in place only when nothing else reads it: an
        intermediate that the function also returns, or that is reduced twice in one group,
        must come back unchanged."""
        if self.mode == "eager":
            return
        ps = self.ps
        traced = tf.function(lambda x: hvd.allreduce(x, process_set=ps)).get_concrete_function(
            tf.TensorSpec([4], tf.float32))
        kinds = {op.type for op in traced.graph.get_operations()}
        native = os.environ.get("SPARK_HVD_TF_OPS", "1") != "0"
        want, other = ("SparkHvdAllreduce", "PyFunc") if native else ("PyFunc",
                                                                       "SparkHvdAllreduce")
        self.c.check(want in kinds and other not in kinds, f"{self.label}: traced allreduce "
                     f"has ops {sorted(kinds)}; expected {want}")
        t = "allreduce/forwarding"
        xs = self.inputs((5, 3), tf.float32, t)

        def step(x):
            # Distinct factors, so that grappler does not merge the products into one tensor.
            a = x * 2.0  # read again below: must not be overwritten
            b = x * 5.0  # reduced twice in one group
            reduced_a = hvd.allreduce(a, op=hvd.Sum, process_set=ps)
            pair = hvd.grouped_allreduce([b, b], op=hvd.Sum, process_set=ps)
            # Read by the allreduce only: may be reduced in place.
            return reduced_a, a, pair[0], pair[1], hvd.allreduce(x * 3.0, op=hvd.Sum,
                                                                 process_set=ps)
        got = self.c.run(t, tf.function(step), tf.constant(xs[self.me]))
        if got is None:
            return

        def total(factor):
            return ref_allreduce([factor * x for x in xs], "Sum", tf.float32)
        for what, g, w in zip(("reduced", "input read again", "grouped twice [0]",
                               "grouped twice [1]", "forwardable"), got,
                              (total(2), 2 * xs[self.me], total(5), total(5), total(3))):
            self.expect(f"{t}/{what}", g, w, tf.float32)

    def allreduce(self):
        c, ps = self.c, self.ps
        for dtype in DTYPES:
            cases = []
            for shape in self.shapes:
                for op_name, op in OPS.items():
                    kind = "product" if op_name == "Product" else "sum"
                    t = f"allreduce/{dtype.name}/{shape}/{op_name}"
                    xs = self.inputs(shape, dtype, t, kind)
                    x = tf.constant(xs[self.me])
                    cases.append((t, lambda x=x, op=op: hvd.allreduce(x, op=op, process_set=ps),
                                  ref_allreduce(xs, op_name, dtype), dtype))
            self.batch(f"allreduce/{dtype.name}", cases)
        for dtype in (tf.float32, tf.float64, tf.int32):
            t = f"allreduce/scaled/{dtype.name}"
            xs = self.inputs((6, 2), dtype, t)
            got = c.run(t, call, self.mode, lambda x: hvd.allreduce(
                x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, process_set=ps),
                tf.constant(xs[self.me]))
            self.expect(t, got, ref_allreduce(xs, "Sum", dtype, 0.5, 3.0), dtype)
        t = "allreduce/average_kwarg"
        xs = self.inputs((4,), tf.float32, t)
        got = c.run(t, call, self.mode, lambda x: hvd.allreduce(x, average=False,
                                                                 process_set=ps),
                    tf.constant(xs[self.me]))
        self.expect(t, got, ref_allreduce(xs, "Sum", tf.float32), tf.float32)
        t = "allreduce/fp16"
        xs = self.inputs((9,), tf.float32, t)
        got = c.run(t, call, self.mode, lambda x: hvd.allreduce(
            x, compression=hvd.Compression.fp16, process_set=ps), tf.constant(xs[self.me]))
        c.check(got is None or got.dtype == tf.float32, f"{t}: dtype {getattr(got, 'dtype', '')}")
        self.expect(t, got, ref_allreduce(xs, "Average", tf.float32), tf.float32, 2e-3, 1e-2)
        t = "allreduce/variable_scalar"
        xs = self.inputs((), tf.float64, t)
        v = tf.Variable(xs[self.me])
        got = c.run(t, call, self.mode, lambda: hvd.allreduce(v, op=hvd.Max, process_set=ps))
        self.expect(t, got, ref_allreduce(xs, "Max", tf.float64), tf.float64)
        t = "allreduce/empty"
        got = c.run(t, call, self.mode, lambda x: hvd.allreduce(x, process_set=ps),
                    tf.zeros([0, 3]))
        self.expect(t, got, np.zeros([0, 3], np.float32), tf.float32)
        # IndexedSlices: allgathered values and indices, Average divides the values.
        t = "allreduce/indexed_slices"
        vals = self.inputs((2, 3), tf.float32, t)
        idx = [np.array([r % 4, 3], np.int64) for r in range(self.n)]

        def sparse(values, indices):
            s = hvd.allreduce(tf.IndexedSlices(values, indices, tf.constant([4, 3], tf.int64)),
                              process_set=ps)
            return tf.convert_to_tensor(s)
        got = c.run(t, call, self.mode, sparse, tf.constant(vals[self.me]),
                    tf.constant(idx[self.me]))
        want = np.zeros((4, 3))
        for v, i in zip(vals, idx):
            np.add.at(want, i, v.astype(np.float64) / self.n)
        self.expect(t, got, want, tf.float32)

    def grouped_allreduce(self):
        c, ps = self.c, self.ps
        dtypes = [tf.float32, tf.int64, tf.float16, tf.bfloat16]
        t = "grouped_allreduce"
        xs = [self.inputs(SHAPES[i % 3], d, f"{t}{i}") for i, d in enumerate(dtypes)]
        got = c.run(t, call, self.mode, lambda *a: hvd.grouped_allreduce(
            list(a), op=hvd.Sum, process_set=ps), *[tf.constant(x[self.me]) for x in xs])
        for i, d in enumerate(dtypes):
            self.expect(f"{t}/{i}", None if got is None else got[i],
                        ref_allreduce(xs[i], "Sum", d), d)
        c.check(hvd.grouped_allreduce([], process_set=ps) == [], "empty group")

    def allgather(self):
        c, ps = self.c, self.ps
        for dtype in DTYPES:
            cases = []
            for shape in self.shapes:
                t = f"allgather/{dtype.name}/{shape}"
                # the first dimension differs between ranks
                xs = [make(r, (shape[0] + r,) + shape[1:], dtype, t) for r in range(self.n)]
                x = tf.constant(xs[self.me])
                cases.append((t, lambda x=x: hvd.allgather(x, process_set=ps),
                              (np.concatenate(xs), 0, 0), dtype))
            self.batch(f"allgather/{dtype.name}", cases)
        t = "allgather/scalar"
        got = c.run(t, call, self.mode, lambda x: hvd.allgather(x, process_set=ps),
                    tf.constant(float(self.me)))
        self.expect(t, got, np.arange(self.n, dtype=np.float32), tf.float32, 0, 0)
        t = "grouped_allgather"
        xs = [[make(r, (r + 1, 2), tf.float32, t + "a") for r in range(self.n)],
              [make(r, (2, 3), tf.int32, t + "b") for r in range(self.n)]]
        got = c.run(t, call, self.mode, lambda a, b: hvd.grouped_allgather([a, b],
                                                                           process_set=ps),
                    tf.constant(xs[0][self.me]), tf.constant(xs[1][self.me]))
        for i, d in enumerate((tf.float32, tf.int32)):
            self.expect(f"{t}/{i}", None if got is None else got[i], np.concatenate(xs[i]), d,
                        0, 0)

    def broadcast(self):
        c, ps = self.c, self.ps
        for dtype in DTYPES:
            cases = []
            for shape in self.shapes:
                root = self.n - 1
                t = f"broadcast/{dtype.name}/{shape}"
                xs = self.inputs(shape, dtype, t)
                x = tf.constant(xs[self.me])
                cases.append((t, lambda x=x: hvd.broadcast(x, self.members[root], process_set=ps),
                              (xs[root], 0, 0), dtype))
            self.batch(f"broadcast/{dtype.name}", cases)
        t = "broadcast_variables"
        xs = [self.inputs((3, 2), tf.float32, t), self.inputs((4,), tf.int64, t),
              self.inputs((), tf.float64, t)]
        variables = [tf.Variable(x[self.me]) for x in xs]
        extra = tf.Variable(np.array([self.me, 7], np.uint32))  # bit-cast on the wire
        variables.append(extra)
        if self.mode == "eager":
            c.run(t, hvd.broadcast_variables, variables, self.members[0], process_set=ps)
        else:
            c.run(t, tf.function(lambda: hvd.broadcast_variables(variables, self.members[0],
                                                                 process_set=ps)))
        for i, (v, x) in enumerate(zip(variables, xs)):
            self.expect(f"{t}/{i}", v, x[0], tf.as_dtype(v.dtype), 0, 0)
        c.check(extra.numpy().tolist() == [0, 7], f"{t}/uint32: {extra.numpy()}")
        t = "broadcast_"  # in place, returning the new values
        xs = [self.inputs((2, 2), tf.float32, t), self.inputs((3,), tf.int32, t)]
        variables = [tf.Variable(x[self.me]) for x in xs]
        root = self.n - 1
        got = c.run(t, call, self.mode,
                    lambda: hvd.broadcast_(variables, self.members[root], name="bcast_",
                                               process_set=ps))
        for i, (v, x) in enumerate(zip(variables, xs)):
            self.expect(f"{t}/{i}", v, x[root], tf.as_dtype(v.dtype), 0, 0)
            if got is not None:
                self.expect(f"{t}/returned/{i}", got[i], x[root], tf.as_dtype(v.dtype), 0, 0)

    def alltoall(self):
        c, ps = self.c, self.ps
        n, me = self.n, self.me
        for dtype in DTYPES:
            t = f"alltoall/{dtype.name}"
            # member r sends (r + d + 1) % 3 rows to member d
            splits = [[(r + d + 1) % 3 for d in range(n)] for r in range(n)]
            xs = [make(r, (sum(splits[r]), 3), dtype, t) for r in range(n)]
            got = c.run(t, call, self.mode, lambda x, s: hvd.alltoall(x, s, process_set=ps),
                        tf.constant(xs[me]), tf.constant(splits[me], tf.int32))
            pieces = []
            for r in range(n):
                start = sum(splits[r][:me])
                pieces.append(xs[r][start:start + splits[r][me]])
            if got is not None:
                self.expect(t, got[0], np.concatenate(pieces), dtype, 0, 0)
                c.check(got[1].numpy().tolist() == [splits[r][me] for r in range(n)] and
                        got[1].dtype == tf.int32, f"{t}: received splits {got[1]}")
        t = "alltoall/even"  # without splits: the rows only, as in Horovod
        xs = self.inputs((2 * n, 2), tf.int32, t)
        got = c.run(t, call, self.mode, lambda x: hvd.alltoall(x, process_set=ps),
                    tf.constant(xs[me]))
        if got is not None:
            c.check(isinstance(got, tf.Tensor), f"{t}: returned {type(got).__name__}")
            self.expect(t, got, np.concatenate([x[2 * me:2 * me + 2] for x in xs]),
                        tf.int32, 0, 0)

    def reducescatter(self):
        c, ps = self.c, self.ps
        n, me = self.n, self.me
        cases = []
        for dtype in (tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64):
            for op_name in ("Sum", "Average"):
                rows = 2 * n + 1
                t = f"reducescatter/{dtype.name}/{op_name}"
                xs = self.inputs((rows, 3), dtype, t)
                x = tf.constant(xs[me])
                full = ref_allreduce(xs, op_name, dtype)
                cases.append((t, lambda x=x, op=OPS[op_name]: hvd.reducescatter(
                    x, op=op, process_set=ps), full[scatter_slice(rows, n, me)], dtype))
        self.batch("reducescatter", cases)
        t = "grouped_reducescatter"
        xs = [self.inputs((n, 2), tf.float32, t + "a"), self.inputs((n + 1,), tf.int32, t + "b")]
        got = c.run(t, call, self.mode, lambda a, b: hvd.grouped_reducescatter(
            [a, b], op=hvd.Sum, process_set=ps), tf.constant(xs[0][me]), tf.constant(xs[1][me]))
        for i, d in enumerate((tf.float32, tf.int32)):
            full = ref_allreduce(xs[i], "Sum", d)
            self.expect(f"{t}/{i}", None if got is None else got[i],
                        full[scatter_slice(full.shape[0], n, me)], d)

    def gradients(self):
        """Horovod's gradient rules, eager and traced, against closed forms."""
        c, ps, n, me = self.c, self.ps, self.n, self.me
        ws = [make(r, (4, 3), tf.float64, "gradw") for r in range(n)]
        w = tf.constant(ws[me])

        def grad_of(f, x):
            def g(x):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    loss = f(x)
                return tape.gradient(loss, x)
            return call(self.mode, g, x)

        x = tf.constant(make(me, (4, 3), tf.float64, "gradx"))
        for op_name in ("Sum", "Average"):
            t = f"grad/allreduce/{op_name}"
            got = c.run(t, grad_of, lambda x: tf.reduce_sum(
                hvd.allreduce(x, op=OPS[op_name], process_set=ps) * w), x)
            self.expect(t, got, ref_allreduce(ws, op_name, tf.float64), tf.float64)
        t = "grad/grouped_allreduce"
        got = c.run(t, grad_of, lambda x: tf.reduce_sum(
            hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum, process_set=ps)[1] * w), x)
        self.expect(t, got, 2 * ref_allreduce(ws, "Sum", tf.float64), tf.float64)
        # allgather with different first dimensions: this rank's slice of the averaged grad
        rows = [r + 1 for r in range(n)]
        gws = [make(r, (sum(rows), 3), tf.float64, "gradgw") for r in range(n)]
        xg = tf.constant(make(me, (rows[me], 3), tf.float64, "gradxg"))
        t = "grad/allgather"
        got = c.run(t, grad_of, lambda x: tf.reduce_sum(
            hvd.allgather(x, process_set=ps) * tf.constant(gws[me])), xg)
        start = sum(rows[:me])
        self.expect(t, got, np.mean(gws, 0)[start:start + rows[me]], tf.float64)
        t = "grad/grouped_allgather"
        got = c.run(t, grad_of, lambda x: tf.reduce_sum(
            hvd.grouped_allgather([x, x[:1]], process_set=ps)[0] * tf.constant(gws[me])), xg)
        self.expect(t, got, np.mean(gws, 0)[start:start + rows[me]], tf.float64)
        t = "grad/broadcast"
        root = n - 1
        got = c.run(t, grad_of, lambda x: tf.reduce_sum(hvd.broadcast(x, self.members[root],
                                                                      process_set=ps)
                                                        * w), x)
        want = np.mean(ws, 0) if me == root else np.zeros((4, 3))
        self.expect(t, got, want, tf.float64)
        t = "grad/alltoall"
        splits = [[(r + d) % 2 + 1 for d in range(n)] for r in range(n)]
        recv = [sum(splits[r][d] for r in range(n)) for d in range(n)]
        aws = [make(r, (recv[r], 2), tf.float64, "gradaw") for r in range(n)]
        xa = tf.constant(make(me, (sum(splits[me]), 2), tf.float64, "gradxa"))
        got = c.run(t, grad_of, lambda x: tf.reduce_sum(
            hvd.alltoall(x, splits[me], process_set=ps)[0] * tf.constant(aws[me])), xa)
        # the rows this rank sent to member d come back as d's weights for them
        pieces = []
        for d in range(n):
            off = sum(splits[r][d] for r in range(me))
            pieces.append(aws[d][off:off + splits[me][d]])
        self.expect(t, got, np.concatenate(pieces), tf.float64)
        t = "grad/reducescatter"
        rows_rs = 2 * n + 1
        counts = scatter_counts(rows_rs, n)
        rws = [make(r, (counts[r], 3), tf.float64, "gradrw") for r in range(n)]
        xr = tf.constant(make(me, (rows_rs, 3), tf.float64, "gradxr"))
        got = c.run(t, grad_of, lambda x: tf.reduce_sum(
            hvd.reducescatter(x, op=hvd.Average, process_set=ps) * tf.constant(rws[me])), xr)
        self.expect(t, got, np.concatenate(rws), tf.float64)  # Horovod's rule: no 1/n
        t = "grad/reducescatter_sum"
        got = c.run(t, grad_of, lambda x: tf.reduce_sum(
            hvd.reducescatter(x, op=hvd.Sum, process_set=ps) * tf.constant(rws[me])), xr)
        self.expect(t, got, np.concatenate(rws) * n, tf.float64)  # and n times for Sum


def errors(c, n, rank, outsider):
    """Mistakes raise a clear error on every rank, in both modes, and the job goes on. Horovod's
    classes: ranks that disagree raise FailedPreconditionError (InvalidArgumentError from a
    graph without the op library, whose tf.numpy_function nodes cannot raise it), arguments
    refused on one rank InvalidArgumentError."""
    native = os.environ.get("SPARK_HVD_TF_OPS", "1") != "0"
    for mode in MODES:
        lab = f"errors/{mode}"
        mismatch = (tf.errors.FailedPreconditionError if mode == "eager" or native
                    else tf.errors.InvalidArgumentError)
        e = c.raises(f"{lab}/shape", mismatch, call, mode,
                     lambda x: hvd.allreduce(x), tf.ones([rank + 1]), match="ismatch")
        if mode == "eager":
            c.check(isinstance(e, ValueError) and isinstance(e, RuntimeError) and
                    isinstance(e, hvd.CollectiveError) and
                    isinstance(e, tf.errors.InvalidArgumentError), f"{lab}: {type(e).__mro__}")
        c.raises(f"{lab}/dtype", mismatch, call, mode,
                 lambda x: hvd.allreduce(x), tf.ones([3], tf.float32 if rank else tf.float64),
                 match="ismatch")
        c.raises(f"{lab}/op", mismatch, call, mode,
                 lambda x: hvd.allreduce(x, op=hvd.Sum if rank else hvd.Max), tf.ones([3]),
                 match="ismatch")
        c.raises(f"{lab}/allgather", mismatch, call, mode,
                 lambda x: hvd.allgather(x), tf.ones([2, rank + 1]), match="ismatch")
        c.raises(f"{lab}/broadcast_root", mismatch, call, mode,
                 lambda x: hvd.broadcast(x, rank), tf.ones([2]), match="root")
        c.raises(f"{lab}/alltoall_splits", tf.errors.InvalidArgumentError, call, mode,
                 lambda x: hvd.alltoall(x, [1] * n), tf.ones([n + 1]), match="split")
        got = c.run(f"{lab}/after", call, mode, lambda x: hvd.allreduce(x, op=hvd.Sum),
                    tf.ones([2]))
        c.check(got is not None and got.numpy().tolist() == [n, n], f"{lab}/after: {got}")
    # Caught locally before anything is sent.
    c.raises("errors/dtype_unsupported", ValueError, hvd.allreduce,
             tf.ones([2], tf.uint32), match="not supported")
    c.raises("errors/string", ValueError, hvd.allgather, tf.constant(["a"]))
    if n & (n - 1):
        c.raises("errors/adasum", NotImplementedError, hvd.allreduce, tf.ones([2]),
                 op=hvd.Adasum, match="power-of-two")
        c.raises("errors/adasum_traced", NotImplementedError,
                 tf.function(lambda: hvd.allreduce(tf.ones([2]), op=hvd.Adasum)),
                 match="power-of-two")
    else:
        want = ref_adasum([np.array([r + 1.0, 1.0, -0.5 * r]) for r in range(n)])
        got = c.run("adasum", hvd.allreduce, tf.constant([rank + 1.0, 1.0, -0.5 * rank]),
                    op=hvd.Adasum, name="adasum")
        c.check(got is not None and np.allclose(got.numpy(), want, rtol=1e-6),
                f"adasum: {got} vs {want}")
    c.raises("errors/op_and_average", ValueError, hvd.allreduce, tf.ones([2]), op=hvd.Sum,
             average=True, match="supersedes")
    c.raises("errors/reducescatter_min", ValueError, hvd.reducescatter, tf.ones([2]),
             op=hvd.Min)
    c.raises("errors/unregistered_set", ValueError, hvd.allreduce, tf.ones([2]),
             process_set=hvd.ProcessSet([0]), match="not registered")
    if outsider is not None:
        c.raises("errors/not_a_member", ValueError, hvd.allreduce, tf.ones([2]),
                 process_set=outsider)
    got = c.run("errors/join", lambda: int(hvd.join()))
    c.check(got is not None and 0 <= got < n, f"join returned {got}")
    c.run("errors/barrier", hvd.barrier)


def session_out_of_order(c, n, rank):
    """A tf.compat.v1 graph of independent collectives that each rank's executor starts in
    another order (built in reverse on odd ranks, one inter-op thread) completes: a node that
    blocked its thread until the other ranks arrived would wait for an op the other rank cannot
    start (Horovod's test_horovod_allreduce_cpu_fused and grouped IndexedSlices tests hung so).
    Also a broadcast's gradient in such a graph: the other ranks' zeros still take part in the
    root's allreduce (Horovod's test_horovod_broadcast_grad_cpu hung)."""
    count = 6
    with tf.Graph().as_default():
        order = range(count) if rank % 2 == 0 else reversed(range(count))
        outs = {}
        for i in order:
            x = tf.fill([5], float(i + rank))
            outs[i] = (hvd.allreduce(x, op=hvd.Sum, name=f"v1.ar.{i}"),
                       hvd.allgather(x, name=f"v1.ag.{i}"),
                       hvd.broadcast(x, i % n, name=f"v1.bc.{i}"))
        x = tf.fill([3], float(rank))
        grad = tf.gradients(hvd.broadcast(x, n - 1, name="v1.grad"), x, tf.ones([3]))[0]
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1)
        with tf.compat.v1.Session(config=config) as session:
            got = session.run([outs[i] for i in range(count)])
            got_grad = session.run(grad)
    for i, (reduced, gathered, broadcast) in enumerate(got):
        c.check(np.array_equal(reduced, np.full([5], n * i + n * (n - 1) / 2)),
                f"session_out_of_order allreduce {i}: {reduced}")
        c.check(np.array_equal(gathered, np.repeat(np.arange(n) + float(i), 5)),
                f"session_out_of_order allgather {i}: {gathered}")
        c.check(np.array_equal(broadcast, np.full([5], float(i + i % n))),
                f"session_out_of_order broadcast {i}: {broadcast}")
    want_grad = np.full([3], float(rank == n - 1))
    c.check(np.array_equal(got_grad, want_grad), f"broadcast gradient {got_grad} vs {want_grad}")


def session_deadlock_is_reported(c, n, rank):
    """With the op library's kernels completing before they return (SPARK_HVD_TF_SYNC_KERNELS=1,
    its fallback), session_out_of_order's graph would block each rank's one inter-op thread on
    a collective the other rank has not started: the core's deadlock check ends the job with an
    error that names both ranks' collectives, instead of a hang."""
    try:
        session_out_of_order(c, n, rank)
    except tf.errors.OpError as e:
        c.check("deadlock" in e.message and "v1.ar." in e.message, f"not a deadlock: {e}")
    else:
        c.check(False, "the out-of-order session graph completed with synchronous kernels")


def main():
    if sys.argv[1:] == ["--session-deadlock"]:
        hvd.init()
        c = Checks(hvd.rank())
        session_deadlock_is_reported(c, hvd.size(), hvd.rank())
        c.finish(size=hvd.size())
        return
    n_env = int(os.environ["SPARK_HVD_SIZE"])
    sets = [hvd.ProcessSet(list(range(1, n_env)))]
    if n_env >= 3:
        sets.append(hvd.ProcessSet([0, n_env - 1]))
    hvd.init(process_sets=sets)
    rank, n = hvd.rank(), hvd.size()
    c = Checks(rank)
    c.check(hvd.size_op().numpy() == n and hvd.rank_op().numpy() == rank, "size_op/rank_op")
    suites = [("global", hvd.global_process_set, list(range(n)))]
    for i, ps in enumerate(sets):
        if ps.included():
            suites.append((f"set{i}", ps, ps.ranks))
    for label, ps, members in suites:
        for mode in MODES:
            s = Suite(c, label, ps, members, mode)
            for part in (s.graph_op, s.allreduce, s.grouped_allreduce, s.allgather, s.broadcast,
                         s.alltoall, s.reducescatter, s.gradients, s.buffers):
                c.run(f"{s.label}/{part.__name__}", part)
    # The kernel of the op library; completing before it returns (SPARK_HVD_TF_SYNC_KERNELS=1),
    # it cannot run this graph (session_deadlock_is_reported).
    if os.environ.get("SPARK_HVD_TF_OPS", "1") != "0" and \
            os.environ.get("SPARK_HVD_TF_SYNC_KERNELS", "0") in ("", "0"):
        c.run("session_out_of_order", session_out_of_order, c, n, rank)
    errors(c, n, rank, sets[0] if rank == 0 else None)
    hvd.shutdown()
    c.finish(size=n)


if __name__ == "__main__":
    main()
