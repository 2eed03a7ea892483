"""Where a small CUDA allreduce's time goes, layer by layer (issue 33, part 5), beside
torch.distributed's NCCL in the same run.

    python3 benchmarks/gpu_latency.py            # 2 ranks (they share cuda:0 on a 1-GPU host)
    python3 benchmarks/gpu_latency.py --quick

For each size from 4 B to 1 MiB (float32), each system times synchronous allreduces, one at a
time (op, then torch.cuda.synchronize()): the median over repetitions of the mean latency per op.
For spark_hvd it then splits that time with the core's own clocks (spark_hvd.common.gpu_counters'
latency_* fields, summed over the same ops):

  negotiation  enqueue -> the engine executes the op (queue, the coordinator's round trip)
  launch       execution -> the GPU work enqueued on the core's stream (events, fusion copies,
               ncclAllReduce's launch)
  gpu          -> the finalizer sees the op's done event (the kernel, and the polling's lag)
  rest         what remains of the caller's time: waking the caller, the adapter's Python
               layers, the caller's synchronize

and prints spark_hvd / torch NCCL per size (the target is <= 1.0x). Ranks that share a GPU each
claim their own NCCL host identity in both systems (NCCL refuses duplicate GPUs within a host),
so both go through NCCL's network transport alike. On a machine without a CUDA device it says
so and exits 0 (``make bench`` runs every benchmark).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _helpers.machine import free_port
from _helpers.timing import median_per_call

REPO = Path(__file__).resolve().parents[1]
# GPU_SUITE_DRY_RUN_ON_CPU=1 (as tests/gpu): CPU tensors and gloo, to check this script's
# plumbing on a machine without a GPU; its numbers mean nothing.
DRY_RUN = os.environ.get("GPU_SUITE_DRY_RUN_ON_CPU") == "1"
DEVICE = "cpu" if DRY_RUN else "cuda"


def sync() -> None:
    import torch
    if not DRY_RUN:
        torch.cuda.synchronize()


def use_gpu(index: int) -> None:
    import torch
    if not DRY_RUN:
        torch.cuda.set_device(index % torch.cuda.device_count())


def gpu_count() -> int:
    import torch
    return 1 if DRY_RUN else torch.cuda.device_count()
SIZES = [4, 64, 1024, 16 << 10, 256 << 10, 1 << 20]
NP = 2


def timed(op, sync, ops: int, reps: int) -> float:
    """Median over ``reps`` of the mean seconds per synchronous op (after a warm-up)."""
    def op_then_sync():
        op()
        sync()
    return median_per_call(op_then_sync, ops, reps, warmup=max(ops // 4, 3))


def run_spark_hvd(args) -> dict:
    """One rank of the spark_hvd job: {size: {"total": s, "negotiation": s, ...}}."""
    import torch

    import spark_hvd.torch as hvd
    from spark_hvd.common import gpu_counters
    hvd.init()
    use_gpu(hvd.local_rank())
    out = {}
    for nbytes in SIZES:
        x = torch.ones(max(nbytes // 4, 1), device=DEVICE)
        name = f"lat{nbytes}"
        op = lambda: hvd.allreduce_(x, op=hvd.Sum, name=name)  # noqa: E731
        timed(op, sync, 20, 1)  # warm-up: communicators, cache
        before = gpu_counters()
        total = timed(op, sync, args.ops, args.reps)
        after = gpu_counters()
        n = max(after["latency_ops"] - before["latency_ops"], 1)
        parts = {k: (after[f"latency_{k}_ns"] - before[f"latency_{k}_ns"]) / n / 1e9
                 for k in ("negotiation", "launch", "gpu")}
        parts["rest"] = total - sum(parts.values())
        out[nbytes] = {"total": total, **parts,
                       "staged": after["host_staged_bytes"] - before["host_staged_bytes"]}
    hvd.shutdown()
    return out


def run_torch_nccl(args) -> dict:
    """One rank of torch.distributed's NCCL job: {size: {"total": s}}."""
    import torch
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    use_gpu(rank)
    if gpu_count() < NP:
        os.environ["NCCL_HOSTID"] = f"torch-latency-{rank}"
    dist.init_process_group("gloo" if DRY_RUN else "nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=NP)
    out = {}
    for nbytes in SIZES:
        x = torch.ones(max(nbytes // 4, 1), device=DEVICE)
        out[nbytes] = {"total": timed(lambda: dist.all_reduce(x), sync, args.ops, args.reps)}
    dist.destroy_process_group()
    return out


def rank_main(args) -> None:
    result = run_spark_hvd(args) if args.system == "spark_hvd" else run_torch_nccl(args)
    rank = int(os.environ.get("SPARK_HVD_RANK", os.environ.get("RANK", "0")))
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def launch(system: str, args) -> dict:
    common = [sys.executable, __file__, "--rank-of", system, "--ops", str(args.ops),
              "--reps", str(args.reps)]
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if system == "spark_hvd":
        if gpu_count() < NP:
            env["SPARK_HVD_SHARED_GPU"] = "nccl"
        procs = [subprocess.Popen([sys.executable, "-m", "spark_hvd.runner", "-np", str(NP),
                                   *common], env=env, stdout=subprocess.PIPE, text=True)]
    else:
        port = str(free_port())
        procs = [subprocess.Popen(common + ["--port", port], env=dict(env, RANK=str(r)),
                                  stdout=subprocess.PIPE, text=True) for r in range(NP)]
    result = None
    for p in procs:
        out, _ = p.communicate(timeout=600)
        for line in out.splitlines():
            if "RESULT " in line:
                result = json.loads(line.split("RESULT ", 1)[1])
        if p.returncode != 0:
            raise SystemExit(f"{system} ranks failed (exit {p.returncode}):\n{out[-4000:]}")
    if result is None:
        raise SystemExit(f"{system}: rank 0 printed no result")
    return {int(k): v for k, v in result.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer ops and repetitions")
    p.add_argument("--ops", type=int, default=None, help="ops per timed repetition")
    p.add_argument("--reps", type=int, default=None, help="repetitions (the median is kept)")
    p.add_argument("--rounds", type=int, default=None,
                   help="runs of both systems, alternating (the median per size is kept)")
    p.add_argument("--rank-of", dest="system", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.ops = args.ops or (50 if args.quick else 200)
    args.reps = args.reps or (3 if args.quick else 7)
    if args.system:
        rank_main(args)
        return
    try:
        import torch
        cuda = DRY_RUN or torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        print("gpu_latency: no CUDA device here (torch.cuda.is_available() is False): skipped")
        return
    rounds = args.rounds or (1 if args.quick else 3)
    runs = {"spark_hvd": [], "nccl": []}
    for _ in range(rounds):
        for system in runs:
            runs[system].append(launch(system, args))
    gpu = "DRY RUN ON THE CPU" if DRY_RUN else torch.cuda.get_device_name(0)
    print(f"Small CUDA allreduces, {NP} ranks, {gpu} "
          f"({gpu_count()} visible), torch {torch.__version__}; median of "
          f"{rounds} round(s) x {args.reps} repetitions x {args.ops} synchronous ops")
    print("| size | torch NCCL µs | spark_hvd µs | ratio | negotiation | launch | gpu | rest "
          "| staged B |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for nbytes in SIZES:
        def med(system, key):
            return statistics.median(r[nbytes][key] for r in runs[system])
        ours, theirs = med("spark_hvd", "total"), med("nccl", "total")
        parts = " | ".join(f"{med('spark_hvd', k) * 1e6:.1f}"
                           for k in ("negotiation", "launch", "gpu", "rest"))
        print(f"| {nbytes} | {theirs * 1e6:.1f} | {ours * 1e6:.1f} | {ours / theirs:.2f}x | "
              f"{parts} | {int(med('spark_hvd', 'staged'))} |")


if __name__ == "__main__":
    main()
