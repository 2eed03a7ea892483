#!/usr/bin/env python3
"""Autotune against a grid search on the multi-host bed (issue 23, item 7): does
HOROVOD_AUTOTUNE land within 10 % of the best setting a grid search finds, in fewer steps?

    .venv/bin/python benchmarks/autotune.py                  # about 2.5 minutes on 2 cores (root)
    .venv/bin/python benchmarks/autotune.py --rate 1gbit --rounds 5 --json /tmp/autotune.json

One job of 2 hosts x 2 ranks (network namespaces of tests/multihost/bed.py, each host's egress
limited to --rate, ranks started over ssh by spark-hvd-run). Every step allreduces the
gradients of a model-like list of float32 tensors (--model: many small ones and a few large
ones) asynchronously, then waits for all of them; rank 0 times steps between barriers and
scores bytes allreduced per second, as autotune does.

Inside the one job, re-initialising spark_hvd between settings (the settings are read at init):
  1. grid: every combination of fusion threshold x cycle time x response cache x hierarchical
     allreduce (GRID, 60 points), each
     warmed up, then timed over --steps steps;
  2. autotune: HOROVOD_AUTOTUNE=1 with --warmup-samples, --steps-per-sample and --samples, run
     until the tuner has settled (every rank sees tuned_parameters()['tuning'] turn false at
     the same step); the steps it took are counted;
  3. confirmation, side by side: the best grid setting and the autotuned setting (given as
     fixed settings), alternating, --rounds times each; medians.
Result: autotuned / best-grid throughput (target >= 0.90) and autotune's steps against the
grid's (target: fewer). The job spans hosts, so autotune also tunes the hierarchical switches;
the grid has hierarchical allreduce off and on (allgather does not occur in this workload).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRID = {"fusion_mib": (0, 1, 4, 16, 64), "cycle_ms": (0.5, 2.0, 8.0), "cache": (True, False),
        "hier_allreduce": (0, 1)}
_SWITCHES = {"hier_allreduce": "SPARK_HVD_HIERARCHICAL_ALLREDUCE",
             "hier_allgather": "SPARK_HVD_HIERARCHICAL_ALLGATHER"}
MODELS = {
    # 60 tensors, 7.6 MB: layers of a small CNN-ish model (many biases and small kernels) and a
    # few large fully connected ones.
    "mixed": [64] * 20 + [2304] * 16 + [36864] * 16 + [147456] * 4 + [262144] * 4,
    # 4 large tensors of 4 MiB: bandwidth-bound.
    "large": [1 << 20] * 4,
}


# -- ranks -----------------------------------------------------------------------------------

def _setting_env(s):
    """Environment of one fixed setting (all given explicitly: nothing for autotune to do)."""
    env = {"SPARK_HVD_FUSION_THRESHOLD": str(int(s["fusion_mib"] * 1024 * 1024)),
           "SPARK_HVD_CYCLE_TIME": repr(float(s["cycle_ms"])),
           "SPARK_HVD_CACHE_CAPACITY": "1024" if s["cache"] else "0"}
    for key, name in _SWITCHES.items():
        if s.get(key, -1) >= 0:  # -1: the dispatcher chooses
            env[name] = str(s[key])
    return env


def _clear_tuning_env():
    for name in list(os.environ):
        if name.startswith("SPARK_HVD_AUTOTUNE") or name in (
                "SPARK_HVD_FUSION_THRESHOLD", "SPARK_HVD_CYCLE_TIME", "SPARK_HVD_CACHE_CAPACITY",
                *_SWITCHES.values()):
            del os.environ[name]


def _worker(args):
    import numpy as np

    import spark_hvd.numpy as hvd
    from spark_hvd.common import tuned_parameters

    sizes = MODELS[args.model]
    step_bytes = 4 * sum(sizes)
    counter = itertools.count()

    def step():
        rank = hvd.rank()
        handles = [hvd.allreduce_async(g, name=f"grad.{i}", op=hvd.Sum)
                   for i, g in enumerate(grads[rank])]
        for h in handles:
            hvd.synchronize(h)
        next(counter)

    def timed(steps):
        hvd.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        hvd.barrier()
        return step_bytes * steps / (time.perf_counter() - t0)

    def run_setting(s, steps):
        _clear_tuning_env()
        os.environ.update(_setting_env(s))
        hvd.init()
        for _ in range(args.warmup_steps):
            step()
        score = timed(steps)
        hvd.shutdown()
        return score

    grads = {r: [np.full(n, r + 1, np.float32) for n in sizes] for r in range(8)}
    out = {"model": args.model, "step_bytes": step_bytes, "grid": []}
    keys = list(GRID)
    grid_points = [dict(zip(keys, values)) for values in itertools.product(*GRID.values())]
    start = next(counter)
    for s in grid_points:
        out["grid"].append({**s, "bytes_per_s": run_setting(s, args.steps)})
    out["grid_steps"] = next(counter) - start - 1
    best = max(out["grid"], key=lambda g: g["bytes_per_s"])

    # Autotune, from the defaults.
    _clear_tuning_env()
    os.environ.update({"SPARK_HVD_AUTOTUNE": "1",
                       "SPARK_HVD_AUTOTUNE_LOG": args.log,
                       "SPARK_HVD_AUTOTUNE_WARMUP_SAMPLES": str(args.warmup_samples),
                       "SPARK_HVD_AUTOTUNE_STEPS_PER_SAMPLE": str(args.steps_per_sample),
                       "SPARK_HVD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(args.samples)})
    hvd.init()
    start = next(counter)
    while True:
        step()
        if not tuned_parameters()["tuning"]:  # the same step on every rank
            break
    out["autotune_steps"] = next(counter) - start - 1
    final = tuned_parameters()
    tuned = {"fusion_mib": final["fusion_threshold"] / (1024 * 1024),
             "cycle_ms": final["cycle_time_ms"], "cache": final["cache_enabled"],
             "hier_allreduce": final["hierarchical_allreduce"],
             "hier_allgather": final["hierarchical_allgather"]}
    out["autotune_in_job"] = timed(args.steps)
    hvd.shutdown()

    # Side by side: the best grid point and the tuned setting, alternating.
    pairs = {"best_grid": [], "autotuned": []}
    for _ in range(args.rounds):
        pairs["best_grid"].append(run_setting(best, args.steps))
        pairs["autotuned"].append(run_setting(tuned, args.steps))
    out.update(best_grid=best, autotuned=tuned, confirm=pairs,
               ratio=statistics.median(pairs["autotuned"]) / statistics.median(pairs["best_grid"]))
    hvd.init()
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    hvd.shutdown()


# -- driver ----------------------------------------------------------------------------------

def _driver(args):
    sys.path.insert(0, os.path.join(REPO, "tests", "multihost"))
    from bed import Bed, unavailable_reason

    reason = unavailable_reason()
    if reason:
        sys.exit(f"no multi-host bed: {reason}")
    with Bed(2, rate=args.rate) as bed:
        access = bed.start_sshd()
        h0, h1 = bed.hosts
        log = os.path.abspath(args.log)
        cmd = [sys.executable, "-m", "spark_hvd.runner", "-np", "4", "-H",
               f"{h0.addr}:2,{h1.addr}:2", "-i", access.identity_file,
               sys.executable, os.path.abspath(__file__), "--worker", "--model", args.model,
               "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
               "--warmup-samples", str(args.warmup_samples), "--steps-per-sample",
               str(args.steps_per_sample), "--samples", str(args.samples), "--rounds",
               str(args.rounds), "--log", log]
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SPARK_HVD_", "HOROVOD_"))}
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        t0 = time.monotonic()
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        seconds = time.monotonic() - t0
    line = next((x for x in done.stdout.splitlines() if "RESULT " in x), None)
    if done.returncode != 0 or line is None:
        sys.exit(f"the job failed ({done.returncode}):\n{done.stdout[-4000:]}\n"
                 f"{done.stderr[-4000:]}")
    out = json.loads(line.split("RESULT ", 1)[1])
    out.update(rate=args.rate, seconds=round(seconds, 1),
               load=round(os.getloadavg()[0], 2))
    _report(out, log)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def _report(out, log):
    mb = 1e6
    print(f"model {out['model']} ({out['step_bytes'] / mb:.2f} MB per step), 2 hosts x 2 "
          f"ranks, link {out['rate']}, job {out['seconds']} s, load {out['load']}")
    print("grid (fusion MiB, cycle ms, cache, hierarchical allreduce): MB/s, best first")
    for g in sorted(out["grid"], key=lambda g: -g["bytes_per_s"]):
        print(f"  {g['fusion_mib']:>4} {g['cycle_ms']:>4} {int(g['cache'])} "
              f"{g['hier_allreduce']:>2}  {g['bytes_per_s'] / mb:8.1f}")
    b, t = out["best_grid"], out["autotuned"]
    print(f"best grid point   {b['fusion_mib']} MiB, {b['cycle_ms']} ms, cache {int(b['cache'])}"
          f", hierarchical allreduce {b['hier_allreduce']}")
    print(f"autotuned setting {t['fusion_mib']:.3f} MiB, {t['cycle_ms']} ms, "
          f"cache {int(t['cache'])}, hierarchical allreduce {t['hier_allreduce']} / allgather "
          f"{t['hier_allgather']}")
    for k, v in out["confirm"].items():
        print(f"  {k:<10} " + " ".join(f"{x / mb:7.1f}" for x in v) +
              f"   median {statistics.median(v) / mb:7.1f} MB/s")
    print(f"autotuned / best grid: {out['ratio']:.3f}   (target >= 0.90)")
    print(f"steps: autotune {out['autotune_steps']}, grid {out['grid_steps']}   "
          f"(target: fewer)")
    print(f"autotune log: {log}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", choices=sorted(MODELS), default="mixed")
    p.add_argument("--rate", default="1gbit", help="egress limit of each host (tc tbf)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per grid point")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--warmup-samples", type=int, default=2)
    p.add_argument("--steps-per-sample", type=int, default=5)
    p.add_argument("--samples", type=int, default=14)
    p.add_argument("--rounds", type=int, default=3, help="side-by-side confirmation rounds")
    p.add_argument("--log", default="/tmp/spark_hvd_autotune_bench.csv")
    p.add_argument("--json")
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    if args.worker:
        _worker(args)
    else:
        _driver(args)


if __name__ == "__main__":
    main()
