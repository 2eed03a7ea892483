#!/usr/bin/env python3
"""A quick check of the CUDA path on a GPU machine: every collective on CUDA tensors against
torch's own arithmetic, the counters, one line per check. Run alone (one rank) or under
``python -m spark_hvd.runner -np 2``. Exits non-zero on the first failed check."""

import sys
import time

import torch

import spark_hvd.torch as hvd
from spark_hvd.common import _gpu


def check(ok, what):
    print(f"[rank {hvd.rank()}] {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        sys.exit(1)


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    print(f"[rank {r}] {_gpu.report()} nccl_built={hvd.nccl_built()} size={n}", flush=True)
    before = _gpu.counters()
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
                  torch.int64, torch.uint8, torch.int16):
        x = (torch.arange(1000, device=dev) % 7 + r).to(dtype)
        y = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dtype}")
        want = sum((torch.arange(1000, device=dev) % 7 + k) for k in range(n)).to(dtype)
        check(y.is_cuda and torch.equal(y.cpu(), want.cpu()), f"allreduce Sum {dtype}")
    x = torch.full((33, 5), float(r + 1), device=dev)
    check(torch.allclose(hvd.allreduce(x).cpu(), torch.full((33, 5), (n + 1) / 2)),
          "allreduce Average")
    y = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    check(torch.allclose(y.cpu(), torch.full((33, 5), 1.5 * n * (n + 1) / 2)), "pre/postscale")
    for op, f in ((hvd.Min, min), (hvd.Max, max)):
        y = hvd.allreduce(torch.full((4,), float(r), device=dev), op=op)
        check(float(y[0]) == f(range(n)), f"allreduce {op}")
    y = hvd.allreduce(torch.full((4,), 2.0, device=dev), op=hvd.Product)
    check(float(y[0]) == 2.0 ** n, "allreduce Product")
    ts = [torch.full((k + 1,), float(r), device=dev) for k in range(10)]
    out = hvd.grouped_allreduce(ts, op=hvd.Sum)
    check(all(torch.allclose(o.cpu(), torch.full((k + 1,), float(sum(range(n)))))
              for k, o in enumerate(out)), "grouped allreduce (fused)")
    t = torch.full((4,), float(r), device=dev)
    hvd.allreduce_(t, op=hvd.Sum)
    check(float(t[0]) == sum(range(n)), "allreduce_ in place")
    g = hvd.allgather(torch.full((r + 1, 3), float(r), device=dev))
    want = torch.cat([torch.full((k + 1, 3), float(k)) for k in range(n)])
    check(g.is_cuda and torch.equal(g.cpu(), want), "allgather ragged")
    g = hvd.allgather(torch.full((2, 3), float(r), device=dev))
    check(torch.equal(g.cpu(), torch.cat([torch.full((2, 3), float(k)) for k in range(n)])),
          "allgather even")
    b = hvd.broadcast(torch.full((5,), float(r + 7), device=dev), root_rank=0)
    check(b.is_cuda and torch.equal(b.cpu(), torch.full((5,), 7.0)), "broadcast")
    rows = torch.arange(2 * n, device=dev, dtype=torch.float32).reshape(2 * n, 1) + 100 * r
    a, splits = hvd.alltoall(rows, splits=[2] * n)
    want = torch.cat([torch.arange(2 * r, 2 * r + 2).reshape(2, 1).float() + 100 * k
                      for k in range(n)])
    check(a.is_cuda and torch.equal(a.cpu(), want), "alltoall")
    rs = hvd.reducescatter(torch.ones(2 * n + 1, 2, device=dev), op=hvd.Sum)
    rows_me = (2 * n + 1) // n + (1 if r < (2 * n + 1) % n else 0)
    check(rs.is_cuda and torch.equal(rs.cpu(), torch.full((rows_me, 2), float(n))),
          "reducescatter uneven")
    rs = hvd.reducescatter(torch.ones(2 * n, 2, device=dev), op=hvd.Average)
    check(torch.equal(rs.cpu(), torch.ones(2, 2)), "reducescatter even Average")
    mixed = [hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="cpu.mixed"),
             hvd.allreduce_async(torch.ones(3, device=dev), op=hvd.Sum, name="gpu.mixed")]
    c, gpu_out = [hvd.synchronize(h) for h in mixed]
    check(c.is_cpu and gpu_out.is_cuda and float(c[0]) == n and float(gpu_out[0]) == n,
          "mixed CPU and CUDA in flight")
    hvd.barrier()
    if n > 1:  # a CUDA tensor on one rank, a host tensor on the others: refused on every rank
        t = torch.ones(2, device=dev) if r == 0 else torch.ones(2)
        try:
            hvd.allreduce(t, name="mixed.devices")
            check(False, "CPU/GPU mismatch refused")
        except Exception as e:  # noqa: BLE001
            check("CPU/GPU" in str(e), f"CPU/GPU mismatch refused: {e}")
        # join: the last rank runs out of data; the others' CUDA allreduce gets its zeros
        if r == n - 1:
            last = hvd.join()
        else:
            y = hvd.allreduce(torch.ones(3, device=dev), op=hvd.Sum, name="after.join")
            check(float(y[0]) == n - 1, "CUDA allreduce with a joined rank")
            last = hvd.join()
        check(last >= 0, f"join returned {last}")
    try:
        hvd.allreduce(torch.ones(2, device=dev), op=hvd.Adasum)
        check(False, "Adasum on CUDA refused")
    except Exception as e:  # noqa: BLE001
        check("Adasum" in str(e), f"Adasum on CUDA refused: {type(e).__name__}: {e}")
    after = _gpu.counters()
    print(f"[rank {r}] counters {before} -> {after}", flush=True)
    # latency and bandwidth, a first look
    for size in (1, 1 << 12, 1 << 22):
        x = torch.ones(size, device=dev)
        for _ in range(5):
            hvd.allreduce_(x, op=hvd.Sum, name=f"lat.{size}")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        it = 50
        for _ in range(it):
            hvd.allreduce_(x, op=hvd.Sum, name=f"lat.{size}")
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / it
        print(f"[rank {r}] allreduce {size * 4} B: {dt * 1e6:.1f} us", flush=True)
    hvd.shutdown()
    print(f"[rank {r}] SMOKE OK", flush=True)


if __name__ == "__main__":
    main()
