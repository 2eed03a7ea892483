#!/usr/bin/env python3
"""Data-parallel training throughput: spark_hvd's DistributedOptimizer vs torch DDP (gloo).

    .venv/bin/python benchmarks/scaling.py             # 3 rounds, about 5 minutes on 2 cores
    .venv/bin/python benchmarks/scaling.py --quick     # 1 round, about 1.5 minutes
    .venv/bin/python benchmarks/scaling.py --models mlp --rounds 5 --json /tmp/scaling.json

Two CPU models, one torch thread per rank, the same per-rank batch at every size (weak
scaling), SGD with momentum:
  cnn  a small CIFAR-style CNN (3 conv + BN, 2 FC; 0.13 M parameters), 32x32 images, batch 32
  mlp  784-1024-1024-1024-10 (2.9 M parameters, 11.6 MB of gradients), batch 128

Jobs, one at a time:
  hvd x1        spark-hvd-run -np 1, DistributedOptimizer (no hooks at size 1, as Horovod)
  hvd x1 hooks  the same with SPARK_HVD_ELASTIC=1: hooks and allreduces run at size 1 too
  hvd x2        spark-hvd-run -np 2, DistributedOptimizer
  ddp x1, x2    torch DistributedDataParallel over gloo (127.0.0.1), 1 and 2 processes

Inside every job each rank trains twin models: "local" (a plain torch optimizer, no
communication: plain single-process PyTorch) and "dist" (the system's data parallelism). Their
timed repetitions (N steps, all ranks meeting at a barrier first; rank 0 times) alternate, so
both see the same machine load; a job's figure is the median over its repetitions, and each
round runs every job once (rotated order); tables show the median over rounds.

Two views of scaling efficiency:
  - the issue's definition across jobs: dist(x2) / (2 x dist(x1)) of the same system;
  - within one job (robust to other load on the machine): dist(x2) / local(x2), i.e. the
    2-rank throughput against the same two processes training without communication.
DistributedOptimizer overhead at 1 rank = 1 - dist / local inside the x1 job. The 1-minute load
average is printed: above ~1.5 on 2 cores other processes competed for the CPUs.
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MARK = "@@SCALING "
MODELS = ("cnn", "mlp")
CONFIGS = ("hvd1", "hvd1hooks", "hvd2", "ddp1", "ddp2")
LABEL = {"hvd1": "hvd x1", "hvd1hooks": "hvd x1 hooks", "hvd2": "hvd x2", "ddp1": "ddp x1",
         "ddp2": "ddp x2"}
TARGET_EFFICIENCY = 0.90
TARGET_OVERHEAD = 0.05


# ---------------------------------------------------------------------------------------------
# Worker: one rank of one job

def build(name):
    import torch
    import torch.nn.functional as F
    from torch import nn

    if name == "cnn":
        class CNN(nn.Module):
            def __init__(self):
                super().__init__()
                self.c1, self.b1 = nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32)
                self.c2, self.b2 = nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64)
                self.c3, self.b3 = nn.Conv2d(64, 96, 3, padding=1), nn.BatchNorm2d(96)
                self.f1, self.f2 = nn.Linear(96, 128), nn.Linear(128, 10)

            def forward(self, x):
                x = F.max_pool2d(F.relu(self.b1(self.c1(x))), 2)
                x = F.max_pool2d(F.relu(self.b2(self.c2(x))), 2)
                x = F.relu(self.b3(self.c3(x)))
                x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
                return self.f2(F.relu(self.f1(x)))
        return CNN(), (32, 3, 32, 32), 32
    layers, width = [], 784
    for _ in range(3):
        layers += [nn.Linear(width, 1024), nn.ReLU()]
        width = 1024
    return nn.Sequential(*layers, nn.Linear(width, 10)), (128, 784), 128


def worker(args):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    system = args.worker
    if system == "hvd":
        import spark_hvd.torch as hvd
        hvd.init()
        rank, size, barrier = hvd.rank(), hvd.size(), hvd.barrier
    else:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=args.rank, world_size=args.size)
        rank, size, barrier = args.rank, args.size, dist.barrier

    results = {}
    for name in args.models.split(","):
        # Twin models: "local" trains with a plain optimizer and never communicates, "dist"
        # with the system's data parallelism; their repetitions alternate, so both see the
        # same machine load.
        steppers = {}
        for kind in ("local", "dist"):
            torch.manual_seed(0)
            model, shape, batch = build(name)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            if kind == "dist" and system == "hvd":
                opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            elif kind == "dist":
                from torch.nn.parallel import DistributedDataParallel
                model = DistributedDataParallel(model)
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(shape, generator=g)
            y = torch.randint(0, 10, (batch,), generator=g)

            def step(model=model, opt=opt, x=x, y=y):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            steppers[kind] = step
            for _ in range(args.warmup):
                step()
        rates = {"local": [], "dist": []}
        cpu = {"local": [], "dist": []}
        for rep in range(args.reps):
            for kind in (("local", "dist") if rep % 2 == 0 else ("dist", "local")):
                step = steppers[kind]
                barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.steps):
                    step()
                c1 = time.process_time()
                barrier()
                rates[kind].append(size * batch * args.steps / (time.perf_counter() - t0))
                cpu[kind].append((c1 - c0) / args.steps * 1e3)
        results[name] = {k: {"median": statistics.median(v), "best": max(v), "reps": v,
                             "cpu_ms_per_step": statistics.median(cpu[k])}
                         for k, v in rates.items()}
    if rank == 0:
        print(MARK + json.dumps({"size": size, "results": results}), flush=True)
    if system == "hvd":
        hvd.shutdown()
    else:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Driver

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher():
    path = os.path.join(os.path.dirname(sys.executable), "spark-hvd-run")
    return [path] if os.path.exists(path) else [sys.executable, "-m", "spark_hvd.runner"]


def commands(config, args):
    me = [sys.executable, os.path.abspath(__file__), "--models", ",".join(args.models),
          "--warmup", str(args.warmup), "--reps", str(args.reps), "--steps", str(args.steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in list(env):
        if k.startswith(("SPARK_HVD_", "HOROVOD_")):
            del env[k]
    n = 2 if config.endswith("2") else 1
    if config.startswith("hvd"):
        if config == "hvd1hooks":
            env["SPARK_HVD_ELASTIC"] = "1"
        return [launcher() + ["-np", str(n)] + me + ["--worker", "hvd"]], env
    port = free_port()
    env["GLOO_SOCKET_IFNAME"] = "lo"
    return [me + ["--worker", "ddp", "--rank", str(r), "--size", str(n), "--port", str(port)]
            for r in range(n)], env


def run_config(config, args):
    cmds, env = commands(config, args)
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=REPO, start_new_session=True) for c in cmds]
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=args.timeout)
            out.append(text)
    except subprocess.TimeoutExpired:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        raise RuntimeError(f"{config}: no result within {args.timeout} s")
    for text in out:
        for line in text.splitlines():
            i = line.find(MARK)
            if i >= 0:
                return json.loads(line[i + len(MARK):])
    raise RuntimeError(f"{config} failed:\n" + "\n".join(t[-3000:] for t in out))


def load():
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round, fewer repetitions")
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (1 with --quick)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=None,
                    help="timed repetitions of each twin (default 6; 3 with --quick)")
    ap.add_argument("--steps", type=int, default=10, help="steps per repetition")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default=None, help="write every measurement to this file")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target FAILs")
    # worker mode
    ap.add_argument("--worker", choices=("hvd", "ddp"), help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reps is None:
        args.reps = 3 if args.quick else 6
    if args.worker:
        return worker(args)
    args.models = [m for m in args.models.split(",") if m]
    configs = [c for c in args.configs.split(",") if c]
    rounds = args.rounds or (1 if args.quick else 3)

    runs = {c: [] for c in configs}
    loads = []
    for r in range(rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for config in order:
            before = load()
            print(f"[scaling] round {r + 1}/{rounds}: {LABEL[config]} (load {before:.2f})",
                  file=sys.stderr, flush=True)
            runs[config].append(run_config(config, args)["results"])
            loads.append((config, before, load()))
    stats = summarize(runs, args.models)
    report(stats, loads, args, rounds, runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": stats, "runs": runs, "loads": loads}, f, indent=1)
    failed = any(line.startswith("FAIL") for line in verdicts(stats, args.models))
    return 1 if failed and args.strict else 0


def summarize(runs, models):
    """{config: {model: {dist, local, ratio, cpu_dist, cpu_local}}}: medians over rounds."""
    out = {}
    for config, rounds in runs.items():
        if not rounds:
            continue
        out[config] = {}
        for m in models:
            rs = [r[m] for r in rounds]
            out[config][m] = {
                "dist": statistics.median(r["dist"]["median"] for r in rs),
                "local": statistics.median(r["local"]["median"] for r in rs),
                "ratio": statistics.median(r["dist"]["median"] / r["local"]["median"]
                                           for r in rs),
                "cpu_dist": statistics.median(r["dist"]["cpu_ms_per_step"] for r in rs),
                "cpu_local": statistics.median(r["local"]["cpu_ms_per_step"] for r in rs),
            }
    return out


def verdicts(stats, models):
    out = []

    def get(c, m, k):
        return stats.get(c, {}).get(m, {}).get(k)

    def line(ok, text):
        out.append(f"{'PASS' if ok else 'FAIL'} {text}")
    for m in models:
        if get("hvd2", m, "dist") and get("hvd1", m, "dist"):
            eff = get("hvd2", m, "dist") / (2 * get("hvd1", m, "dist"))
            line(eff >= TARGET_EFFICIENCY, f"{m}: spark_hvd 2-rank efficiency across jobs "
                 f"{eff:.1%} (target >= {TARGET_EFFICIENCY:.0%})")
            if get("ddp2", m, "dist") and get("ddp1", m, "dist"):
                ddp = get("ddp2", m, "dist") / (2 * get("ddp1", m, "dist"))
                line(eff >= ddp, f"{m}: across jobs, spark_hvd {eff:.1%} >= DDP {ddp:.1%}")
        if get("hvd2", m, "ratio"):
            eff = get("hvd2", m, "ratio")
            line(eff >= TARGET_EFFICIENCY, f"{m}: spark_hvd 2-rank efficiency within the job "
                 f"{eff:.1%} (target >= {TARGET_EFFICIENCY:.0%})")
            if get("ddp2", m, "ratio"):
                ddp = get("ddp2", m, "ratio")
                line(eff >= ddp, f"{m}: within the job, spark_hvd {eff:.1%} >= DDP {ddp:.1%}")
        for c in ("hvd1", "hvd1hooks"):
            if get(c, m, "ratio"):
                over = 1 - get(c, m, "ratio")
                line(over <= TARGET_OVERHEAD, f"{m}: DistributedOptimizer overhead at 1 rank "
                     f"({LABEL[c]}) {over:+.1%} (target <= {TARGET_OVERHEAD:.0%})")
    return out


def report(stats, loads, args, rounds, stats_rounds=None):
    configs = list(stats)
    print(f"## Training throughput (samples/s over all ranks; median of {rounds} round(s), "
          f"{args.reps} x {args.steps} steps per twin and job)\n")
    print("| model | " + " | ".join(f"{LABEL[c]} dist | {LABEL[c]} local" for c in configs)
          + " |")
    print("|---" * (2 * len(configs) + 1) + "|")
    for m in args.models:
        print(f"| {m} | " + " | ".join(f"{stats[c][m]['dist']:.0f} | {stats[c][m]['local']:.0f}"
                                       for c in configs) + " |")
    print("\n| model | hvd x2 / 2·hvd x1 | ddp x2 / 2·ddp x1 | no-communication ceiling "
          "(local x2 / 2·local x1) | hvd x2 dist/local | ddp x2 dist/local | hvd x1 overhead | "
          "hvd x1 hooks overhead | ddp x1 overhead |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in args.models:
        def across(a, b):
            if a in stats and b in stats:
                return f"{stats[a][m]['dist'] / (2 * stats[b][m]['dist']):.1%}"
            return "-"

        def within(c, overhead=False):
            if c not in stats:
                return "-"
            r = stats[c][m]["ratio"]
            return f"{1 - r:+.1%}" if overhead else f"{r:.1%}"
        ceiling = "-"
        if "hvd2" in stats and "hvd1" in stats:
            ceiling = f"{stats['hvd2'][m]['local'] / (2 * stats['hvd1'][m]['local']):.1%}"
        print(f"| {m} | {across('hvd2', 'hvd1')} | {across('ddp2', 'ddp1')} | {ceiling} | "
              f"{within('hvd2')} | {within('ddp2')} | {within('hvd1', True)} | "
              f"{within('hvd1hooks', True)} | {within('ddp1', True)} |")
    print("\nRank 0's CPU time per step, ms (all threads of the process, dist / local):\n")
    print("| model | " + " | ".join(LABEL[c] for c in configs) + " |")
    print("|---" * (len(configs) + 1) + "|")
    for m in args.models:
        print(f"| {m} | " + " | ".join(
            f"{stats[c][m]['cpu_dist']:.1f} / {stats[c][m]['cpu_local']:.1f}" for c in configs)
            + " |")
    if rounds > 1:
        print("\nPer round, dist/local within each job (load at the job's start):\n")
        print("| round | " + " | ".join(LABEL[c] for c in configs) + " |")
        print("|---" * (len(configs) + 1) + "|")
        for r in range(rounds):
            cells = []
            for c in configs:
                res = stats_rounds[c][r] if r < len(stats_rounds[c]) else None
                load_at = [a for cc, a, _ in loads if cc == c]
                if res is None:
                    cells.append("-")
                    continue
                ratios = ", ".join(f"{m} {res[m]['dist']['median'] / res[m]['local']['median']:.0%}"
                                   for m in args.models)
                cells.append(f"{ratios} ({load_at[r]:.1f})" if r < len(load_at) else ratios)
            print(f"| {r + 1} | " + " | ".join(cells) + " |")
    lo = [f"{LABEL[c]} {a:.2f}->{b:.2f}" for c, a, b in loads]
    print(f"\nload average (1 min) before->after each job: {', '.join(lo)}\n")
    for line in verdicts(stats, args.models):
        print(line)


if __name__ == "__main__":
    sys.exit(main())
