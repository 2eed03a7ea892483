"""spark_hvd.torch collectives: every op x dtype x dims (1-3) x process set, sync / async /
in-place / grouped forms, prescale and postscale, non-contiguous and empty inputs, every error
path, and gradients (closed form and finite differences).

Usage: torch_collectives.py

Each rank can rebuild every other rank's input (deterministic per rank and case), so it checks
its results against a float64 reference itself.
"""

import warnings

import numpy as np
import torch

import spark_hvd.torch as hvd
from _wutil import Checks, ref_adasum, scatter_slice, seed_of

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.bool]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SHAPES = [(17,), (5, 7), (3, 4, 5)]
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max,
       "Product": hvd.Product}


def dn(dtype):
    return str(dtype).replace("torch.", "")


def make(rank, shape, dtype, tag, kind="sum"):
    """Rank ``rank``'s input for case ``tag`` (small values: no overflow for <= 4 ranks)."""
    rng = np.random.default_rng(seed_of(tag, rank, dn(dtype), tuple(shape)))
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, size=shape).astype(np.bool_))
    if dtype.is_floating_point:
        lo, hi = (0.5, 1.5) if kind == "product" else (-4, 4)
        return torch.from_numpy(rng.uniform(lo, hi, size=shape)).to(dtype)
    if kind == "product":
        lo = 0 if dtype == torch.uint8 else -2
        return torch.from_numpy(rng.integers(lo, 3, size=shape)).to(dtype)
    lo, hi = (0, 50) if dtype == torch.uint8 else ((-25, 25) if dtype == torch.int8
                                                    else (-1000, 1000))
    return torch.from_numpy(rng.integers(lo, hi, size=shape)).to(dtype)


def tol(dtype, n, scale=1.0):
    """(rtol, atol) against a float64 reference of values in [-4, 4]."""
    if dtype == torch.float16:
        return 2e-3, n * 2.0 ** -7 * scale
    if dtype == torch.bfloat16:
        return 1.6e-2, n * 2.0 ** -4 * scale
    if dtype == torch.float32:
        return 1e-5, 1e-5 * n * scale
    if dtype == torch.float64:
        return 1e-12, 1e-12 * n * scale
    return 0.0, 0.0


def scaled(x, factor):
    """What the core does to a scaled buffer: scale in double, cast back (ints truncate)."""
    if factor == 1.0:
        return x
    y = x.double() * factor
    return (y if x.dtype.is_floating_point else torch.trunc(y)).to(x.dtype)


def ref_allreduce(xs, op, pre=1.0, post=1.0):
    dtype = xs[0].dtype
    if dtype == torch.bool:
        s = torch.stack(xs)
        return s.any(0) if op in ("Sum", "Average", "Max") else s.all(0)
    s = torch.stack([scaled(x, pre).double() for x in xs])
    r = {"Sum": s.sum(0), "Average": s.sum(0), "Min": s.min(0).values, "Max": s.max(0).values,
         "Product": s.prod(0)}[op]
    factor = post / len(xs) if op == "Average" else post
    if factor != 1.0:
        r = r * factor
        if not dtype.is_floating_point:
            r = torch.trunc(r)
    return r.to(dtype)


def close(got, want, rtol=0.0, atol=0.0):
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return False
    if rtol == 0 and atol == 0:
        return bool(torch.equal(got, want))
    return bool(torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol))


def diff(got, want):
    if not isinstance(got, torch.Tensor):
        return f"got {type(got).__name__}"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    d = (got.double() - want.double()).abs()
    return f"max abs diff {d.max().item() if d.numel() else 0}"


class Suite:
    """The checks for one process set (``members`` are its global ranks, in order)."""

    def __init__(self, c, label, ps, members):
        self.c, self.label, self.ps, self.members = c, label, ps, members
        self.n = len(members)
        self.me = members.index(hvd.rank())

    def tag(self, *parts):
        return "/".join([self.label] + [str(p) for p in parts])

    def inputs(self, shape_of, dtype, tag, kind="sum"):
        return [make(g, shape_of(i), dtype, tag, kind) for i, g in enumerate(self.members)]

    def expect(self, what, got, want, rtol=0.0, atol=0.0):
        self.c.check(close(got, want, rtol, atol), f"{what}: {diff(got, want)}")

    # -- allreduce ------------------------------------------------------------------------

    def allreduce(self):
        c, ps = self.c, self.ps
        pending = []
        for dtype in DTYPES:
            for shape in SHAPES:
                ops = ["Sum", "Min", "Max", "Product"] + ([] if dtype == torch.bool
                                                          else ["Average"])
                if shape != (5, 7):
                    ops = ["Sum"]
                for op in ops:
                    t = self.tag("ar", dn(dtype), shape, op)
                    xs = self.inputs(lambda i: shape, dtype, t,
                                     "product" if op == "Product" else "sum")
                    want = ref_allreduce(xs, op)
                    rt, at = tol(dtype, self.n)
                    mine = xs[self.me].clone()
                    got = c.run(t, hvd.allreduce, mine, name=t, op=OPS[op], process_set=ps)
                    self.expect(t, got, want, rt, at)
                    c.check(torch.equal(mine, xs[self.me]), f"{t}: input modified")
                    # async (all submitted first, fused by the core), then in place
                    ta = t + "/async"
                    h = c.run(ta, hvd.allreduce_async, xs[self.me], name=ta, op=OPS[op],
                              process_set=ps)
                    buf = xs[self.me].clone()
                    ti = t + "/async_"
                    hi = c.run(ti, hvd.allreduce_async_, buf, name=ti, op=OPS[op],
                               process_set=ps)
                    pending.append((ta, h, want, rt, at, None))
                    pending.append((ti, hi, want, rt, at, buf))
        for t, h, want, rt, at, buf in pending:
            if h is None:
                continue
            got = c.run(t, hvd.synchronize, h)
            c.check(hvd.poll(h), f"{t}: poll False after synchronize")
            if buf is not None:
                c.check(got is buf, f"{t}: in-place form did not return its input")
            self.expect(t, got, want, rt, at)
        # synchronous in place, prescale/postscale, the default op and the old average=
        for dtype in DTYPES:
            t = self.tag("ar_", dn(dtype))
            xs = self.inputs(lambda i: (4, 3), dtype, t)
            buf = xs[self.me].clone()
            got = c.run(t, hvd.allreduce_, buf, name=t, op=hvd.Max, process_set=ps)
            c.check(got is buf, f"{t}: did not return its input")
            self.expect(t, buf, ref_allreduce(xs, "Max"))
            if dtype == torch.bool:
                continue
            pre, post = (0.5, 3.0) if dtype.is_floating_point else (2.0, 0.5)
            for op in ("Sum", "Average"):
                t = self.tag("ar_scale", dn(dtype), op)
                xs = self.inputs(lambda i: (6,), dtype, t)
                rt, at = tol(dtype, self.n, pre * post)
                got = c.run(t, hvd.allreduce, xs[self.me], name=t, op=OPS[op],
                            prescale_factor=pre, postscale_factor=post, process_set=ps)
                self.expect(t, got, ref_allreduce(xs, op, pre, post), rt, at)
        t = self.tag("ar_default")
        xs = self.inputs(lambda i: (5,), torch.float64, t)
        self.expect(t, c.run(t, hvd.allreduce, xs[self.me], name=t, process_set=ps),
                    ref_allreduce(xs, "Average"), 1e-12, 1e-12)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            got = c.run(t + "/avgF", hvd.allreduce, xs[self.me], average=False, name=t + "/avgF",
                        process_set=ps)
        self.expect(t + "/avgF", got, ref_allreduce(xs, "Sum"), 1e-12, 1e-12)
        # fp16 compression: sent as float16, returned as the input's dtype
        t = self.tag("ar_fp16")
        xs = self.inputs(lambda i: (9,), torch.float32, t)
        got = c.run(t, hvd.allreduce, xs[self.me], name=t, op=hvd.Sum,
                    compression=hvd.Compression.fp16, process_set=ps)
        want = ref_allreduce([x.half() for x in xs], "Sum").float()
        self.expect(t, got, want, *tol(torch.float16, self.n))
        # the same compression through the grouped and reducescatter forms
        fp16 = hvd.Compression.fp16
        got = c.run(t + "/g", hvd.grouped_allreduce, [xs[self.me], xs[self.me] * 2],
                    name=t + "/g", op=hvd.Sum, compression=fp16, process_set=ps) or [None] * 2
        want2 = ref_allreduce([(x * 2).half() for x in xs], "Sum").float()
        self.expect(t + "/g0", got[0], want, *tol(torch.float16, self.n))
        self.expect(t + "/g1", got[1], want2, *tol(torch.float16, self.n))
        mine = scatter_slice(9, self.n, self.me)
        got = c.run(t + "/rs", hvd.reducescatter, xs[self.me], name=t + "/rs", op=hvd.Sum,
                    compression=fp16, process_set=ps)
        self.expect(t + "/rs", got, want[mine], *tol(torch.float16, self.n))
        got = c.run(t + "/grs", hvd.grouped_reducescatter, [xs[self.me]], name=t + "/grs",
                    op=hvd.Sum, compression=fp16, process_set=ps) or [None]
        self.expect(t + "/grs", got[0], want[mine], *tol(torch.float16, self.n))
        c.check(got[0] is not None and got[0].dtype == torch.float32, "fp16 result dtype")

    def grouped_allreduce(self):
        c, ps = self.c, self.ps
        for dtype in DTYPES:
            t = self.tag("gar", dn(dtype))
            xss = [self.inputs(lambda i: s, dtype, f"{t}/{k}") for k, s in enumerate(SHAPES)]
            wants = [ref_allreduce(xs, "Sum") for xs in xss]
            mine = [xs[self.me] for xs in xss]
            rt, at = tol(dtype, self.n)
            got = c.run(t, hvd.grouped_allreduce, mine, name=t, op=hvd.Sum, process_set=ps)
            for k, (g, w) in enumerate(zip(got or [], wants)):
                self.expect(f"{t}/{k}", g, w, rt, at)
            h = c.run(t, hvd.grouped_allreduce_async, mine, name=t + "/a", op=hvd.Sum,
                      process_set=ps)
            bufs = [m.clone() for m in mine]
            hi = c.run(t, hvd.grouped_allreduce_async_, bufs, name=t + "/ai", op=hvd.Sum,
                       process_set=ps)
            for k, (g, w) in enumerate(zip(c.run(t, hvd.synchronize, h) or [], wants)):
                self.expect(f"{t}/async/{k}", g, w, rt, at)
            res = c.run(t, hvd.synchronize, hi) or []
            c.check(all(a is b for a, b in zip(res, bufs)), f"{t}: in-place results")
            for k, (g, w) in enumerate(zip(bufs, wants)):
                self.expect(f"{t}/inplace/{k}", g, w, rt, at)
            bufs = [m.clone() for m in mine]
            c.run(t, hvd.grouped_allreduce_, bufs, name=t + "/si", op=hvd.Sum, process_set=ps)
            for k, (g, w) in enumerate(zip(bufs, wants)):
                self.expect(f"{t}/sync_inplace/{k}", g, w, rt, at)
        c.check(hvd.grouped_allreduce([], process_set=ps) == [], "empty group")

    # -- allgather / broadcast / alltoall / reducescatter ---------------------------------

    def allgather(self):
        c, ps = self.c, self.ps
        pending = []
        for dtype in DTYPES:
            for shape in SHAPES:
                t = self.tag("ag", dn(dtype), shape)
                # member i sends i+1 rows (first dimension differs between ranks)
                xs = self.inputs(lambda i: (i + 1,) + shape[1:], dtype, t)
                want = torch.cat(xs)
                self.expect(t, c.run(t, hvd.allgather, xs[self.me], name=t, process_set=ps),
                            want)
                h = c.run(t, hvd.allgather_async, xs[self.me], name=t + "/a", process_set=ps)
                pending.append((t + "/a", h, want))
            t = self.tag("gag", dn(dtype))
            xss = [self.inputs(lambda i: (i + k,) + s[1:], dtype, f"{t}/{k}")
                   for k, s in enumerate(SHAPES)]
            got = c.run(t, hvd.grouped_allgather, [xs[self.me] for xs in xss], name=t,
                        process_set=ps) or []
            for k, (g, xs) in enumerate(zip(got, xss)):
                self.expect(f"{t}/{k}", g, torch.cat(xs))
            h = c.run(t, hvd.grouped_allgather_async, [xs[self.me] for xs in xss],
                      name=t + "/a", process_set=ps)
            got = c.run(t, hvd.synchronize, h) or []
            for k, (g, xs) in enumerate(zip(got, xss)):
                self.expect(f"{t}/async/{k}", g, torch.cat(xs))
        for t, h, want in pending:
            self.expect(t, c.run(t, hvd.synchronize, h), want)

    def broadcast(self):
        c, ps = self.c, self.ps
        for dtype in DTYPES:
            for shape in SHAPES:
                for root in range(self.n):
                    t = self.tag("bc", dn(dtype), shape, root)
                    xs = self.inputs(lambda i: shape, dtype, t)
                    mine = xs[self.me].clone()
                    self.expect(t, c.run(t, hvd.broadcast, mine, self.members[root], name=t,
                                                 process_set=ps),
                                xs[root])
                    c.check(torch.equal(mine, xs[self.me]), f"{t}: input modified")
            t = self.tag("bc_", dn(dtype))
            xs = self.inputs(lambda i: (3, 2), dtype, t)
            buf = xs[self.me].clone()
            got = c.run(t, hvd.broadcast_, buf, self.members[-1], name=t, process_set=ps)
            c.check(got is buf, f"{t}: did not return its input")
            self.expect(t, buf, xs[self.n - 1])
            buf = xs[self.me].clone()
            h = c.run(t, hvd.broadcast_async_, buf, self.members[0], name=t + "/ai",
                      process_set=ps)
            h2 = c.run(t, hvd.broadcast_async, xs[self.me], self.members[0], name=t + "/a",
                       process_set=ps)
            c.run(t, hvd.synchronize, h)
            self.expect(t + "/async_", buf, xs[0])
            self.expect(t + "/async", c.run(t, hvd.synchronize, h2), xs[0])

    def alltoall(self):
        c, ps, n, me = self.c, self.ps, self.n, self.me
        for dtype in DTYPES:
            for shape in SHAPES:
                t = self.tag("a2a", dn(dtype), shape)
                # member i sends (j + i) % 3 rows to member j
                splits_of = [[(j + i) % 3 for j in range(n)] for i in range(n)]
                xs = self.inputs(lambda i: (sum(splits_of[i]),) + shape[1:], dtype, t)

                def block(i, j):
                    start = sum(splits_of[i][:j])
                    return xs[i][start:start + splits_of[i][j]]
                want = torch.cat([block(i, me) for i in range(n)])
                want_splits = torch.tensor([splits_of[i][me] for i in range(n)],
                                           dtype=torch.int32)
                got = c.run(t, hvd.alltoall, xs[me], splits=splits_of[me], name=t,
                            process_set=ps)
                if got is not None:
                    self.expect(t, got[0], want)
                    self.expect(t + "/splits", got[1], want_splits)
                h = c.run(t, hvd.alltoall_async, xs[me], torch.tensor(splits_of[me]),
                          name=t + "/a", process_set=ps)
                got = c.run(t, hvd.synchronize, h)
                if got is not None:
                    self.expect(t + "/async", got[0], want)
                    self.expect(t + "/async/splits", got[1], want_splits)
                # even split (no splits): returns the tensor only
                te = t + "/even"
                xs = self.inputs(lambda i: (2 * n,) + shape[1:], dtype, te)
                want = torch.cat([x[2 * me:2 * me + 2] for x in xs])
                self.expect(te, c.run(te, hvd.alltoall, xs[me], name=te, process_set=ps), want)

    def reducescatter(self):
        c, ps, n, me = self.c, self.ps, self.n, self.me
        for dtype in DTYPES:
            if dtype == torch.bool:
                continue
            for shape in SHAPES:
                for op in ("Sum", "Average"):
                    t = self.tag("rs", dn(dtype), shape, op)
                    xs = self.inputs(lambda i: shape, dtype, t)
                    full = ref_allreduce(xs, op)
                    want = full[scatter_slice(shape[0], n, me)]
                    rt, at = tol(dtype, n)
                    got = c.run(t, hvd.reducescatter, xs[me], name=t, op=OPS[op], process_set=ps)
                    self.expect(t, got, want, rt, at)
            t = self.tag("grs", dn(dtype))
            xss = [self.inputs(lambda i: s, dtype, f"{t}/{k}") for k, s in enumerate(SHAPES)]
            got = c.run(t, hvd.grouped_reducescatter, [xs[me] for xs in xss], name=t,
                        op=hvd.Sum, process_set=ps) or []
            for k, (g, xs) in enumerate(zip(got, xss)):
                full = ref_allreduce(xs, "Sum")
                self.expect(f"{t}/{k}", g, full[scatter_slice(full.shape[0], n, me)],
                            *tol(dtype, n))
        t = self.tag("rs_scale")
        xs = self.inputs(lambda i: (4, 2), torch.float64, t)
        full = ref_allreduce(xs, "Sum", 0.5, 3.0)
        got = c.run(t, hvd.reducescatter, xs[me], name=t, op=hvd.Sum, process_set=ps,
                    prescale_factor=0.5, postscale_factor=3.0)
        self.expect(t, got, full[scatter_slice(4, n, me)], 1e-12, 1e-12)

    # -- inputs only the handle keeps alive ---------------------------------------------------

    def temporaries(self):
        """Async ops on temporaries that nothing but the handle references: the core may run
        them only when they are awaited (bursts), so the handle must keep every buffer alive
        until completion. Memory is churned before waiting, so a freed input would show."""
        t = self.tag("tmp")
        xs = self.inputs(lambda i: (257,), torch.float32, t)
        want = ref_allreduce(xs, "Sum")
        handles = [hvd.allreduce_async(xs[self.me].clone() * 1, name=f"{t}/ar", op=hvd.Sum,
                                       process_set=self.ps),
                   hvd.allreduce_async_(xs[self.me].clone(), name=f"{t}/ar_", op=hvd.Sum,
                                        process_set=self.ps),
                   hvd.grouped_allreduce_async([xs[self.me].clone(), xs[self.me].clone()],
                                               name=f"{t}/gar", op=hvd.Sum, process_set=self.ps),
                   hvd.broadcast_async(xs[self.me].clone(), self.members[0], name=f"{t}/bc",
                                       process_set=self.ps),
                   hvd.allgather_async(xs[self.me].clone(), name=f"{t}/ag", process_set=self.ps),
                   hvd.reducescatter_async(xs[self.me].clone(), name=f"{t}/rs", op=hvd.Sum,
                                           process_set=self.ps),
                   hvd.grouped_reducescatter_async([xs[self.me].clone()], name=f"{t}/grs",
                                                   op=hvd.Sum, process_set=self.ps),
                   hvd.grouped_allgather_async([xs[self.me].clone()], name=f"{t}/gag",
                                               process_set=self.ps)]
        churn = [torch.full((257,), -7.0) for _ in range(200)]
        got = [hvd.synchronize(h) for h in handles]
        del churn
        rtol, atol = tol(torch.float32, self.n)
        self.expect(f"{t}/ar", got[0], want, rtol, atol)
        self.expect(f"{t}/ar_", got[1], want, rtol, atol)
        self.expect(f"{t}/gar", got[2][0], want, rtol, atol)
        self.expect(f"{t}/gar.1", got[2][1], want, rtol, atol)
        self.expect(f"{t}/bc", got[3], xs[0])
        self.expect(f"{t}/ag", got[4], torch.cat(xs))
        mine = want[scatter_slice(257, self.n, self.me)]
        self.expect(f"{t}/rs", got[5], mine, rtol, atol)
        self.expect(f"{t}/grs", got[6][0], mine, rtol, atol)
        self.expect(f"{t}/gag", got[7][0], torch.cat(xs))

    # -- layouts ----------------------------------------------------------------------------

    def layouts(self):
        """Non-contiguous inputs are staged (results correct, in-place writes land in the
        view); empty tensors and scalars work."""
        c, ps = self.c, self.ps
        t = self.tag("nc")
        xs = [x.t() for x in self.inputs(lambda i: (4, 6), torch.float64, t)]
        want = ref_allreduce([x.contiguous() for x in xs], "Sum")
        self.expect(t, c.run(t, hvd.allreduce, xs[self.me], name=t, op=hvd.Sum,
                             process_set=ps), want, 1e-12, 1e-12)
        base = self.inputs(lambda i: (4, 6), torch.float64, t)[self.me].clone()
        view = base.t()
        got = c.run(t + "_", hvd.allreduce_, view, name=t + "_", op=hvd.Sum, process_set=ps)
        c.check(got is view, f"{t}_: returned another tensor")
        self.expect(t + "_", base.t().contiguous(), want, 1e-12, 1e-12)
        sl = self.inputs(lambda i: (6, 4), torch.float32, t + "sl")
        cols = [x[:, 1:3] for x in sl]  # strided slice
        self.expect(t + "/ag", c.run(t, hvd.allgather, cols[self.me], name=t + "/ag",
                                     process_set=ps), torch.cat(cols))
        buf = sl[self.me].clone()
        hvd.broadcast_(buf[:, 1:3], self.members[0], name=t + "/bc", process_set=ps)
        self.expect(t + "/bc", buf[:, 1:3], cols[0])
        self.expect(t + "/bc_rest", buf[:, :1], sl[self.me][:, :1])
        # empty and 0-dim
        e = torch.empty(0, 3)
        self.expect(self.tag("empty"), c.run("empty", hvd.allreduce, e, name=self.tag("empty"),
                                             process_set=ps), e)
        self.expect(self.tag("empty_ag"), c.run("empty_ag", hvd.allgather, e,
                                                name=self.tag("empty_ag"), process_set=ps),
                    torch.empty(0, 3))
        s = torch.tensor(float(self.me + 1), dtype=torch.float64)
        self.expect(self.tag("scalar"), c.run("scalar", hvd.allreduce, s, op=hvd.Sum,
                                              name=self.tag("scalar"), process_set=ps),
                    torch.tensor(float(self.n * (self.n + 1) // 2), dtype=torch.float64))
        got = c.run("scalar_ag", hvd.allgather, s, name=self.tag("scalar_ag"), process_set=ps)
        self.expect(self.tag("scalar_ag"), got,
                    torch.arange(1, self.n + 1, dtype=torch.float64))
        # a parameter (requires grad) can be broadcast in place
        p = torch.nn.Parameter(torch.full((3,), float(self.me)))
        hvd.broadcast_(p, self.members[0], name=self.tag("param"), process_set=ps)
        self.expect(self.tag("param"), p.detach(), torch.zeros(3))


# -- gradients --------------------------------------------------------------------------------

def weights(rank, shape, tag):
    g = torch.Generator().manual_seed(seed_of("w", tag, rank, tuple(shape)) % (2 ** 31))
    return torch.rand(shape, generator=g, dtype=torch.float64) - 0.5


def gradients(c, ps, members):
    """Closed form: L_r = sum(w_r * y_r); the gradient of each op follows Horovod's rules."""
    n, me = len(members), members.index(hvd.rank())
    W = [weights(g, (2 * n, 3), "w") for g in members]  # every member's loss weights
    ws = [weights(g, (n + 1, 3), "ws") for g in members]

    def x_of(i, rows=2 * n):
        return make(members[i], (rows, 3), torch.float64, "grad-in")

    def run(what, fn, x, expect):
        x = x.clone().requires_grad_()
        y = fn(x)
        y = y[0] if isinstance(y, tuple) else y
        (weights(hvd.rank(), tuple(y.shape), what) * y).sum().backward()
        c.check(x.grad is not None and torch.allclose(x.grad, expect, atol=1e-12),
                f"grad {what}: got {x.grad}, want {expect}")

    def w_of(i, shape, what):
        return weights(members[i], tuple(shape), what)

    # allreduce: backward is an allreduce with the same op
    for op, name in ((hvd.Sum, "Sum"), (hvd.Average, "Average")):
        what = f"ar-{name}"
        total = sum(w_of(i, (2 * n, 3), what) for i in range(n))
        run(what, lambda x: hvd.allreduce(x, op=op, process_set=ps, name=f"g{what}"), x_of(me),
            total / (n if name == "Average" else 1))
    what = "ar-scaled"
    total = sum(w_of(i, (2 * n, 3), what) for i in range(n))
    run(what, lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5,
                                      process_set=ps), x_of(me), total)
    # allgather: this rank's slice of the averaged gradient (rows differ per rank)
    what = "ag"
    total = sum(w_of(i, (n * (n + 1) // 2, 3), what) for i in range(n)) / n
    start = sum(i + 1 for i in range(me))
    run(what, lambda x: hvd.allgather(x, process_set=ps), x_of(me, me + 1),
        total[start:start + me + 1])
    # broadcast: averaged onto the root, zero elsewhere
    for root in range(n):
        what = f"bc-{root}"
        total = sum(w_of(i, (2 * n, 3), what) for i in range(n)) / n
        run(what, lambda x: hvd.broadcast(x, members[root], process_set=ps), x_of(me),
            total if me == root else torch.zeros_like(total))
    # alltoall (even): the gradient comes back from where the rows went
    what = "a2a"
    expect = torch.cat([w_of(j, (2 * n, 3), what)[2 * me:2 * me + 2] for j in range(n)])
    run(what, lambda x: hvd.alltoall(x, process_set=ps), x_of(me), expect)
    what = "a2a-splits"
    splits = [[(i + j) % 2 + 1 for j in range(n)] for i in range(n)]
    recv = [sum(splits[j][me] for j in range(n)) for _ in range(1)][0]
    pieces = []
    for j in range(n):
        # rows I sent to j sit in j's output after the rows j got from members before me
        start = sum(splits[i][j] for i in range(me))
        pieces.append(w_of(j, (sum(splits[i][j] for i in range(n)), 3), what)
                      [start:start + splits[me][j]])
    run(what, lambda x: hvd.alltoall(x, splits=splits[me], process_set=ps),
        make(members[me], (sum(splits[me]), 3), torch.float64, "a2a-s"), torch.cat(pieces))
    del recv
    # reducescatter: allgathered gradient x (n for Sum) x pre x post (Horovod's rule)
    for op, name in ((hvd.Sum, "Sum"), (hvd.Average, "Average")):
        what = f"rs-{name}"
        rows = [2 * n // n] * n
        pieces = torch.cat([w_of(i, (rows[i], 3), what) for i in range(n)])
        run(what, lambda x: hvd.reducescatter(x, op=op, process_set=ps, prescale_factor=3.0),
            x_of(me), pieces * 3.0 * (n if name == "Sum" else 1))
    # grouped forms
    for op, k in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / n)):
        xa, xb = x_of(me).clone().requires_grad_(), x_of(me, 3).clone().requires_grad_()
        ya, yb = hvd.grouped_allreduce([xa, xb], op=op, process_set=ps, prescale_factor=2.0)
        (weights(hvd.rank(), ya.shape, "ga") * ya).sum().backward(retain_graph=True)
        (weights(hvd.rank(), yb.shape, "gb") * yb).sum().backward()
        c.check(torch.allclose(xa.grad, 2 * k * sum(w_of(i, ya.shape, "ga") for i in range(n)))
                and torch.allclose(xb.grad,
                                   2 * k * sum(w_of(i, yb.shape, "gb") for i in range(n))),
                f"grad grouped_allreduce op={op}")
    xa, xb = x_of(me, me + 1).clone().requires_grad_(), x_of(me, 2).clone().requires_grad_()
    ya, yb = hvd.grouped_allgather([xa, xb], process_set=ps)
    ((weights(hvd.rank(), ya.shape, "gga") * ya).sum() +
     (weights(hvd.rank(), yb.shape, "ggb") * yb).sum()).backward()
    ta = sum(w_of(i, ya.shape, "gga") for i in range(n)) / n
    tb = sum(w_of(i, yb.shape, "ggb") for i in range(n)) / n
    sa = sum(i + 1 for i in range(me))
    c.check(torch.allclose(xa.grad, ta[sa:sa + me + 1]) and
            torch.allclose(xb.grad, tb[2 * me:2 * me + 2]), "grad grouped_allgather")
    for op, k in ((hvd.Sum, float(n)), (hvd.Average, 1.0)):
        xa = x_of(me).clone().requires_grad_()
        (ya,) = hvd.grouped_reducescatter([xa], op=op, process_set=ps, postscale_factor=3.0)
        (weights(hvd.rank(), ya.shape, "grs") * ya).sum().backward()
        c.check(torch.allclose(xa.grad,
                               3 * k * torch.cat([w_of(i, (2, 3), "grs") for i in range(n)])),
                f"grad grouped_reducescatter op={op}")
    del W, ws


def finite_differences(c, ps, members):
    """Numerical check of the same rules: G = sum over members of L_r; perturbing one
    element of one member's input changes G by (autograd gradient) x h x k, where k is 1 for
    allreduce / alltoall, n for allgather / broadcast (whose gradients are averaged) and 1/n for
    a reducescatter Sum (whose gradient is n times the exact one): Horovod's rules."""
    n, me = len(members), members.index(hvd.rank())
    h = 1e-6
    cases = [
        ("ar", lambda x: hvd.allreduce(x, op=hvd.Average, process_set=ps), 1),
        ("ag", lambda x: hvd.allgather(x, process_set=ps), n),
        ("bc", lambda x: hvd.broadcast(x * x, members[0], process_set=ps), n),
        ("a2a", lambda x: hvd.alltoall(x * 2.0, process_set=ps), 1),
        ("rs", lambda x: hvd.reducescatter(torch.sin(x), op=hvd.Sum, process_set=ps), 1 / n),
    ]
    for what, fn, k in cases:
        x0 = make(members[me], (2 * n, 2), torch.float64, "fd-" + what)
        x = x0.clone().requires_grad_()
        y = fn(x)
        (weights(hvd.rank(), tuple(y.shape), "fd" + what) * y).sum().backward()
        for q in range(n):
            for j in (0, 3):
                vals = []
                for sign in (1.0, -1.0):
                    xp = x0.clone()
                    if me == q:
                        xp.view(-1)[j] += sign * h
                    with torch.no_grad():
                        yp = fn(xp)
                        loss = (weights(hvd.rank(), tuple(yp.shape), "fd" + what) * yp).sum()
                    vals.append(hvd.allreduce(loss.reshape(1), op=hvd.Sum, process_set=ps))
                numeric = float((vals[0] - vals[1]) / (2 * h)) / k
                if me == q:
                    auto = float(x.grad.view(-1)[j])
                    c.check(abs(numeric - auto) < 1e-5 * max(1.0, abs(auto)),
                            f"finite differences {what}[{j}] on member {q}: numeric {numeric} "
                            f"autograd {auto}")


# -- errors -----------------------------------------------------------------------------------

def errors(c, n, rank, only_me_set):
    E = hvd.CollectiveError
    # ranks disagree: every rank raises, as ValueError and as RuntimeError (Horovod's type)
    e = c.raises("shape mismatch", E, hvd.allreduce, torch.ones(rank + 1), name="e.shape",
                 match=["e.shape", "Mismatched shapes"])
    c.check(isinstance(e, ValueError) and isinstance(e, RuntimeError), "error types")
    c.raises("dtype mismatch", RuntimeError, hvd.allreduce,
             torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64), name="e.dtype",
             match="Mismatched data types")
    c.raises("op mismatch", ValueError, hvd.allreduce, torch.ones(3),
             op=hvd.Sum if rank == 0 else hvd.Max, name="e.op", match="Mismatched")
    c.raises("ndim mismatch", E, hvd.allreduce, torch.ones(2) if rank == 0 else torch.ones(2, 1),
             name="e.ndim", match=["e.ndim", "Mismatched shapes", "[2, 1]"])
    c.raises("broadcast shape mismatch", E, hvd.broadcast, torch.ones(rank + 1), 0,
             name="e.bshape", match=["e.bshape", "Mismatched shapes"])
    other = torch.float32 if rank == 0 else torch.float64
    c.raises("allgather dtype mismatch", E, hvd.allgather, torch.ones(2, dtype=other),
             name="e.agdtype", match=["e.agdtype", "Mismatched data types"])
    c.raises("alltoall dtype mismatch", E, hvd.alltoall, torch.ones(2 * n, dtype=other),
             name="e.a2adtype", match=["e.a2adtype", "Mismatched data types"])
    c.raises("reducescatter shape mismatch", E, hvd.reducescatter, torch.ones(n * (rank + 1)),
             name="e.rsshape", match=["e.rsshape", "Mismatched shapes"])
    c.raises("grouped length mismatch", E, hvd.grouped_allreduce,
             [torch.ones(2)] * (1 if rank == 0 else 2), name="e.grp",
             match=["e.grp", "Mismatched grouped operation"])
    # a name still in flight on this rank is refused there; the first op is unharmed
    h = hvd.allreduce_async(torch.full((2,), float(rank)), name="e.dup", op=hvd.Sum)
    c.raises("duplicate in-flight name", E, hvd.allreduce_async, torch.ones(2), name="e.dup",
             match=["e.dup", "already in flight"])
    # allreduce_ of a contiguous CPU tensor enqueues and waits in one native call: its refusal
    # (nothing enqueued) and an op's failure are raised as from the general path
    c.raises("duplicate in-flight name, in place", E, hvd.allreduce_, torch.ones(2),
             name="e.dup", match=["e.dup", "already in flight"])
    c.check(torch.equal(hvd.synchronize(h), torch.full((2,), float(sum(range(n))))),
            "the op whose name was reused still completes")
    c.raises("allreduce_ shape mismatch", E, hvd.allreduce_, torch.ones(rank + 1),
             name="e.ishape", match=["e.ishape", "Mismatched shapes"])
    c.raises("root mismatch", ValueError, hvd.broadcast, torch.ones(3), rank % 2, name="e.root",
             match="root")
    c.raises("root out of range", ValueError, hvd.broadcast, torch.ones(3), n, name="e.root2",
             match="root rank")
    c.raises("allgather trailing dims", ValueError, hvd.allgather, torch.ones(2, rank + 1),
             name="e.ag", match="e.ag")
    c.raises("alltoall splits sum", ValueError, hvd.alltoall, torch.ones(4), splits=[1] * n,
             name="e.a2a", match="splits")
    c.raises("alltoall splits count", ValueError, hvd.alltoall, torch.ones(n + 1),
             splits=[1] * (n + 1), name="e.a2a2", match="splits")
    # Float splits are refused, not truncated (Horovod: an int32 tensor).
    c.raises("alltoall float splits", ValueError, hvd.alltoall, torch.ones(n),
             torch.ones(n, dtype=torch.float32), name="e.a2a3", match="must be integers")
    c.raises("alltoall uneven", ValueError, hvd.alltoall, torch.ones(n + 1), name="e.a2a3",
             match="divisible")
    c.raises("reducescatter op", ValueError, hvd.reducescatter, torch.ones(4), op=hvd.Max,
             match="Average")
    if n & (n - 1):
        # Horovod's NotImplementedError, and a CollectiveError like the other refusals.
        e = c.raises("Adasum", NotImplementedError, hvd.allreduce, torch.ones(2), op=hvd.Adasum,
                     match="power-of-two")
        c.check(isinstance(e, hvd.CollectiveError), f"Adasum refusal is {type(e).__mro__}")
    else:
        mine = torch.tensor([rank + 1.0, 1.0, -0.5 * rank])
        want = ref_adasum([np.array([r + 1.0, 1.0, -0.5 * r]) for r in range(n)])
        got = c.run("Adasum", hvd.allreduce, mine, op=hvd.Adasum, name="e.adasum")
        c.check(got is not None and np.allclose(got.double().numpy(), want, rtol=1e-6),
                f"Adasum: {got} vs {want}")
        # bfloat16 (no NumPy dtype): combined in float, rounded to bfloat16 at every level
        got = c.run("Adasum bf16", hvd.allreduce, mine.bfloat16(), op=hvd.Adasum,
                    name="e.adasum.bf16")
        c.check(got is not None and got.dtype == torch.bfloat16 and
                np.allclose(got.double().numpy(), want, rtol=2e-2, atol=1e-2),
                f"Adasum bf16: {got} vs {want}")
    c.raises("op and average", ValueError, hvd.allreduce, torch.ones(2), average=True,
             op=hvd.Sum, match="op")
    c.raises("complex dtype", ValueError, hvd.allreduce, torch.ones(2, dtype=torch.complex64),
             match="not supported")
    c.raises("sparse tensor", ValueError, hvd.allreduce, torch.eye(2).to_sparse(),
             match="sparse")
    c.raises("not a tensor", ValueError, hvd.allreduce, [1.0, 2.0], match="torch.Tensor")
    c.raises("0-dim reducescatter", ValueError, hvd.reducescatter, torch.tensor(1.0),
             match="dimension")
    if only_me_set is not None:
        c.raises("not a member", ValueError, hvd.allreduce, torch.ones(2),
                 process_set=only_me_set[1], match="not a member")
    unregistered = hvd.ProcessSet([0])
    c.raises("unregistered set", ValueError, hvd.allreduce, torch.ones(2),
             process_set=unregistered, match="not registered")
    # the job keeps working after every error
    got = c.run("after errors", hvd.allreduce, torch.full((2,), float(rank)), op=hvd.Sum,
                name="e.after")
    c.check(got is not None and torch.equal(got, torch.full((2,), float(n * (n - 1) / 2))),
            f"after errors: {got}")


def main():
    import os
    n_env = int(os.environ["SPARK_HVD_SIZE"])
    torch.set_num_threads(1)
    # static process sets: the last n-1 ranks, and for 3+ ranks the first and the last
    sets = [hvd.ProcessSet(list(range(1, n_env)))]
    if n_env >= 3:
        sets.append(hvd.ProcessSet([0, n_env - 1]))
    hvd.init(process_sets=sets)
    rank, n = hvd.rank(), hvd.size()
    c = Checks(rank)
    c.check(hvd.cuda_built() or not hvd.nccl_built(), "cuda_built/nccl_built")
    suites = [("global", hvd.global_process_set, list(range(n)))]
    for i, ps in enumerate(sets):
        if ps.included():
            suites.append((f"set{i}", ps, ps.ranks))
    for label, ps, members in suites:
        s = Suite(c, label, ps, members)
        for part in (s.allreduce, s.grouped_allreduce, s.allgather, s.broadcast, s.alltoall,
                     s.reducescatter, s.layouts, s.temporaries):
            c.run(f"{label}/{part.__name__}", part)
        c.run(f"{label}/gradients", gradients, c, ps, members)
        c.run(f"{label}/finite_differences", finite_differences, c, ps, members)
    # rank 0 is outside sets[0]
    errors(c, n, rank, (None, sets[0]) if rank == 0 else None)
    hvd.shutdown()
    c.finish(size=n)


if __name__ == "__main__":
    main()
