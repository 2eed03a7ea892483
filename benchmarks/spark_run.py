#!/usr/bin/env python3
"""spark_hvd.spark.run vs Spark's TorchDistributor: the cost of starting a job on Spark.

    .venv/bin/python benchmarks/spark_run.py              # 5 repetitions (5-10 minutes)
    .venv/bin/python benchmarks/spark_run.py --reps 3 --json out.json

One local[2] SparkSession serves both systems, each running 2 ranks as 2 barrier tasks:
  spark_hvd         spark_hvd.spark.run(fn, num_proc=2)
  TorchDistributor  TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(fn)
                    (each task starts torchrun, which starts the rank)

Measured, per repetition, with the systems alternating (each warmed up once first):
  start     from the run() call until fn has started on every rank (fn writes time.time() to a
            file as its first statement; same machine, same clock)
  empty     wall time of run() for that (otherwise empty) fn: the whole overhead
  init      wall time of run() for an fn that only forms the collective group: hvd.init() for
            spark_hvd, torch.distributed.init_process_group("gloo") for TorchDistributor
Reported: medians, and TorchDistributor / spark_hvd ratios (> 1: spark_hvd is faster).
Target (issue 4): spark_hvd's overhead <= TorchDistributor's, i.e. ratios >= 1.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def mark_start(directory):
    """The benchmarked fn: record when it started on this rank, nothing else."""
    import os
    import time
    now = time.time()
    rank = os.environ.get("SPARK_HVD_RANK") or os.environ.get("RANK") or "0"
    with open(os.path.join(directory, f"start.{rank}"), "w") as f:
        f.write(repr(now))


def hvd_init():
    import spark_hvd.numpy as hvd
    hvd.init()
    hvd.shutdown()


def torch_init():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.destroy_process_group()


def session():
    from pyspark.sql import SparkSession
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    spark = (SparkSession.builder.master("local[2]").appName("spark_hvd run benchmark")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


class System:
    def __init__(self, name, run_fn):
        self.name, self.run_fn = name, run_fn
        self.samples = {"start": [], "empty": [], "init": []}
        self.failures = []

    def measure(self, tries=3):
        """One sample of each kind; a failed run (it happens to torchrun's gloo under load) is
        noted and tried again."""
        for kind in ("start", "init"):
            for attempt in range(tries):
                try:
                    self._measure(kind)
                    break
                except Exception as e:  # noqa: BLE001
                    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                    self.failures.append(f"{kind}: {first[:200]}")
                    print(f"{self.name}: a '{kind}' run failed ({first[:200]}); "
                          f"{'trying again' if attempt + 1 < tries else 'giving up'}",
                          flush=True)
            else:
                raise RuntimeError(f"{self.name}: '{kind}' failed {tries} times")

    def _measure(self, kind):
        if kind == "start":
            with tempfile.TemporaryDirectory(prefix="spark_hvd_bench_") as d:
                t0 = time.time()
                self.run_fn(mark_start, d)
                total = time.time() - t0
                starts = [float(open(os.path.join(d, f)).read()) for f in os.listdir(d)]
            if len(starts) != 2:
                raise RuntimeError(f"{self.name}: fn started on {len(starts)} ranks, not 2")
            self.samples["start"].append(max(starts) - t0)
            self.samples["empty"].append(total)
        else:
            t0 = time.time()
            self.run_fn(hvd_init if self.name == "spark_hvd" else torch_init, None)
            self.samples["init"].append(time.time() - t0)


def spark_hvd_runner(spark):
    import spark_hvd.spark

    def run(fn, arg):
        args = (arg,) if arg is not None else ()
        return spark_hvd.spark.run(fn, args=args, num_proc=2, spark=spark, verbose=0)
    return run


def torch_distributor_runner(spark):
    from pyspark.ml.torch.distributor import TorchDistributor

    def run(fn, arg):
        args = (arg,) if arg is not None else ()
        return TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(fn, *args)
    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", help="also write the samples and medians here")
    p.add_argument("--strict", action="store_true", help="exit 1 when the target is missed")
    args = p.parse_args(argv)
    import logging
    logging.getLogger("TorchDistributor").setLevel(logging.WARNING)

    t0 = time.time()
    spark = session()
    print(f"SparkSession local[2] up in {time.time() - t0:.1f} s", flush=True)
    systems = [System("spark_hvd", spark_hvd_runner(spark)),
               System("TorchDistributor", torch_distributor_runner(spark))]
    for s in systems:  # warm-up: Python workers, imports, JIT; not counted
        s.measure()
        s.samples = {k: [] for k in s.samples}
    for rep in range(args.reps):
        order = systems if rep % 2 == 0 else systems[::-1]
        for s in order:
            s.measure()
        print(f"repetition {rep + 1}/{args.reps}: " + ", ".join(
            f"{s.name} start {s.samples['start'][-1]:.2f} s empty {s.samples['empty'][-1]:.2f} s"
            f" init {s.samples['init'][-1]:.2f} s" for s in systems), flush=True)
    spark.stop()

    medians = {s.name: {k: statistics.median(v) for k, v in s.samples.items()} for s in systems}
    ours, theirs = medians["spark_hvd"], medians["TorchDistributor"]
    rows = [("start", "run() -> fn started on all ranks"), ("empty", "run() of an empty fn"),
            ("init", "run() of fn = init the group")]
    print()
    print(f"{'median seconds':<36}{'spark_hvd':>11}{'TorchDistributor':>18}{'ratio TD/ours':>15}")
    for key, label in rows:
        print(f"{label:<36}{ours[key]:>11.3f}{theirs[key]:>18.3f}{theirs[key] / ours[key]:>14.2f}x")
    print()
    ok = all(ours[k] <= theirs[k] for k in ("start", "empty"))
    print(f"{'PASS' if ok else 'FAIL'}: spark_hvd overhead <= TorchDistributor's "
          f"(start {theirs['start'] / ours['start']:.2f}x, empty "
          f"{theirs['empty'] / ours['empty']:.2f}x)")
    for s in systems:
        if s.failures:
            print(f"note: {len(s.failures)} failed {s.name} run(s), retried: {s.failures}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"reps": args.reps, "medians": medians,
                       "samples": {s.name: s.samples for s in systems},
                       "failures": {s.name: s.failures for s in systems}}, f, indent=1)
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
