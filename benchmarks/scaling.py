#!/usr/bin/env python3
"""Data-parallel training throughput: spark_hvd's DistributedOptimizer vs torch DDP (gloo),
and spark_hvd.keras' DistributedOptimizer in Keras 3's ``model.fit``.

    .venv/bin/python benchmarks/scaling.py             # 3 rounds, about 5 minutes on 2 cores
    .venv/bin/python benchmarks/scaling.py --quick     # 1 round, about 1.5 minutes
    .venv/bin/python benchmarks/scaling.py --models mlp --rounds 5 --json /tmp/scaling.json
    .venv/bin/python benchmarks/scaling.py --models keras_mlp      # Keras 3 (TensorFlow)
    python3 benchmarks/scaling.py --device cuda [--quick]           # CUDA: vs DDP over NCCL

Two CPU models, one torch thread per rank, the same per-rank batch at every size (weak
scaling), SGD with momentum:
  cnn  a small CIFAR-style CNN (3 conv + BN, 2 FC; 0.13 M parameters), 32x32 images, batch 32
  mlp  784-1024-1024-1024-10 (2.9 M parameters, 11.6 MB of gradients), batch 128

Jobs, one at a time:
  hvd x1        spark-hvd-run -np 1, DistributedOptimizer (no hooks at size 1, as Horovod)
  hvd x1 hooks  the same as an elastic job (--min-np 1): hooks and allreduces run at size 1 too
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

Keras models (``--models keras_mlp``; Keras 3 on TensorFlow, one intra- and one inter-op thread
per rank, ``jit_compile=False``), the same architecture as the torch model of the same name:
  keras_mlp  784-1024-1024-1024-10, batch 128;   keras_cnn  the cnn above, batch 32
Jobs: keras x1 / keras x2 (spark-hvd-run -np 1 / 2). The twins are compiled Keras models,
"local" with a plain ``keras.optimizers.SGD(0.01, momentum=0.9)`` and "dist" with
``spark_hvd.keras.DistributedOptimizer`` of the same; each repetition is one ``model.fit`` call
on an in-memory ``tf.data`` dataset (one fixed batch, repeated) with ``steps_per_epoch=N+2``.
A callback times steps 1..N (from the start of step 1 to the start of step N+1), so fit's
per-call set-up and tear-down and the first step (where the ranks of the dist twin meet after
the barrier) are excluded, for both twins alike; each rank times itself and the slowest rank's
time counts (the maximum over ranks), as the torch jobs' closing barrier does.

--device cuda (issue 22's recipe): the model "convnet", a 3.3 M-parameter conv net on
MNIST-shaped input (1x28x28; conv 32, conv 64, pool, conv 128, pool, FC 512, FC 10), batch 128
per rank, Adam(lr=1e-4), on rank r's GPU r % (visible GPUs). Jobs: hvd x1, hvd x2
(DistributedOptimizer) and ddp x1, ddp x2 (DistributedDataParallel over torch's NCCL backend).
With more ranks than GPUs (2 ranks sharing one GPU) NCCL refuses duplicate GPUs in one host:
DDP's ranks then get NCCL_HOSTID=<job>-<rank> each and spark_hvd runs with
SPARK_HVD_SHARED_GPU=nccl, with NCCL_SOCKET_IFNAME=lo for both (the same NCCL transport). Each
repetition ends with torch.cuda.synchronize() before the closing barrier. The table gives ms
per step (a step = every rank's batch); the target: hvd x2's step <= 1.1x ddp x2's.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MARK = "@@SCALING "
MODELS = ("cnn", "mlp")  # the default: torch models
CUDA_MODELS = ("convnet",)  # the default with --device cuda
CUDA_CONFIGS = ("hvd1", "hvd2", "ddp1", "ddp2")
KERAS_MODELS = ("keras_mlp", "keras_cnn")
CONFIGS = ("hvd1", "hvd1hooks", "hvd2", "ddp1", "ddp2")  # jobs for torch models
KERAS_CONFIGS = ("keras1", "keras2")  # jobs for Keras models
LABEL = {"hvd1": "hvd x1", "hvd1hooks": "hvd x1 hooks", "hvd2": "hvd x2", "ddp1": "ddp x1",
         "ddp2": "ddp x2", "keras1": "keras x1", "keras2": "keras x2"}
TARGET_EFFICIENCY = 0.90
TARGET_OVERHEAD = 0.05
TARGET_CUDA_STEP_VS_DDP = 1.1  # --device cuda: hvd x2 step time <= 1.1x ddp x2's (issue 22)
sys.path.insert(0, os.path.join(HERE, "_helpers"))
# BENCH_CUDA_DRY_RUN_ON_CPU=1 (see _helpers/allreduce_worker.py): --device cuda's code run end to
# end on CPU tensors (DDP on gloo) by whoever edits it on a machine without a GPU.
from allreduce_worker import CUDA_DRY_RUN, pick_gpu, read_gpu_counters  # noqa: E402
from machine import free_port, loadavg, probe_gpus  # noqa: E402


def is_keras(model):
    return model.startswith("keras_")


def config_models(config, models):
    """The models a job trains: Keras jobs the Keras models, the others the torch ones."""
    return [m for m in models if is_keras(m) == config.startswith("keras")]


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
    if name == "convnet":
        # Issue 22's recipe: 3,309,578 parameters on MNIST-shaped input, batch 128.
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(128 * 7 * 7, 512), nn.ReLU(),
            nn.Linear(512, 10)), (128, 1, 28, 28), 128
    layers, width = [], 784
    for _ in range(3):
        layers += [nn.Linear(width, 1024), nn.ReLU()]
        width = 1024
    return nn.Sequential(*layers, nn.Linear(width, 10)), (128, 784), 128


def worker(args):
    if args.worker == "keras":
        return keras_worker(args)
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    system = args.worker
    cuda = args.device == "cuda"
    device = torch.device("cpu")
    if system == "hvd":
        import spark_hvd.torch as hvd
        hvd.init()
        rank, size, barrier = hvd.rank(), hvd.size(), hvd.barrier
        if cuda:
            device = pick_gpu(torch, hvd.local_rank())
    else:
        import torch.distributed as dist
        backend = "gloo"
        if cuda:
            device = pick_gpu(torch, args.rank)
            backend = "gloo" if CUDA_DRY_RUN else "nccl"
            if args.nccl_hostid:  # ranks share a GPU: a host identity of their own each
                os.environ["NCCL_HOSTID"] = f"{args.nccl_hostid}-{args.rank}"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=args.rank, world_size=args.size)
        rank, size = args.rank, args.size
        barrier = (lambda: dist.barrier(device_ids=[device.index])) \
            if cuda and not CUDA_DRY_RUN else dist.barrier
    sync = (lambda: torch.cuda.synchronize(device)) if cuda and not CUDA_DRY_RUN \
        else (lambda: None)

    results = {}
    for name in args.models.split(","):
        # Twin models: "local" trains with a plain optimizer and never communicates, "dist"
        # with the system's data parallelism; their repetitions alternate, so both see the
        # same machine load.
        steppers = {}
        for kind in ("local", "dist"):
            torch.manual_seed(0)
            model, shape, batch = build(name)
            model = model.to(device)
            if name == "convnet":  # the recipe's optimizer
                opt = torch.optim.Adam(model.parameters(), lr=1e-4)
            else:
                opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            if kind == "dist" and system == "hvd":
                opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            elif kind == "dist":
                from torch.nn.parallel import DistributedDataParallel
                model = DistributedDataParallel(
                    model, device_ids=[device.index] if device.type == "cuda" else None)
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(shape, generator=g).to(device)
            y = torch.randint(0, 10, (batch,), generator=g).to(device)

            def step(model=model, opt=opt, x=x, y=y):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            steppers[kind] = step
            for _ in range(args.warmup):
                step()
            sync()
        rates = {"local": [], "dist": []}
        cpu = {"local": [], "dist": []}
        for rep in range(args.reps):
            for kind in (("local", "dist") if rep % 2 == 0 else ("dist", "local")):
                step = steppers[kind]
                barrier()
                sync()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.steps):
                    step()
                sync()
                c1 = time.process_time()
                barrier()
                rates[kind].append(size * batch * args.steps / (time.perf_counter() - t0))
                cpu[kind].append((c1 - c0) / args.steps * 1e3)
        results[name] = {k: {"median": statistics.median(v), "best": max(v), "reps": v,
                             "cpu_ms_per_step": statistics.median(cpu[k]), "batch": batch}
                         for k, v in rates.items()}
    if rank == 0:
        meta = {"device": str(device)}
        if cuda:
            meta.update(gpu=torch.cuda.get_device_name(device) if device.type == "cuda"
                        else "(dry run on the CPU)",
                        gpus_visible=torch.cuda.device_count(), torch=torch.__version__,
                        SPARK_HVD_SHARED_GPU=os.environ.get("SPARK_HVD_SHARED_GPU"),
                        NCCL_HOSTID=os.environ.get("NCCL_HOSTID"))
            if system == "hvd":
                meta["gpu_counters"] = read_gpu_counters()
        print(MARK + json.dumps({"size": size, "results": results, "meta": meta}), flush=True)
    if system == "hvd":
        hvd.shutdown()
    else:
        dist.destroy_process_group()



def build_keras(name):
    """The Keras twin of the torch model ``name[len("keras_"):]`` (same layers and sizes)."""
    import keras
    from keras import layers

    if name == "keras_cnn":
        def block(filters):
            return [layers.Conv2D(filters, 3, padding="same"), layers.BatchNormalization(),
                    layers.ReLU()]
        return keras.Sequential(
            [keras.Input((32, 32, 3))] + block(32) + [layers.MaxPooling2D(2)] + block(64)
            + [layers.MaxPooling2D(2)] + block(96)
            + [layers.GlobalAveragePooling2D(), layers.Dense(128, activation="relu"),
               layers.Dense(10)]), (32, 32, 32, 3), 32
    if name != "keras_mlp":
        raise SystemExit(f"unknown Keras model {name!r}; choose from {', '.join(KERAS_MODELS)}")
    return keras.Sequential(
        [keras.Input((784,))] + [layers.Dense(1024, activation="relu") for _ in range(3)]
        + [layers.Dense(10)]), (128, 784), 128


def keras_worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import spark_hvd.keras as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    n = args.steps

    class StepTimer(keras.callbacks.Callback):
        """Times steps 1..n of a fit of n + 2 steps (batch-begin hooks only, so Keras keeps
        dispatching its end-of-batch work asynchronously, as in a plain fit)."""

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 1:
                self.t0, self.c0 = time.perf_counter(), time.process_time()
            elif batch == n + 1:
                self.t1, self.c1 = time.perf_counter(), time.process_time()

    results = {}
    for name in args.models.split(","):
        fits = {}
        for kind in ("local", "dist"):
            keras.utils.set_random_seed(0)
            model, shape, batch = build_keras(name)
            opt = keras.optimizers.SGD(0.01, momentum=0.9)
            if kind == "dist":
                opt = hvd.DistributedOptimizer(opt)
            model.compile(optimizer=opt, jit_compile=False,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            if kind == "dist":
                hvd.broadcast_variables(model.variables, root_rank=0)
            rng = np.random.default_rng(rank)
            x = rng.standard_normal(shape, dtype=np.float32)
            y = rng.integers(0, 10, size=(batch,)).astype(np.int64)
            data = tf.data.Dataset.from_tensors((x, y)).repeat()
            timer = StepTimer()

            def fit(model=model, data=data, timer=timer, steps=n + 2):
                model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[timer])
                return timer.t1 - timer.t0, timer.c1 - timer.c0
            fits[kind] = fit
            model.fit(data, steps_per_epoch=max(args.warmup, 1), epochs=1, verbose=0)
        wall = {"local": [], "dist": []}
        cpu = {"local": [], "dist": []}
        call = {"local": [], "dist": []}
        for rep in range(args.reps):
            for kind in (("local", "dist") if rep % 2 == 0 else ("dist", "local")):
                hvd.barrier()
                t0 = time.perf_counter()
                elapsed, cpu_s = fits[kind]()
                call[kind].append(time.perf_counter() - t0)
                wall[kind].append(elapsed)
                cpu[kind].append(cpu_s / n * 1e3)
        # The slowest rank's time of every repetition (one collective, after the timing).
        slowest = hvd.allreduce(np.array(wall["local"] + wall["dist"]), op=hvd.Max,
                                name=f"scaling.{name}.times").numpy().tolist()
        times = {"local": slowest[:args.reps], "dist": slowest[args.reps:]}
        results[name] = {}
        for kind, ts in times.items():
            rates = [size * batch * n / t for t in ts]
            results[name][kind] = {
                "median": statistics.median(rates), "best": max(rates), "reps": rates,
                "cpu_ms_per_step": statistics.median(cpu[kind]),
                # fit's per-call cost outside the n timed steps (set-up, 2 untimed steps,
                # tear-down), rank 0, ms: reported, not counted
                "fit_call_extra_ms": statistics.median(
                    (c - w) * 1e3 for c, w in zip(call[kind], wall[kind]))}
    if rank == 0:
        print(MARK + json.dumps({"size": size, "results": results}), flush=True)
    hvd.shutdown()


# ---------------------------------------------------------------------------------------------
# Driver

def launcher():
    path = os.path.join(os.path.dirname(sys.executable), "spark-hvd-run")
    return [path] if os.path.exists(path) else [sys.executable, "-m", "spark_hvd.runner"]


def commands(config, args):
    me = [sys.executable, os.path.abspath(__file__), "--models",
          ",".join(config_models(config, args.models)),
          "--warmup", str(args.warmup), "--reps", str(args.reps), "--steps", str(args.steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in list(env):
        if k.startswith(("SPARK_HVD_", "HOROVOD_")):
            del env[k]
    n = 2 if config.endswith("2") else 1
    if args.device == "cuda":
        return cuda_commands(config, n, me + ["--device", "cuda"], env, args)
    if config.startswith("keras"):
        return [launcher() + ["-np", str(n)] + me + ["--worker", "keras"]], env
    if config.startswith("hvd"):
        # An elastic job of one (the launcher makes it one with --min-np): the optimizer keeps
        # its hooks and allreduces at size 1, as Horovod's does in elastic jobs.
        elastic = ["--min-np", "1"] if config == "hvd1hooks" else []
        return [launcher() + ["-np", str(n), *elastic] + me + ["--worker", "hvd"]], env
    port = free_port()
    env["GLOO_SOCKET_IFNAME"] = "lo"
    return [me + ["--worker", "ddp", "--rank", str(r), "--size", str(n), "--port", str(port)]
            for r in range(n)], env


def cuda_commands(config, n, me, env, args):
    """commands() with --device cuda: ranks sharing a GPU use NCCL with a host identity of
    their own each (DDP: NCCL_HOSTID per rank; spark_hvd: SPARK_HVD_SHARED_GPU=nccl)."""
    shared = args.gpu["count"] < n
    if shared:
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if config.startswith("hvd"):
        if shared:
            env["SPARK_HVD_SHARED_GPU"] = "nccl"
        return [launcher() + ["-np", str(n)] + me + ["--worker", "hvd"]], env
    port = free_port()
    extra = ["--nccl-hostid", f"scaling{os.getpid()}-{port}"] if shared else []
    return [me + ["--worker", "ddp", "--rank", str(r), "--size", str(n), "--port", str(port)]
            + extra for r in range(n)], env


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round, fewer repetitions")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the recipe's conv net on CUDA, hvd vs DDP over NCCL")
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (1 with --quick)")
    ap.add_argument("--models", default=None,
                    help=f"default {','.join(MODELS)}; {','.join(CUDA_MODELS)} with --device cuda")
    ap.add_argument("--configs", default=None,
                    help=f"jobs to run (default: {','.join(CONFIGS)} for torch models, "
                         f"{','.join(KERAS_CONFIGS)} for Keras models)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=None,
                    help="timed repetitions of each twin (default 6; 3 with --quick)")
    ap.add_argument("--steps", type=int, default=10, help="steps per repetition")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default=None, help="write every measurement to this file")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target FAILs")
    # worker mode
    ap.add_argument("--worker", choices=("hvd", "ddp", "keras"), help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--nccl-hostid", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if args.models is None:
        args.models = ",".join(CUDA_MODELS if cuda else MODELS)
    if args.reps is None:
        args.reps = 3 if args.quick else 6
    if args.worker:
        return worker(args)
    args.models = [m for m in args.models.split(",") if m]
    args.gpu = None
    if cuda:
        args.gpu = probe_gpus()
        if args.gpu.get("error"):
            print(f"--device cuda: no usable GPU ({args.gpu['error']})", file=sys.stderr)
            return 2
        if any(is_keras(m) for m in args.models):
            ap.error("--device cuda runs torch models only")
    if args.configs is None and cuda:
        configs = list(CUDA_CONFIGS)
    elif args.configs is None:
        configs = (list(CONFIGS) if any(not is_keras(m) for m in args.models) else []) + \
            (list(KERAS_CONFIGS) if any(is_keras(m) for m in args.models) else [])
    else:
        configs = [c for c in args.configs.split(",") if c]
    configs = [c for c in configs if config_models(c, args.models)]
    rounds = args.rounds or (1 if args.quick else 3)

    runs = {c: [] for c in configs}
    last_meta = {}
    loads = []
    for r in range(rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for config in order:
            before = loadavg()
            print(f"[scaling] round {r + 1}/{rounds}: {LABEL[config]} (load {before:.2f})",
                  file=sys.stderr, flush=True)
            record = run_config(config, args)
            runs[config].append(record["results"])
            last_meta[config] = record.get("meta")
            loads.append((config, before, loadavg()))
    stats = summarize(runs, args.models)
    if cuda:
        metas = {c: m for c in configs for m in [last_meta.get(c)] if m}
        cuda_report(stats, metas, args, rounds)
    else:
        report(stats, loads, args, rounds, runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": stats, "runs": runs, "loads": loads, "gpu": args.gpu,
                       "meta": last_meta}, f, indent=1)
    lines = cuda_verdicts(stats, args.models) if cuda else verdicts(stats, args.models)
    failed = any(line.startswith("FAIL") for line in lines)
    return 1 if failed and args.strict else 0


def summarize(runs, models):
    """{config: {model: {dist, local, ratio, cpu_dist, cpu_local}}}: medians over rounds."""
    out = {}
    for config, rounds in runs.items():
        if not rounds:
            continue
        out[config] = {}
        for m in models:
            if m not in rounds[0]:
                continue
            rs = [r[m] for r in rounds]
            out[config][m] = {
                "dist": statistics.median(r["dist"]["median"] for r in rs),
                "local": statistics.median(r["local"]["median"] for r in rs),
                "ratio": statistics.median(r["dist"]["median"] / r["local"]["median"]
                                           for r in rs),
                "cpu_dist": statistics.median(r["dist"]["cpu_ms_per_step"] for r in rs),
                "cpu_local": statistics.median(r["local"]["cpu_ms_per_step"] for r in rs),
            }
            if "batch" in rs[0]["dist"]:
                out[config][m]["batch"] = rs[0]["dist"]["batch"]
            if "fit_call_extra_ms" in rs[0]["dist"]:
                for k in ("dist", "local"):
                    out[config][m][f"fit_extra_{k}"] = statistics.median(
                        r[k]["fit_call_extra_ms"] for r in rs)
    return out


def verdicts(stats, models):
    out = []

    def get(c, m, k):
        return stats.get(c, {}).get(m, {}).get(k)

    def line(ok, text):
        out.append(f"{'PASS' if ok else 'FAIL'} {text}")
    for m in models:
        if is_keras(m):
            one, two, who, rival, overhead = "keras1", "keras2", "spark_hvd.keras", None, \
                ("keras1",)
        else:
            one, two, who, rival, overhead = "hvd1", "hvd2", "spark_hvd", "ddp", \
                ("hvd1", "hvd1hooks")
        if get(two, m, "dist") and get(one, m, "dist"):
            eff = get(two, m, "dist") / (2 * get(one, m, "dist"))
            line(eff >= TARGET_EFFICIENCY, f"{m}: {who} 2-rank efficiency across jobs "
                 f"{eff:.1%} (target >= {TARGET_EFFICIENCY:.0%})")
            if rival and get("ddp2", m, "dist") and get("ddp1", m, "dist"):
                ddp = get("ddp2", m, "dist") / (2 * get("ddp1", m, "dist"))
                line(eff >= ddp, f"{m}: across jobs, spark_hvd {eff:.1%} >= DDP {ddp:.1%}")
        if get(two, m, "ratio"):
            eff = get(two, m, "ratio")
            line(eff >= TARGET_EFFICIENCY, f"{m}: {who} 2-rank efficiency within the job "
                 f"{eff:.1%} (target >= {TARGET_EFFICIENCY:.0%})")
            if rival and get("ddp2", m, "ratio"):
                ddp = get("ddp2", m, "ratio")
                line(eff >= ddp, f"{m}: within the job, spark_hvd {eff:.1%} >= DDP {ddp:.1%}")
        for c in overhead:
            if get(c, m, "ratio"):
                over = 1 - get(c, m, "ratio")
                line(over <= TARGET_OVERHEAD, f"{m}: DistributedOptimizer overhead at 1 rank "
                     f"({LABEL[c]}) {over:+.1%} (target <= {TARGET_OVERHEAD:.0%})")
    return out


def step_ms(stats, config, model, kind="dist"):
    """Milliseconds per step (every rank's batch) from a job's samples/s, or None."""
    entry = stats.get(config, {}).get(model)
    if not entry:
        return None
    n = 2 if config.endswith("2") else 1
    return n * entry["batch"] / entry[kind] * 1e3


def cuda_verdicts(stats, models):
    out = []
    for m in models:
        hvd2, ddp2 = step_ms(stats, "hvd2", m), step_ms(stats, "ddp2", m)
        if hvd2 and ddp2:
            ok = hvd2 <= TARGET_CUDA_STEP_VS_DDP * ddp2
            out.append(f"{'PASS' if ok else 'FAIL'} {m}: hvd x2 step {hvd2:.2f} ms = "
                       f"{hvd2 / ddp2:.2f}x ddp x2's {ddp2:.2f} ms (target <= "
                       f"{TARGET_CUDA_STEP_VS_DDP:g}x)")
        else:
            out.append(f"SKIP {m}: hvd x2 / ddp x2 step: a job did not run")
    return out


def cuda_report(stats, metas, args, rounds):
    configs = list(stats)
    gpu = args.gpu
    any_meta = next(iter(metas.values()), {}) or {}
    print(f"## Training step on CUDA: {gpu['name']} ({gpu['count']} visible; 2-rank jobs "
          + ("share cuda:0" if gpu["count"] < 2 else "one GPU per rank")
          + f"), torch {any_meta.get('torch', gpu.get('torch'))}; median of {rounds} "
          f"round(s), {args.reps} x {args.steps} steps per twin and job\n")
    print("ms per step (a step = every rank's batch; dist = the system's data parallelism, "
          "local = the same processes without communication):\n")
    print("| model | " + " | ".join(f"{LABEL[c]} dist | {LABEL[c]} local" for c in configs)
          + " | hvd x2 / ddp x2 | hvd x1 / ddp x1 |")
    print("|---" * (2 * len(configs) + 3) + "|")
    for m in args.models:
        cells = []
        for c in configs:
            d, loc = step_ms(stats, c, m), step_ms(stats, c, m, "local")
            cells.append(f"{d:.2f} | {loc:.2f}" if d else "- | -")
        ratios = []
        for a, b in (("hvd2", "ddp2"), ("hvd1", "ddp1")):
            x, y = step_ms(stats, a, m), step_ms(stats, b, m)
            ratios.append(f"{x / y:.2f}x" if x and y else "-")
        print(f"| {m} | " + " | ".join(cells + ratios) + " |")
    print()
    for c in configs:
        meta = metas.get(c) or {}
        extra = ""
        if c.startswith("hvd"):
            counters = meta.get("gpu_counters") or {}
            extra = (f"; SPARK_HVD_SHARED_GPU={meta.get('SPARK_HVD_SHARED_GPU') or '(unset)'}"
                     f"; gpu_counters at the end: {counters}")
            if counters.get("host_staged_bytes"):
                extra += "  [CUDA tensors were copied through host memory: NOT the NCCL path]"
        elif meta.get("NCCL_HOSTID"):
            extra = "; NCCL_HOSTID per rank"
        print(f"- {LABEL[c]}: {meta.get('gpu', '?')} ({meta.get('device', '?')}){extra}")
    print()
    for line in cuda_verdicts(stats, args.models):
        print(line)


def report(stats, loads, args, rounds, stats_rounds=None):
    configs = list(stats)

    def has(c, m):
        return m in stats.get(c, {})
    print(f"## Training throughput (samples/s over all ranks; median of {rounds} round(s), "
          f"{args.reps} x {args.steps} steps per twin and job)\n")
    print("| model | " + " | ".join(f"{LABEL[c]} dist | {LABEL[c]} local" for c in configs)
          + " |")
    print("|---" * (2 * len(configs) + 1) + "|")
    for m in args.models:
        print(f"| {m} | " + " | ".join(f"{stats[c][m]['dist']:.0f} | {stats[c][m]['local']:.0f}"
                                       if has(c, m) else "- | -" for c in configs) + " |")

    def across(m, a, b):
        if has(a, m) and has(b, m):
            return f"{stats[a][m]['dist'] / (2 * stats[b][m]['dist']):.1%}"
        return "-"

    def within(m, c, overhead=False):
        if not has(c, m):
            return "-"
        r = stats[c][m]["ratio"]
        return f"{1 - r:+.1%}" if overhead else f"{r:.1%}"

    def ceiling(m, two, one):
        if has(two, m) and has(one, m):
            return f"{stats[two][m]['local'] / (2 * stats[one][m]['local']):.1%}"
        return "-"
    torch_models = [m for m in args.models if not is_keras(m)]
    keras_models = [m for m in args.models if is_keras(m)]
    if torch_models:
        print("\n| model | hvd x2 / 2·hvd x1 | ddp x2 / 2·ddp x1 | no-communication ceiling "
              "(local x2 / 2·local x1) | hvd x2 dist/local | ddp x2 dist/local | hvd x1 "
              "overhead | hvd x1 hooks overhead | ddp x1 overhead |")
        print("|---|---|---|---|---|---|---|---|---|")
    for m in torch_models:
        print(f"| {m} | {across(m, 'hvd2', 'hvd1')} | {across(m, 'ddp2', 'ddp1')} | "
              f"{ceiling(m, 'hvd2', 'hvd1')} | {within(m, 'hvd2')} | {within(m, 'ddp2')} | "
              f"{within(m, 'hvd1', True)} | {within(m, 'hvd1hooks', True)} | "
              f"{within(m, 'ddp1', True)} |")
    if keras_models:
        print("\n| model | keras x2 / 2·keras x1 | no-communication ceiling (local x2 / 2·local "
              "x1) | keras x2 dist/local | keras x1 overhead | fit's extra ms per call, x1 / "
              "x2 (dist; not timed) |")
        print("|---|---|---|---|---|---|")
    for m in keras_models:
        extra = " / ".join(f"{stats[c][m]['fit_extra_dist']:.0f}" if has(c, m) else "-"
                           for c in ("keras1", "keras2"))
        print(f"| {m} | {across(m, 'keras2', 'keras1')} | {ceiling(m, 'keras2', 'keras1')} | "
              f"{within(m, 'keras2')} | {within(m, 'keras1', True)} | {extra} |")
    print("\nRank 0's CPU time per step, ms (all threads of the process, dist / local):\n")
    print("| model | " + " | ".join(LABEL[c] for c in configs) + " |")
    print("|---" * (len(configs) + 1) + "|")
    for m in args.models:
        print(f"| {m} | " + " | ".join(
            f"{stats[c][m]['cpu_dist']:.1f} / {stats[c][m]['cpu_local']:.1f}" if has(c, m)
            else "-" for c in configs) + " |")
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
                                   for m in args.models if m in res)
                cells.append(f"{ratios} ({load_at[r]:.1f})" if r < len(load_at) else ratios)
            print(f"| {r + 1} | " + " | ".join(cells) + " |")
    lo = [f"{LABEL[c]} {a:.2f}->{b:.2f}" for c, a, b in loads]
    print(f"\nload average (1 min) before->after each job: {', '.join(lo)}\n")
    for line in verdicts(stats, args.models):
        print(line)


if __name__ == "__main__":
    sys.exit(main())
