"""Hierarchical collectives across hosts: exact results and their bitwise equality on every
rank, and the time of a large allreduce.

Usage: hierarchical.py check
       hierarchical.py time <MiB> <repetitions>

``check``: float32 Sum / Average (prescale, postscale) and int32 Max allreduces from one
element to 16 MiB, fused small tensors, and an allgather with a different first dimension per
rank, against NumPy references computed from every rank's inputs; every result's digest is
allgathered and must be the same on every rank.
``time``: a float32 allreduce of <MiB> MiB, one warm-up, then <repetitions> timed; rank 0
prints ``TIME mib=<MiB> median=<seconds> all=<s,s,...>``.
"""

import statistics
import sys
import time

import numpy as np

import spark_hvd.numpy as hvd
from _wutil import Checks, digest, make_input

# Sizes (elements) from latency-bound to bandwidth-bound, odd ones so blocks are uneven.
COUNTS = [1, 3, 1031, 64 * 1024 + 7, 1024 * 1024 + 3, 4 * 1024 * 1024 + 1]


def check(c: Checks) -> None:
    n, me = hvd.size(), hvd.rank()
    digests = []

    def expect(tag, got, want, exact=True):
        if got is None:
            return
        ok = np.array_equal(got, want) if exact else np.allclose(got, want, rtol=1e-5,
                                                                  atol=1e-5)
        c.check(ok, f"{tag}: wrong result (max error "
                    f"{np.max(np.abs(got.astype(np.float64) - want)) if got.size else 0})")
        digests.append(np.frombuffer(digest(got), dtype=np.uint8))

    for count in COUNTS:
        # Integers in float32: sums are exact whatever the order.
        tag = f"sum_{count}"
        xs = [make_input(r, (count,), np.int32, tag).astype(np.float32) for r in range(n)]
        expect(tag, c.run(tag, hvd.allreduce, xs[me], op=hvd.Sum, name=tag), np.sum(xs, axis=0))
        tag = f"max_{count}"
        xs = [make_input(r, (count,), np.int32, tag) for r in range(n)]
        expect(tag, c.run(tag, hvd.allreduce, xs[me], op=hvd.Max, name=tag), np.max(xs, axis=0))
        # Random floats: the order of the additions shows in the last bits; the digests must
        # still agree on every rank.
        tag = f"avg_{count}"
        xs = [make_input(r, (count,), np.float32, tag) for r in range(n)]
        want = np.mean([x.astype(np.float64) * 0.5 for x in xs], axis=0) * 4.0
        expect(tag, c.run(tag, hvd.allreduce, xs[me], op=hvd.Average, name=tag,
                          prescale_factor=0.5, postscale_factor=4.0), want, exact=False)
    # Small tensors fused into one response.
    tags = [f"fused_{i}" for i in range(20)]
    xs = {t: [make_input(r, (17 + i,), np.int32, t).astype(np.float32) for r in range(n)]
          for i, t in enumerate(tags)}
    handles = [hvd.allreduce_async(xs[t][me], op=hvd.Sum, name=t) for t in tags]
    for t, h in zip(tags, handles):
        expect(t, c.run(t, hvd.synchronize, h), np.sum(xs[t], axis=0))
    # Allgather: rank r contributes 1000 * (r + 1) + 13 rows.
    tag = "gather"
    xs = [make_input(r, (1000 * (r + 1) + 13, 3), np.float32, tag) for r in range(n)]
    expect(tag, c.run(tag, hvd.allgather, xs[me], name=tag), np.concatenate(xs))
    # Large enough that each lane's piece of a host's region crosses in several 4 MiB
    # segments (pipelined with the sharing within the host), hosts with different numbers.
    tag = "gather_big"
    xs = [make_input(r, ((r + 1) * 1_500_000 + 7,), np.float32, tag) for r in range(n)]
    expect(tag, c.run(tag, hvd.allgather, xs[me], name=tag), np.concatenate(xs))

    mine = np.stack(digests)
    every = c.run("digests", hvd.allgather, mine, name="digests")
    if every is not None:
        per = every.reshape(n, len(digests), -1)
        for r in range(1, n):
            c.check(np.array_equal(per[r], per[0]), f"rank {r}'s results differ from rank 0's")


def time_allreduce(c: Checks, mib: float, reps: int) -> None:
    x = np.ones(int(mib * 2 ** 20) // 4, dtype=np.float32)
    hvd.allreduce(x, op=hvd.Sum, name="warmup")
    times = []
    for i in range(reps):
        hvd.barrier()
        t0 = time.perf_counter()
        y = hvd.allreduce(x, op=hvd.Sum, name=f"timed_{i}")
        times.append(time.perf_counter() - t0)
    c.check(float(y[0]) == hvd.size() and float(y[-1]) == hvd.size(), "wrong sum")
    if hvd.rank() == 0:
        print(f"TIME mib={mib:g} median={statistics.median(times):.4f} "
              f"all={','.join(f'{t:.4f}' for t in times)}", flush=True)


def main() -> None:
    hvd.init()
    c = Checks(hvd.rank())
    if sys.argv[1] == "check":
        check(c)
    else:
        time_allreduce(c, float(sys.argv[2]), int(sys.argv[3]))
    hvd.shutdown()
    c.finish()


if __name__ == "__main__":
    main()
