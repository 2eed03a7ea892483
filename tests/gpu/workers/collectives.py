"""Every collective on CUDA tensors: results equal the CPU reference, on the input's device.

Usage: collectives.py --expect single|nccl|host

Every CUDA collective before the no-host-copy check (--expect) runs on the NCCL path; after it:
the averages of integer tensors (which the core may stage through host memory), the build flags,
objects and Adasum.

allreduce (Sum, Average, Min, Max, Product x float32/64/16, bfloat16, int32/64, uint8, int8;
out of place, in place, async, async in place, grouped in all forms, pre/postscale, a 16 MiB
tensor, N(0, 1) inputs with tolerances, inputs written by a slow kernel on a side stream),
allgather with ragged first dimensions, broadcast / broadcast_, alltoall with and without splits,
reducescatter and grouped_reducescatter (Sum, Average, uneven rows), barrier, broadcast_object and
allgather_object of CUDA tensors, and last Adasum on CUDA refused with a clear error.
"""

import torch

import spark_hvd.torch as hvd
from _data import DTYPES, FLOATS, dn, ints, normal, put, reference, tolerance, value_range
from _gpu import C, build_flags, counters, main

OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max,
       "Product": hvd.Product}


def op_inputs(tag, op, dtype, shape, size):
    """Every rank's CPU input for one allreduce case."""
    if op == "Average" and not dtype.is_floating_point:
        # Multiples of the rank count: the integer average is exact, however it rounds.
        lo, hi = (0, 6) if dtype == torch.uint8 else (-2, 6)
        return [(ints(tag, r, shape, lo, hi, torch.int64) * size).to(dtype)
                for r in range(size)]
    lo, hi = value_range(dtype, op)
    return [ints(tag, r, shape, lo, hi, dtype) for r in range(size)]


def inexact(op_name, dtype, size):
    """Tolerances where the exact answer is not representable: a float average over a rank
    count that is not a power of two (none with the suite's 1 and 2 ranks)."""
    if op_name != "Average" or not dtype.is_floating_point or size & (size - 1) == 0:
        return {}
    eps = torch.finfo(dtype).eps
    return {"rtol": 4 * eps, "atol": 4 * eps}


def scaled_int(op_name, dtype):
    """Average of an integer tensor: a sum and a scale, which the core may run through host
    memory (NCCL has no scaling of integers); checked after the no-host-copy check."""
    return op_name == "Average" and not dtype.is_floating_point


def allreduce_matrix(device, rank, size, only_scaled_ints=False):
    for dtype in DTYPES:
        for op_name, op in OPS.items():
            if scaled_int(op_name, dtype) != only_scaled_ints:
                continue
            for shape in ((17,), (3, 5, 4)):
                tag = f"ar.{op_name}.{dn(dtype)}.{shape}"
                xs = op_inputs(tag, op_name, dtype, shape, size)
                x = put(xs[rank], device)
                got = hvd.allreduce(x, op=op, name=tag)
                C.same(got, reference(xs, op_name), f"allreduce {op_name} {dn(dtype)} {shape}",
                       device=device, **inexact(op_name, dtype, size))
                C.same(x, xs[rank], f"allreduce {op_name} {dn(dtype)} {shape}: input unchanged")


def allreduce_forms(device, rank, size):
    shape = (6, 7)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        tag = f"forms.{dn(dtype)}"
        xs = [ints(tag, r, shape, -8, 9, dtype) for r in range(size)]
        want = reference(xs, "Sum")
        t = put(xs[rank], device)
        out = hvd.allreduce_(t, op=hvd.Sum, name=f"{tag}.inplace")
        C.same(t, want, f"allreduce_ {dn(dtype)} (in place)", device=device)
        C.check(out is t or (isinstance(out, torch.Tensor) and out.data_ptr() == t.data_ptr()),
                f"allreduce_ {dn(dtype)} returns its input",
                f"allreduce_ returned {type(out).__name__}, not its input")
        h = hvd.allreduce_async(put(xs[rank], device), op=hvd.Sum, name=f"{tag}.async")
        C.same(hvd.synchronize(h), want, f"allreduce_async {dn(dtype)}", device=device)
        t = put(xs[rank], device)
        h = hvd.allreduce_async_(t, op=hvd.Sum, name=f"{tag}.async_")
        hvd.synchronize(h)
        C.same(t, want, f"allreduce_async_ {dn(dtype)}", device=device)
        # Average of floats: halves, exact.
        if dtype.is_floating_point:
            got = hvd.allreduce(put(xs[rank], device), name=f"{tag}.default_op")
            C.same(got, reference(xs, "Average"), f"allreduce {dn(dtype)} default op (Average)",
                   device=device, **inexact("Average", dtype, size))

    # Grouped: tensors of several shapes (one dtype per group), every form.
    shapes = [(5,), (3, 4), (2, 2, 2), (9,), (1,)]
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        for form in ("grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
                     "grouped_allreduce_async_"):
            tag = f"{form}.{dn(dtype)}"
            per_rank = [[ints(f"{tag}.{i}", r, s, -8, 9, dtype) for r in range(size)]
                        for i, s in enumerate(shapes)]
            tensors = [put(xs[rank], device) for xs in per_rank]
            result = getattr(hvd, form)(tensors, op=hvd.Sum, name=tag)
            if "async" in form:
                result = hvd.synchronize(result)
            if form.endswith("_"):
                result = tensors
            C.check(isinstance(result, (list, tuple)) and len(result) == len(shapes),
                    f"{form} {dn(dtype)} returns {len(shapes)} tensors",
                    f"returned {type(result).__name__} of length "
                    f"{len(result) if hasattr(result, '__len__') else '?'}")
            for i, (got, xs) in enumerate(zip(result, per_rank)):
                C.same(got, reference(xs, "Sum"), f"{form} {dn(dtype)} tensor {i}",
                       device=device)

    # Many small tensors in flight at once (the fusion buffer), then one of 16 MiB.
    xs_list = [[ints(f"fuse.{i}", r, (100 + i,), -8, 9, torch.float32) for r in range(size)]
               for i in range(64)]
    handles = [hvd.allreduce_async(put(xs[rank], device), op=hvd.Sum, name=f"fuse.{i}")
               for i, xs in enumerate(xs_list)]
    for i, (h, xs) in enumerate(zip(handles, xs_list)):
        got = hvd.synchronize(h)
        if not torch.equal(got.cpu(), reference(xs, "Sum")):
            C.fail(f"64 async allreduces in flight: tensor {i}", "wrong sum")
    C.ok("64 async allreduces in flight (fused): every sum right")
    n = 4 << 20  # 16 MiB of float32
    base = torch.arange(n, dtype=torch.int64) % 1013
    big = [(base + r * 7).to(torch.float32) for r in range(size)]
    got = hvd.allreduce(put(big[rank], device), op=hvd.Sum, name="big")
    C.same(got, reference(big, "Sum"), "allreduce of 16 MiB float32", device=device)

    # Pre- and postscale (powers of two: exact in every float type).
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        tag = f"scale.{dn(dtype)}"
        xs = [ints(tag, r, (33,), -8, 9, dtype) for r in range(size)]
        got = hvd.allreduce(put(xs[rank], device), op=hvd.Sum, prescale_factor=0.5,
                            postscale_factor=4.0, name=f"{tag}.sum")
        want = (reference(xs, "Sum").double() * 2.0).to(dtype)
        C.same(got, want, f"allreduce Sum prescale 0.5 postscale 4 {dn(dtype)}", device=device)
        got = hvd.allreduce(put(xs[rank], device), op=hvd.Average, prescale_factor=2.0,
                            name=f"{tag}.avg")
        want = (reference(xs, "Average").double() * 2.0).to(dtype)
        C.same(got, want, f"allreduce Average prescale 2 {dn(dtype)}", device=device,
               **inexact("Average", dtype, size))

    # N(0, 1) inputs: float rounding, within tolerances.
    for dtype in FLOATS:
        tag = f"normal.{dn(dtype)}"
        xs = [normal(tag, r, (1000,), dtype) for r in range(size)]
        exact = [x.double() for x in xs]
        rtol, atol = tolerance(dtype)
        for op_name in ("Sum", "Average"):
            got = hvd.allreduce(put(xs[rank], device), op=OPS[op_name], name=f"{tag}.{op_name}")
            C.same(got, reference(exact, op_name).to(dtype),
                   f"allreduce {op_name} N(0,1) {dn(dtype)} within rtol={rtol} atol={atol}",
                   device=device, rtol=rtol, atol=atol)


def stream_order(device, rank, size):
    """The input is written by a slow kernel on the caller's (non-default) current stream right
    before the collective, and the result is read on that stream right after synchronize: the
    core must wait for the producer and the consumer must see the result."""
    side = torch.cuda.Stream(device=device)
    n = 1 << 20
    with torch.cuda.stream(side):
        for it in range(3):
            t = torch.zeros(n, device=device)
            if hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(50_000_000)  # tens of ms of GPU time before the fill
            else:
                a = torch.randn(2048, 2048, device=device)
                for _ in range(20):
                    a = a @ a / 2048
            t.fill_(float(rank + 1 + it))
            h = hvd.allreduce_async_(t, op=hvd.Sum, name=f"stream.{it}")
            hvd.synchronize(h)
            doubled = t * 2  # on the side stream, after synchronize
            total = float(sum(r + 1 + it for r in range(size)))
            good = torch.equal(doubled, torch.full((n,), 2 * total, device=device))
            got = doubled[:4].tolist()
            if not good:
                C.fail(f"stream order, round {it}", f"read {got} on the current stream, "
                       f"expected {2 * total} everywhere (input read before its producer "
                       "kernel finished, or result read before the collective finished)")
    torch.cuda.synchronize()
    C.ok("stream order: producer on a side stream awaited, result usable on it after "
         "synchronize (3 rounds)")


def gathers(device, rank, size):
    # allgather with ragged first dimensions: rank r has r + 1 rows.
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8):
        rows = [ints(f"ag.{dn(dtype)}", r, (r + 1, 3), 0, 50, dtype) for r in range(size)]
        got = hvd.allgather(put(rows[rank], device), name=f"ag.{dn(dtype)}")
        C.same(got, torch.cat(rows), f"allgather ragged {dn(dtype)} (rows 1..{size})",
               device=device)
    rows = [ints("ag.3d", r, (2, 3, 4), -8, 9, torch.float32) for r in range(size)]
    got = hvd.allgather(put(rows[rank], device), name="ag.3d")
    C.same(got, torch.cat(rows), "allgather 3-d float32", device=device)

    # broadcast (out of place and in place) from the first and the last rank.
    for root in sorted({0, size - 1}):
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
            xs = [ints(f"bc.{root}.{dn(dtype)}", r, (4, 5), 0, 50, dtype) for r in range(size)]
            got = hvd.broadcast(put(xs[rank], device), root_rank=root,
                                name=f"bc.{root}.{dn(dtype)}")
            C.same(got, xs[root], f"broadcast root {root} {dn(dtype)}", device=device)
            t = put(xs[rank], device)
            hvd.broadcast_(t, root_rank=root, name=f"bc_.{root}.{dn(dtype)}")
            C.same(t, xs[root], f"broadcast_ root {root} {dn(dtype)} (in place)", device=device)

    # alltoall with splits: rank r sends i + r + 1 rows to rank i; row = (src, dst, k).
    def rows_for(src):
        parts = []
        for dst in range(size):
            k = dst + src + 1
            part = torch.stack([torch.full((k,), src), torch.full((k,), dst), torch.arange(k)],
                               1)
            parts.append(part)
        return torch.cat(parts).to(torch.float32)
    splits = [i + rank + 1 for i in range(size)]
    want = torch.cat([rows_for(src)[sum(i + src + 1 for i in range(rank)):][:rank + src + 1]
                      for src in range(size)])
    for kind, sp in (("list", splits), ("tensor", torch.tensor(splits, dtype=torch.int32))):
        result = hvd.alltoall(put(rows_for(rank), device), splits=sp, name=f"a2a.{kind}")
        C.check(isinstance(result, tuple) and len(result) == 2,
                f"alltoall with splits ({kind}) returns (tensor, received_splits)",
                f"returned {type(result).__name__}")
        out, received = result
        C.same(out, want, f"alltoall with splits as a {kind}", device=device)
        C.check(torch.as_tensor(received).cpu().tolist() == [rank + src + 1
                                                             for src in range(size)],
                f"alltoall received_splits ({kind})",
                f"received_splits {received}, expected {[rank + s + 1 for s in range(size)]}")
    # Without splits: the first dimension divided evenly.
    xs = [ints("a2a.even", r, (2 * size, 3), -8, 9, torch.int32) for r in range(size)]
    got = hvd.alltoall(put(xs[rank], device), name="a2a.even")
    want = torch.cat([xs[src][2 * rank:2 * rank + 2] for src in range(size)])
    C.same(got, want, "alltoall without splits", device=device)


def scatters(device, rank, size, only_scaled_ints=False):
    def block(t, rows):
        # rows % size first ranks get one row more.
        per = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
        start = sum(per[:rank])
        return t[start:start + per[rank]]
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32):
        for op_name in ("Sum", "Average"):
            if scaled_int(op_name, dtype) != only_scaled_ints:
                continue
            rows = 2 * size + 1
            tag = f"rs.{op_name}.{dn(dtype)}"
            xs = op_inputs(tag, op_name, dtype, (rows, 3), size)
            got = hvd.reducescatter(put(xs[rank], device), op=OPS[op_name], name=tag)
            C.same(got, block(reference(xs, op_name), rows),
                   f"reducescatter {op_name} {dn(dtype)} ({rows} rows over {size})",
                   device=device, **inexact(op_name, dtype, size))
    if only_scaled_ints:
        return
    shapes = [(2 * size, 3), (size + 1,), (3 * size, 2, 2)]
    per_tensor = [[ints(f"grs.{i}", r, s, -8, 9, torch.float32) for r in range(size)]
                  for i, s in enumerate(shapes)]
    got = hvd.grouped_reducescatter([put(xs[rank], device) for xs in per_tensor], op=hvd.Sum,
                                    name="grs")
    C.check(len(got) == len(shapes), "grouped_reducescatter returns one tensor per input",
            f"{len(got)} tensors")
    for i, (g, xs, s) in enumerate(zip(got, per_tensor, shapes)):
        C.same(g, block(reference(xs, "Sum"), s[0]), f"grouped_reducescatter Sum tensor {i}",
               device=device)


def objects(device, rank, size):
    hvd.barrier()
    C.ok("barrier")
    # A pickled CUDA tensor comes back on the device it was saved from (the sender's).
    obj = {"rank": rank, "t": torch.arange(5, device=device) + rank}
    got = hvd.broadcast_object(obj, root_rank=0)
    C.check(got["rank"] == 0, "broadcast_object: root's object", f"got rank {got['rank']}")
    C.same(got["t"], torch.arange(5), "broadcast_object: its tensor")
    C.check(got["t"].device.type == device.type, f"broadcast_object: tensor on {device.type}",
            f"on {got['t'].device}")
    got = hvd.allgather_object(obj)
    C.check(isinstance(got, list) and [o["rank"] for o in got] == list(range(size)),
            "allgather_object: one object per rank, in rank order", f"got {got}")
    for r, o in enumerate(got):
        C.same(o["t"], torch.arange(5) + r, f"allgather_object: rank {r}'s tensor")
        C.check(o["t"].device.type == device.type,
                f"allgather_object: rank {r}'s tensor on {device.type}", f"on {o['t'].device}")


def adasum(device, rank, size):
    x = torch.ones(8, device=device)
    C.raises("Adasum on a CUDA tensor is refused clearly",
             lambda: hvd.allreduce(x, op=hvd.Adasum, name="adasum.cuda"),
             (NotImplementedError, ValueError), ("adasum", "cuda"))


def body(args, device):
    rank, size = hvd.rank(), hvd.size()
    allreduce_matrix(device, rank, size)
    allreduce_forms(device, rank, size)
    if device.type == "cuda":  # (not in a dry run on the CPU)
        stream_order(device, rank, size)
    gathers(device, rank, size)
    scatters(device, rank, size)


def after_path_check(args, device):
    """After the no-host-copy check: averages of integer tensors (the core may stage them),
    the build flags, pickled objects (serialised by torch, not staged by the core) and the
    Adasum error."""
    rank, size = hvd.rank(), hvd.size()
    before = counters()
    allreduce_matrix(device, rank, size, only_scaled_ints=True)
    scatters(device, rank, size, only_scaled_ints=True)
    after = counters()
    print(f"info rank={rank} integer Average (allreduce, reducescatter): host_staged_bytes "
          f"+{after['host_staged_bytes'] - before['host_staged_bytes']}, nccl_collectives "
          f"+{after['nccl_collectives'] - before['nccl_collectives']} (not asserted)",
          flush=True)
    build_flags()
    objects(device, rank, size)
    if device.type == "cuda":
        adasum(device, rank, size)


if __name__ == "__main__":
    main(body, after=after_path_check)
