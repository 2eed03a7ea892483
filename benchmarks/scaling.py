#!/usr/bin/env python3
"""Data-parallel training throughput: spark_hvd's DistributedOptimizer vs torch DDP (gloo).

    .venv/bin/python benchmarks/scaling.py             # 3 rounds, about 4 minutes on 2 cores
    .venv/bin/python benchmarks/scaling.py --quick     # 1 round, about 1.5 minutes
    .venv/bin/python benchmarks/scaling.py --models mlp --rounds 5 --json /tmp/scaling.json

Two CPU models, one torch thread per rank, the same per-rank batch at every size (weak
scaling), SGD with momentum:
  cnn  a small CIFAR-style CNN (3 conv + BN, 2 FC; 0.13 M parameters), 32x32 images, batch 32
  mlp  784-1024-1024-1024-10 (2.9 M parameters, 11.6 MB of gradients), batch 128

Configurations, each a separate job (never two at once):
  plain        1 process, plain torch optimizer (the reference)
  hvd x1       spark-hvd-run -np 1, DistributedOptimizer (no hooks at size 1, as Horovod)
  hvd x1 hooks the same with SPARK_HVD_ELASTIC=1: hooks and allreduces run at size 1 too
  hvd x2       spark-hvd-run -np 2, DistributedOptimizer
  ddp x1/x2    torch DistributedDataParallel over gloo (127.0.0.1), 1 and 2 processes

Every job trains each model for warm-up steps, then times repetitions of N steps (all ranks
meet at a barrier before each repetition; rank 0 times it). A job's throughput is the median of
its repetitions (samples/s over all ranks); each round runs every configuration once, in a
rotated order, and the tables report the median over rounds. Scaling efficiency =
throughput(x2) / (2 x throughput(x1)) of the same system, and also against plain torch; the
DistributedOptimizer overhead at 1 rank = 1 - throughput(hvd x1) / throughput(plain). The 1-minute
load average is printed: above ~1.5 on 2 cores other processes competed for the CPUs.
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
CONFIGS = ("plain", "hvd1", "hvd1hooks", "hvd2", "ddp1", "ddp2")
LABEL = {"plain": "plain x1", "hvd1": "hvd x1", "hvd1hooks": "hvd x1 hooks", "hvd2": "hvd x2",
         "ddp1": "ddp x1", "ddp2": "ddp x2"}
TARGET_EFFICIENCY = 0.90
TARGET_OVERHEAD = 0.05


# ---------------------------------------------------------------------------------------------
# Worker: one rank of one configuration

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
    elif system == "ddp":
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=args.rank, world_size=args.size)
        rank, size, barrier = args.rank, args.size, dist.barrier
    else:
        rank, size, barrier = 0, 1, (lambda: None)

    results = {}
    for name in args.models.split(","):
        torch.manual_seed(0)
        model, shape, batch = build(name)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if system == "hvd":
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        elif system == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            model = DistributedDataParallel(model)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(shape, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)

        def step():
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

        for _ in range(args.warmup):
            step()
        rates, cpu = [], []
        for _ in range(args.reps):
            barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                step()
            c1 = time.process_time()
            barrier()
            rates.append(size * batch * args.steps / (time.perf_counter() - t0))
            cpu.append((c1 - c0) / args.steps * 1e3)
        results[name] = {"median": statistics.median(rates), "best": max(rates), "reps": rates,
                         "cpu_ms_per_step": statistics.median(cpu)}
    if rank == 0:
        print(MARK + json.dumps({"size": size, "results": results}), flush=True)
    if system == "hvd":
        hvd.shutdown()
    elif system == "ddp":
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
    if config == "plain":
        return [me + ["--worker", "plain"]], env
    if config.startswith("hvd"):
        n = 2 if config == "hvd2" else 1
        if config == "hvd1hooks":
            env["SPARK_HVD_ELASTIC"] = "1"
        return [launcher() + ["-np", str(n)] + me + ["--worker", "hvd"]], env
    n = 2 if config == "ddp2" else 1
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
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 7)")
    ap.add_argument("--steps", type=int, default=10, help="steps per repetition")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default=None, help="write every measurement to this file")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target FAILs")
    # worker mode
    ap.add_argument("--worker", choices=("plain", "hvd", "ddp"), help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reps is None:
        args.reps = 4 if args.quick else 7
    if args.worker:
        return worker(args)
    args.models = [m for m in args.models.split(",") if m]
    configs = [c for c in args.configs.split(",") if c]
    rounds = args.rounds or (1 if args.quick else 3)

    data = {c: {m: [] for m in args.models} for c in configs}
    best = {c: {m: [] for m in args.models} for c in configs}
    cpu = {c: {m: [] for m in args.models} for c in configs}
    loads = []
    for r in range(rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for config in order:
            before = load()
            print(f"[scaling] round {r + 1}/{rounds}: {LABEL[config]} (load {before:.2f})",
                  file=sys.stderr, flush=True)
            res = run_config(config, args)
            loads.append((config, before, load()))
            for m in args.models:
                data[config][m].append(res["results"][m]["median"])
                best[config][m].append(res["results"][m]["best"])
                cpu[config][m].append(res["results"][m]["cpu_ms_per_step"])
    med = {c: {m: statistics.median(v) for m, v in d.items()} for c, d in data.items()}
    top = {c: {m: max(v) for m, v in d.items()} for c, d in best.items()}
    cpu_med = {c: {m: statistics.median(v) for m, v in d.items()} for c, d in cpu.items()}
    report(med, top, cpu_med, loads, args, rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"medians": med, "best": top, "cpu_ms_per_step": cpu_med,
                       "rounds": data, "loads": loads}, f, indent=1)
    failed = any(line.startswith("FAIL") for line in verdicts(med, args))
    return 1 if failed and args.strict else 0


def verdicts(med, args):
    out = []
    for m in args.models:
        def get(c):
            return med.get(c, {}).get(m)
        if get("hvd1") and get("hvd2"):
            eff = get("hvd2") / (2 * get("hvd1"))
            out.append(f"{'PASS' if eff >= TARGET_EFFICIENCY else 'FAIL'} {m}: spark_hvd 2-rank "
                       f"scaling efficiency {eff:.1%} (target >= {TARGET_EFFICIENCY:.0%})")
            if get("ddp1") and get("ddp2"):
                ddp = get("ddp2") / (2 * get("ddp1"))
                out.append(f"{'PASS' if eff >= ddp else 'FAIL'} {m}: spark_hvd efficiency "
                           f"{eff:.1%} >= DDP's {ddp:.1%}")
        if get("plain") and get("hvd1"):
            over = 1 - get("hvd1") / get("plain")
            out.append(f"{'PASS' if over <= TARGET_OVERHEAD else 'FAIL'} {m}: "
                       f"DistributedOptimizer overhead at 1 rank {over:+.1%} (target <= "
                       f"{TARGET_OVERHEAD:.0%})")
    return out


def report(med, top, cpu, loads, args, rounds):
    print(f"## Training throughput (samples/s, all ranks; median of {rounds} round(s), "
          f"{args.reps} x {args.steps} steps each)\n")
    configs = list(med)
    print("| model | " + " | ".join(LABEL[c] for c in configs) + " |")
    print("|---" * (len(configs) + 1) + "|")
    for m in args.models:
        print(f"| {m} | " + " | ".join(f"{med[c][m]:.0f}" for c in configs) + " |")
    print("\n| model | efficiency hvd (x2 / 2·x1) | efficiency ddp | hvd x2 vs 2·plain | "
          "ddp x2 vs 2·plain | overhead hvd x1 | overhead hvd x1 hooks |")
    print("|---|---|---|---|---|---|---|")
    for m in args.models:
        def r(a, b, k=1.0):
            if a in med and b in med:
                return f"{med[a][m] / (k * med[b][m]):.1%}"
            return "-"

        def o(a):
            return f"{1 - med[a][m] / med['plain'][m]:+.1%}" if a in med and "plain" in med \
                else "-"
        print(f"| {m} | {r('hvd2', 'hvd1', 2)} | {r('ddp2', 'ddp1', 2)} | "
              f"{r('hvd2', 'plain', 2)} | {r('ddp2', 'plain', 2)} | {o('hvd1')} | "
              f"{o('hvd1hooks')} |")
    print("\nBest repetition of any round (samples/s), and rank 0's CPU time per step (ms, all "
          "threads of the process; less sensitive to other load than wall time):\n")
    print("| model | " + " | ".join(f"{LABEL[c]} best" for c in configs) + " | " +
          " | ".join(f"{LABEL[c]} cpu" for c in configs) + " |")
    print("|---" * (2 * len(configs) + 1) + "|")
    for m in args.models:
        print(f"| {m} | " + " | ".join(f"{top[c][m]:.0f}" for c in configs) + " | " +
              " | ".join(f"{cpu[c][m]:.1f}" for c in configs) + " |")
    lo = [f"{LABEL[c]} {a:.2f}->{b:.2f}" for c, a, b in loads]
    print(f"\nload average (1 min) before->after each job: {', '.join(lo)}\n")
    for line in verdicts(med, args):
        print(line)


if __name__ == "__main__":
    sys.exit(main())
