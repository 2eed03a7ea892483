"""Autotuning in a training-like loop: every step allreduces a few gradients (asynchronously,
then waits for all), checks the sums, and records the settings its collectives ran with
(spark_hvd.common.tuned_parameters). At the end every rank's record must equal rank 0's: all
ranks switched at the same step.

Usage: autotune.py STEPS [EXPECT_FUSION_BYTES]
  EXPECT_FUSION_BYTES: the user fixed the fusion threshold; every step must keep it.
"""

import json
import sys

import numpy as np

import spark_hvd.numpy as hvd
from spark_hvd.common import tuned_parameters
from spark_hvd.common.objects import allgather_object
from _wutil import Checks, apply_rank_env

SIZES = (1000, 20000, 3000, 50000, 700, 120000)  # float32 elements of each "gradient"


def main():
    steps = int(sys.argv[1])
    fixed_fusion = int(sys.argv[2]) if len(sys.argv) > 2 else None
    apply_rank_env()  # ENV_OF_RANK_<r>: settings only rank r is given
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    c = Checks(rank)
    record = []
    for step in range(steps):
        grads = [np.full(n, rank + step + i, np.float32) for i, n in enumerate(SIZES)]
        handles = [hvd.allreduce_async(g, name=f"grad.{i}", op=hvd.Sum)
                   for i, g in enumerate(grads)]
        sums = [hvd.synchronize(h) for h in handles]
        for i, s in enumerate(sums):
            want = sum(r + step + i for r in range(size))
            c.check(np.all(s == want), f"step {step} grad.{i}: {s[:3]} != {want}")
        p = tuned_parameters()
        record.append((p["generation"], p["fusion_threshold"], p["cycle_time_ms"],
                       p["cache_enabled"], p["hierarchical_allreduce"],
                       p["hierarchical_allgather"], p["tuning"]))
        if fixed_fusion is not None:
            c.check(p["fusion_threshold"] == fixed_fusion,
                    f"step {step}: fusion threshold {p['fusion_threshold']} != {fixed_fusion}")
    everyone = allgather_object(record)
    for r, other in enumerate(everyone):
        if other != record:
            first = next(i for i, (a, b) in enumerate(zip(record, other)) if a != b)
            c.fail(f"rank {r} ran step {first} with {other[first]}, rank {rank} with "
                   f"{record[first]}")
    settings = sorted({rec[1:6] for rec in record})
    if rank == 0:
        print("RECORD " + json.dumps({"generations": record[-1][0], "settings": settings,
                                      "tuning_at_end": record[-1][-1]}), flush=True)
    hvd.shutdown()
    c.finish(generations=record[-1][0])


if __name__ == "__main__":
    main()
