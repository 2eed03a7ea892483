"""Where the time of one small synchronous allreduce goes, layer by layer (issue 21, part 2).

Run it alone (one rank: no peer, no negotiation) or on two ranks through the launcher::

    python benchmarks/allreduce_breakdown.py
    spark-hvd-run -np 2 python benchmarks/allreduce_breakdown.py

Each line is the median over rounds of the mean time per call (µs) of: the whole
``hvd.allreduce_`` of a 4-byte torch tensor, the native enqueue-and-wait call alone on a
prebuilt record, the Python layers with that native call replaced by a no-op (what Python
costs), their main parts, a bare ctypes call, and the separate enqueue and wait calls of the
asynchronous path (their medians over single calls). On two ranks both ranks run every line
in step (each line starts with a barrier); rank 0 prints.
"""

import argparse
import statistics
import time

import torch

import spark_hvd.torch as hvd
from _helpers.timing import median_per_call
from spark_hvd.common import _native, _ops
from spark_hvd.torch import collectives


def per_call_us(fn, calls, rounds=9):
    """Median over ``rounds`` of the mean µs per call of ``calls`` calls (after a warm-up)."""
    return median_per_call(fn, calls, rounds, warmup=calls // 5) * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=5000, help="calls per round")
    args = p.parse_args()
    hvd.init()
    t = torch.zeros(1)
    lib, slice_ms = _native.lib, _ops._SLICE
    record = _ops._allreduce_record("breakdown", collectives._dtype_code(t), t.shape,
                                    t.data_ptr(), t.data_ptr(), _ops.Sum, 1.0, 1.0, 0)
    rows = []

    def line(label, fn, collective=True):
        hvd.barrier()
        us = per_call_us(fn, args.calls if collective else 4 * args.calls)
        rows.append((label, us))

    line("hvd.allreduce_ (torch, 4 B)", lambda: hvd.allreduce_(t, name="breakdown"))
    line("  native enqueue-and-wait call",
         lambda: lib.shvd_enqueue_record_wait(record, len(record), slice_ms))
    line("  hvd.allreduce_async_ + synchronize",
         lambda: hvd.synchronize(hvd.allreduce_async_(t, name="breakdown")))
    real = _ops._enqueue_wait_native
    _ops._enqueue_wait_native = lambda rec, n, ms: 0
    try:
        line("  Python layers (native call a no-op)",
             lambda: hvd.allreduce_(t, name="breakdown"), collective=False)
    finally:
        _ops._enqueue_wait_native = real
    line("    record pack", lambda: _ops._allreduce_record(
        "breakdown", 7, t.shape, 1, 1, 1, 1.0, 1.0, 0), collective=False)
    line("    tensor checks, pointer, dtype", lambda: (
        t.is_cpu and t.is_contiguous() and t.layout == torch.strided, collectives._ptr(t),
        collectives._dtype_code(t)), collective=False)
    line("  bare ctypes call (shvd_rank)", lib.shvd_rank, collective=False)
    hvd.barrier()
    enqueue_ns, wait_ns = [], []
    for _ in range(4 * args.calls):
        a = time.perf_counter_ns()
        h = lib.shvd_enqueue_record(record, len(record))
        b = time.perf_counter_ns()
        lib.shvd_wait_release_one_for(h, slice_ms)
        enqueue_ns.append(b - a)
        wait_ns.append(time.perf_counter_ns() - b)
    rows.append(("  async: enqueue call (median)", statistics.median(enqueue_ns) / 1000))
    rows.append(("  async: wait call (median)", statistics.median(wait_ns) / 1000))
    if hvd.rank() == 0:
        print(f"{hvd.size()} rank(s), µs per call")
        for label, us in rows:
            print(f"{label:42s} {us:7.2f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
