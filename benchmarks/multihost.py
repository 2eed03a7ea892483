#!/usr/bin/env python3
"""Multi-host benchmark: spark_hvd hierarchical vs flat ring vs Open MPI vs gloo on 2 hosts x 2.

    .venv/bin/python benchmarks/multihost.py              # 3 rounds, 15-20 minutes (2 loaded cores)
    .venv/bin/python benchmarks/multihost.py --quick      # a smoke run, 1-2 minutes
    .venv/bin/python benchmarks/multihost.py --rate 1gbit --sizes 16MiB,64MiB --systems hier,flat
    .venv/bin/python benchmarks/multihost.py --train-only --systems hier,gloo --baseline DIR

Needs root and iproute2 (it builds the multi-host bed of tests/multihost/bed.py: two network
namespaces "h0" and "h1" with their own addresses and hostnames on a bridge, sshd in each), and
for the Open MPI column ``mpirun`` and mpi4py. Each host's egress on the bridge is limited to
``--rate`` (tc tbf; default 2gbit), so the wire between the hosts, not the two cores, is the
bottleneck. Every job has 4 ranks, 2 per host, host-major (ranks 0, 1 on h0):

  hier   spark-hvd-run -np 4 -H h0:2,h1:2 -i <bed key>, HOROVOD_HIERARCHICAL_ALLREDUCE=1
  flat   the same with HOROVOD_HIERARCHICAL_ALLREDUCE=0 (one ring over all 4 ranks)
  mpi    mpirun -H h0:2,h1:2 over ssh with the bed key; btl tcp between the hosts, vader (shared
         memory) within one, mpi_yield_when_idle 1 (4 ranks on 2 cores); mpi4py
         comm.Allreduce(IN_PLACE)
  gloo   torch.distributed gloo, ranks started in their host's namespace, rendezvous on h0

In every job each rank first times float32 allreduces of --sizes (correctness check, warm-up, then
repetitions with all ranks meeting at the system's barrier before each op; rank 0's median; the
code is benchmarks/_helpers/allreduce_worker.py's), then the data-parallel training step of
benchmarks/scaling.py's "mlp" (784-1024-1024-1024-10, 11.6 MB of gradients, batch 128 per rank,
one torch thread): spark_hvd's DistributedOptimizer, DDP for gloo, and for MPI one Allreduce of
all gradients packed into one buffer (the fusion Horovod does), samples/s over all ranks. Per
step it also shows rank 0's forward + backward, wait and update times, the CPU time of its
process (and per thread in --json), and the tail: from the moment the last rank has computed its
last gradient to the moment the last rank has them averaged, i.e. the communication backward
did not hide (all ranks share one CLOCK_MONOTONIC on the bed). --train-only skips the
allreduce sizes and times 10 x 5 steps per job; --baseline DIR adds the system "base": the
spark_hvd checkout in DIR (built), hierarchical, for before/after side by side.

The systems run one at a time, --rounds times in rotated order; tables show the median over
rounds. Bus bandwidth = bytes / time * 2(n-1)/n (n = 4). "% of link": bus bandwidth against the
most any allreduce can reach when each host may send --rate: every host must send at least
2(H-1)/H * bytes (H = 2 hosts) across, so the ceiling is rate * (2(n-1)/n) / (2(H-1)/H) = 1.5 x
rate in bytes/s (0.375 GB/s at 2 Gbit/s); a flat ring over host-major ranks crosses with
2(n-1)/n * bytes per host and tops out at 2/3 of it. The end lists issue 23's targets as
PASS/FAIL lines. See benchmarks/README.md, "Multi-host".
"""

import argparse
import datetime
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "_helpers"))
sys.path.insert(0, os.path.join(REPO, "tests", "multihost"))

from machine import host_description, loadavg, source_version  # noqa: E402
from printing import KiB, MiB, fmt_bw, fmt_size, log, parse_size, table  # noqa: E402

NP, HOSTS = 4, 2
SYSTEMS = ("hier", "flat", "mpi", "gloo", "base")
LABEL = {"hier": "hier", "flat": "flat", "mpi": "Open MPI", "gloo": "gloo", "base": "baseline"}
WHAT = {"hier": "spark_hvd, HOROVOD_HIERARCHICAL_ALLREDUCE=1",
        "flat": "spark_hvd, HOROVOD_HIERARCHICAL_ALLREDUCE=0 (flat ring)",
        "mpi": "mpirun, btl tcp + vader, yield when idle", "gloo": "torch.distributed",
        "base": "the --baseline checkout, HOROVOD_HIERARCHICAL_ALLREDUCE=1"}
SPARK_HVD = ("hier", "flat", "base")
DEFAULT_SIZES = [MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
QUICK_SIZES = [MiB, 16 * MiB]

# Targets (issue 23, item 8), ratios of bus bandwidth in the same run, at sizes >= 16 MiB.
TARGET_BIG_BYTES = 16 * MiB
TARGETS = (("flat", 1.3), ("mpi", 1.0), ("gloo", 2.0))
TARGET_TRAIN_VS_GLOO = 1.0  # issue 30: the mlp's training step, samples/s


# ---------------------------------------------------------------------------------------------
# Worker: one rank of one job

def make_system(args):
    import allreduce_worker as aw
    if args.worker in SPARK_HVD:
        return aw.SparkHvd(args)
    if args.worker == "mpi":
        return aw.Mpi(args)

    class MultiHostGloo(aw.Gloo):
        """allreduce_worker's gloo with the rendezvous on the first host's address."""

        def __init__(self, args):  # noqa: the base's __init__ would rendezvous on 127.0.0.1
            import torch
            import torch.distributed as dist
            self.torch, self.dist = torch, dist
            dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}",
                                    rank=args.rank, world_size=args.size,
                                    timeout=datetime.timedelta(seconds=120))
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            self._buf = self._buf_tensor = self._bufs = self._bufs_tensors = None
    return MultiHostGloo(args)


def hierarchical_status():
    """Whether this build implements HOROVOD_HIERARCHICAL_ALLREDUCE (before it did, the
    variable was a "warned, not implemented" one and the 'hier' job ran the flat ring)."""
    from spark_hvd.common import _config
    var = getattr(_config, "HOROVOD_VARIABLES", {}).get("HIERARCHICAL_ALLREDUCE")
    if var is not None and var.status == _config.WARNED:
        return "not implemented in this build: runs the flat ring"
    return "implemented"


def train_stepper(system, kind):
    """The mlp's data-parallel training step for one system, and the per-rank batch."""
    import torch
    import torch.nn.functional as F
    from scaling import build

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, shape, batch = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    reduce_grads = None
    if kind in SPARK_HVD:
        import spark_hvd.torch as hvd
        hvd.init()
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    elif kind == "gloo":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    else:
        params = list(model.parameters())
        packed = torch.zeros(sum(p.numel() for p in params))
        views, offset = [], 0
        for p in params:
            views.append(packed[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        buf, comm, MPI = packed.numpy(), system.comm, system.MPI

        def reduce_grads():
            for v, p in zip(views, params):
                v.copy_(p.grad)
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            packed.div_(system.size)
            for v, p in zip(views, params):
                p.grad.copy_(v)
    g = torch.Generator().manual_seed(system.rank)
    x, y = torch.randn(shape, generator=g), torch.randint(0, 10, (batch,), generator=g)
    clock, cpu = time.perf_counter, time.process_time
    # When the step's last gradient was computed (DDP waits for its allreduces later, inside
    # backward): a hook on every parameter, after the system's own hooks.
    grads_done = [0.0]

    def note_gradient(_):
        grads_done[0] = clock()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(note_gradient)
    # per step: forward + backward, the wait for the gradients, the update, and the CPU time of
    # the whole process (every thread: the engine's, gloo's), all in seconds
    phases = []

    def step():
        c0, t0 = cpu(), clock()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()  # DDP waits for its allreduces in here
        t1 = clock()
        if reduce_grads:
            reduce_grads()
        elif kind in SPARK_HVD:
            opt.synchronize()
        t2 = clock()
        if kind in SPARK_HVD:
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        t3 = clock()
        phases.append((t1 - t0, t2 - t1, t3 - t2, cpu() - c0, t0, grads_done[0], t1, t2, t3))
    return step, batch, phases


def host_bytes_sent():
    """Bytes this host sent to the other over its bridge interface so far (None off the bed)."""
    try:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def thread_cpu():
    """{thread id: (name, CPU ms so far)} for this process's threads (Linux /proc)."""
    out, tick = {}, 1e3 / os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) * tick)  # utime + stime
    return out


def time_training(system, kind, train):
    import allreduce_worker as aw
    step, batch, phases = train_stepper(system, kind)
    for _ in range(train["warmup"]):
        step()
    del phases[:]
    rates = []
    threads0 = thread_cpu()
    for _ in range(train["reps"]):
        system.barrier()
        t0 = time.perf_counter()
        for _ in range(train["steps"]):
            step()
        system.barrier()
        rates.append(system.size * batch * train["steps"] / (time.perf_counter() - t0))
    steps, threads1 = train["reps"] * train["steps"], thread_cpu()
    threads = {}  # CPU ms per step by thread name (the engine's, gloo's, the training thread)
    for tid, (name, t) in threads1.items():
        threads[name] = threads.get(name, 0) + (t - threads0.get(tid, (name, 0))[1]) / steps
    aw.emit(kind="train", system=kind, rank=system.rank, samples_per_s=statistics.median(rates),
            threads_cpu_ms={k: round(v, 2) for k, v in threads.items() if v >= 0.05},
            reps=rates, steps=train["steps"], batch=batch,
            phases_ms=[statistics.median(p[i] for p in phases) * 1e3 for i in range(4)],
            # every timed step's start, last gradient computed, end of backward, end of the
            # wait and end (perf_counter: CLOCK_MONOTONIC, one clock for the bed's hosts, so
            # ranks can be lined up)
            times=[p[4:] for p in phases])


def worker(args):
    import allreduce_worker as aw
    plan = json.loads(args.plan)
    rank = args.rank
    try:
        system = make_system(args)
        rank = system.rank
        meta = system.meta()
        if args.worker in SPARK_HVD:
            meta["hierarchical"] = hierarchical_status()
            meta["HOROVOD_HIERARCHICAL_ALLREDUCE"] = os.environ.get(
                "HOROVOD_HIERARCHICAL_ALLREDUCE")
        aw.emit(kind="meta", system=args.worker, rank=rank, size=system.size,
                hostname=socket.gethostname(), **meta)
        for nbytes, warmup, reps in plan["sizes"]:
            sent = host_bytes_sent()
            aw.time_size(system, int(nbytes), int(warmup), int(reps))
            if rank == 0 and sent is not None:
                # check + warm-up + timed ops, all of this size, left this host meanwhile
                aw.emit(kind="wire", rank=rank, bytes=int(nbytes), ops=1 + int(warmup) + int(reps),
                        sent=host_bytes_sent() - sent)
        if plan.get("train"):
            time_training(system, args.worker, plan["train"])
        system.barrier()
        system.close()
        aw.emit(kind="done", system=args.worker, rank=rank)
        return 0
    except BaseException as e:  # report it machine-readably, then fail
        import traceback
        aw.emit(kind="error", system=args.worker, rank=rank, error=f"{type(e).__name__}: {e}",
                traceback=traceback.format_exc())
        return 1


# ---------------------------------------------------------------------------------------------
# Driver: the bed, one job per system

def job_env(extra=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPARK_HVD_", "HOROVOD_", "OMPI_", "GLOO_"))}
    # A PYTHONPATH given to the benchmark comes first: another checkout of spark_hvd (a branch
    # under test, built) runs in the hier and flat columns.
    given = os.environ.get("PYTHONPATH")
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=given + os.pathsep + REPO if given else REPO)
    env.update(extra or {})
    return env


def commands(system, bed, access, plan_json, args):
    """(list of argv, env, reason to skip or None) for one job of ``system`` on ``bed``."""
    h0, h1 = bed.hosts
    me = [sys.executable, os.path.abspath(__file__), "--worker", system, "--plan", plan_json]
    if system in SPARK_HVD:
        env = job_env({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0" if system == "flat" else "1"})
        if system == "base":
            # Another checkout of spark_hvd (its package and built core), e.g. the commit
            # before a change, run by this script's worker: before/after in one run.
            if not args.baseline:
                return None, None, "no --baseline checkout given"
            env["PYTHONPATH"] = os.path.abspath(args.baseline) + os.pathsep + REPO
        return [[sys.executable, "-m", "spark_hvd.runner", "-np", str(NP), "-H",
                 f"{h0.addr}:2,{h1.addr}:2", "-i", access.identity_file] + me], env, None
    if system == "mpi":
        mpirun = shutil.which("mpirun")
        if not mpirun:
            return None, None, "mpirun not found on PATH (install Open MPI)"
        import importlib.util
        if importlib.util.find_spec("mpi4py") is None:
            return None, None, "mpi4py is not installed in this Python"
        subnet = f"{bed.bridge_addr.rsplit('.', 1)[0]}.0/24"
        ssh = (f"-i {access.identity_file} -o StrictHostKeyChecking=no "
               "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o BatchMode=yes")
        return [[mpirun, "-np", str(NP), "-H", f"{h0.addr}:2,{h1.addr}:2", "--allow-run-as-root",
                 "--oversubscribe", "--bind-to", "none", "--mca", "plm_rsh_args", ssh,
                 "--mca", "btl", "tcp,self,vader", "--mca", "btl_tcp_if_include", subnet,
                 "--mca", "oob_tcp_if_include", subnet,
                 # 4 ranks share the machine's 2 cores, but each host has 2 slots, so Open MPI
                 # does not know it is oversubscribed and busy-polls: 3-10x slower here.
                 "--mca", "mpi_yield_when_idle", "1", *args.mpirun_args,
                 "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "PYTHONUNBUFFERED"] + me],\
            job_env(), None
    if system == "gloo":
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            return None, None, "torch is not installed"
        port = str(random.randint(20000, 40000))  # fresh namespaces: nothing else listens there
        env = job_env({"GLOO_SOCKET_IFNAME": "eth0"})  # the host's bridge interface
        return [bed.hosts[r // 2].exec_argv(
            me + ["--rank", str(r), "--size", str(NP), "--master", h0.addr, "--port", port])
            for r in range(NP)], env, None
    raise ValueError(system)


def run_job(cmds, env, timeout):
    """Runs a job's processes to the end; returns (records, output tail, error or None). A rank
    that dies leaves its peers blocked in a collective: 10 s later the rest is stopped."""
    import allreduce_worker as aw
    lines, procs = [], []
    for cmd in cmds:
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, text=True,
                                      errors="replace", start_new_session=True))
    readers = [threading.Thread(target=lambda p=p: lines.extend(p.stdout), daemon=True)
               for p in procs]
    for t in readers:
        t.start()
    t0, failed_at, error = time.monotonic(), None, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now - t0 > timeout or (failed_at and now - failed_at > 10):
            error = f"timed out after {timeout:.0f} s" if now - t0 > timeout else \
                "a process failed; stopped the others"
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            break
        time.sleep(0.2)
    for p, t in zip(procs, readers):
        p.wait()
        t.join(timeout=5)
    if error is None and any(p.returncode for p in procs):
        error = f"exit status {[p.returncode for p in procs]}"
    records, decoder = [], json.JSONDecoder()
    for line in lines:
        k = line.find(aw.MARK)
        if k >= 0:
            try:
                records.append(decoder.raw_decode(line, k + len(aw.MARK))[0])
            except json.JSONDecodeError:
                pass
    return records, [ln.rstrip() for ln in lines if aw.MARK not in ln][-30:], error


def one_job(system, bed, access, plan, args):
    """One job of ``system``: {meta, hosts, sizes: {bytes: records}, train, errors, load}."""
    cmds, env, skip = commands(system, bed, access, json.dumps(plan, separators=(",", ":")), args)
    if skip:
        return {"skipped": skip}
    log(f"[{system}] starting (load {loadavg()})")
    load0, t0 = loadavg(), time.monotonic()
    records, tail, error = run_job(cmds, env, args.timeout)
    times = {}  # rank -> the training steps' clock readings
    out = {"meta": {}, "hosts": {}, "sizes": {}, "wire": {}, "train": None, "errors": [],
           "load": [load0, loadavg()], "wall_s": time.monotonic() - t0}
    for rec in records:
        kind, rank = rec.get("kind"), rec.get("rank")
        if kind == "meta":
            out["hosts"][rank] = rec.get("hostname")
            if rank == 0:
                out["meta"] = rec
        elif kind == "size":
            out["sizes"].setdefault(rec["bytes"], {})[rank] = rec
            if not rec["correct"]:
                out["errors"].append(f"WRONG RESULT at {fmt_size(rec['bytes'])} on rank {rank}: "
                                     f"{rec['error']}")
            if rank == 0:
                log(f"[{system}] {fmt_size(rec['bytes']):>8}: busbw "
                    f"{fmt_bw(busbw(rec['bytes'], rec['median_s']))} GB/s ({rec['n']} reps)")
        elif kind == "wire":
            out["wire"][rec["bytes"]] = rec["sent"] / (rec["ops"] * rec["bytes"])
        elif kind == "train":
            times[rank] = rec.pop("times", None)
            if rank == 0:
                out["train"] = rec
                log(f"[{system}] mlp step: {rec['samples_per_s']:.0f} samples/s")
        elif kind == "error":
            out["errors"].append(f"rank {rank}: {rec.get('error')}")
    if out["train"] and len(times) == NP and all(times.values()):
        # Per step, from the moment the last rank had all its gradients to the moment the last
        # rank had them averaged: the communication that backward did not hide.
        tails = [max(times[r][k][3] for r in times) - max(times[r][k][1] for r in times)
                 for k in range(min(len(t) for t in times.values()))]
        out["train"]["tail_ms"] = statistics.median(tails) * 1e3
    # Ranks must sit two per host, host-major, or the job measured something else.
    expected = {r: bed.hosts[r // 2].hostname for r in range(NP)}
    if len(out["hosts"]) == NP and out["hosts"] != expected:
        out["errors"].append(f"ranks were placed {out['hosts']}, expected {expected}")
    if error:
        out["errors"].append(error)
    log(f"[{system}] {'FAILED' if out['errors'] else 'done'} in {out['wall_s']:.0f} s")
    if out["errors"]:
        log(f"[{system}] FAILED: {'; '.join(out['errors'])}\n    " + "\n    ".join(tail))
    return out


# ---------------------------------------------------------------------------------------------
# Report

def busbw(nbytes, seconds):
    """Bus bandwidth in GB/s of an allreduce of ``nbytes`` over the NP ranks."""
    return nbytes / seconds * 2 * (NP - 1) / NP / 1e9


def rate_bytes_per_s(rate):
    """tc's rate text ('2gbit', '500mbit') in bytes/s (SI units, as tc reads them)."""
    t = rate.strip().lower()
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if t.endswith(unit):
            return float(t[:-len(unit)]) * scale / 8
    raise argparse.ArgumentTypeError(f"bad rate {rate!r} (examples: 2gbit, 500mbit)")


def link_ceiling(rate):
    """The highest bus bandwidth (GB/s) an allreduce can reach when each host sends ``rate``:
    each host must send 2(H-1)/H of the bytes across."""
    return rate_bytes_per_s(rate) * (2 * (NP - 1) / NP) / (2 * (HOSTS - 1) / HOSTS) / 1e9


def summarize(runs):
    """{system: {"sizes": {bytes: median s over rounds or a failure word}, "train": samples/s}}"""
    out = {}
    for system, jobs in runs.items():
        if jobs and jobs[0].get("skipped"):
            out[system] = {"skipped": jobs[0]["skipped"]}
            continue
        sizes = {}
        for nbytes in sorted({b for j in jobs for b in j["sizes"]}):
            tables = [j["sizes"][nbytes] for j in jobs if nbytes in j["sizes"]]
            if any(not r["correct"] for t in tables for r in t.values()):
                sizes[nbytes] = "WRONG"
            else:
                sizes[nbytes] = statistics.median(t[0]["median_s"] for t in tables if 0 in t)
        trains = [j["train"]["samples_per_s"] for j in jobs if j.get("train")]
        phases = [j["train"]["phases_ms"] + [j["train"].get("tail_ms", float("nan"))]
                  for j in jobs if j.get("train", {}) and j["train"].get("phases_ms")]
        wire = {n: statistics.median(j["wire"][n] for j in jobs if n in j["wire"])
                for n in sizes if any(n in j["wire"] for j in jobs)}
        out[system] = {"sizes": sizes, "wire": wire,
                       "train": statistics.median(trains) if trains else None,
                       "train_rounds": trains,
                       "phases": [statistics.median(p[i] for p in phases) for i in range(5)]
                       if phases else None,
                       "rounds": len(jobs), "errors": [e for j in jobs for e in j["errors"]]}
    return out


def cell(stats, system, nbytes=None):
    """busbw (GB/s) of one system at one size, or None with the reason as the second value."""
    s = stats.get(system)
    if s is None:
        return None, "-"
    if s.get("skipped"):
        return None, "skip"
    t = s["sizes"].get(nbytes)
    if t is None:
        return None, "FAIL"
    if t == "WRONG":
        return None, "WRONG"
    return busbw(nbytes, t), None


def report(stats, runs, plan, args, started):
    systems = [s for s in SYSTEMS if s in stats]
    ceiling = link_ceiling(args.rate)
    out = [f"Multi-host allreduce, {HOSTS} hosts x {NP // HOSTS} ranks (network namespaces on "
           f"one machine), each host's egress limited to {args.rate} (tc tbf), float32, "
           f"{started:%Y-%m-%d %H:%M}; {host_description()}",
           f"Median over {args.rounds} round(s) of rank 0's median per op; bus bandwidth = "
           f"bytes/time*2(n-1)/n; % of link: against {ceiling:.3f} GB/s, the most an allreduce "
           f"can reach when each host sends {args.rate} (a flat ring: {ceiling * 2 / 3:.3f}).",
           ]
    loads = [x for jobs in runs.values() for j in jobs for x in j.get("load", []) if x is not None]
    if loads:
        ncpu = len(os.sched_getaffinity(0))
        out.append(f"1-minute load average at the start/end of each job: {min(loads):.1f}–"
                   f"{max(loads):.1f} on {ncpu} cores" +
                   (" (other processes competed for the CPUs)" if max(loads) > 0.75 * ncpu
                    else ""))
    for s in systems:
        st = stats[s]
        if st.get("skipped"):
            out.append(f"  {LABEL[s]}: {WHAT[s]}, skipped ({st['skipped']})")
            continue
        meta = next((j["meta"] for j in runs[s] if j.get("meta")), {})
        extra = f", hierarchical: {meta['hierarchical']}" if s == "hier" and \
            "hierarchical" in meta else ""
        if s in SPARK_HVD and meta.get("core"):
            extra += f", core {meta['core']}"
        out.append(f"  {LABEL[s]}: {WHAT[s]}, {meta.get('version', '?')}{extra}" +
                   (f"  [FAILED: {'; '.join(st['errors'])}]" if st["errors"] else ""))
    out.append("")
    headers = ["size"] + [f"{LABEL[s]} GB/s" for s in systems]
    ratio_of = [o for o in ("flat", "mpi", "gloo", "base") if o in systems and "hier" in systems]
    headers += [f"hier/{LABEL[o]}" for o in ratio_of]
    headers += [f"{LABEL[s]} % link" for s in systems]
    rows = []
    for nbytes, _, reps in plan["sizes"]:
        bw = {s: cell(stats, s, nbytes) for s in systems}
        row = [f"{fmt_size(nbytes)} x{reps}"]
        row += [fmt_bw(v) if v is not None else why for v, why in bw.values()]
        for o in ratio_of:
            a, b = bw["hier"][0], bw[o][0]
            row.append(f"{a / b:.2f}x" if a and b else "-")
        row += [f"{v / ceiling:.0%}" if v is not None else why for v, why in bw.values()]
        rows.append(row)
    out.append(table(headers, rows, ["l"] + ["r"] * (len(headers) - 1)))
    if any(stats[s].get("wire") for s in systems):
        out += ["", "Bytes h0 sent to h1 per allreduce, in units of the message (its eth0 counter "
                    "over all ops of the size; the least possible is 1.00, a flat ring's 1.50), "
                    f"and h0's egress while timed as a share of {args.rate}: "
                    "below ~95 % the wire is not what limits the system", ""]

        def wire_cell(s, n):
            factor, (bw, _) = stats[s].get("wire", {}).get(n), cell(stats, s, n)
            if factor is None or bw is None:
                return "-"
            egress = bw / (2 * (NP - 1) / NP) * factor * 1e9  # algorithm bytes/s x factor
            return f"{factor:.2f} · {egress / rate_bytes_per_s(args.rate):.0%}"
        rows = [[fmt_size(n)] + [wire_cell(s, n) for s in systems] for n, _, _ in plan["sizes"]]
        out.append(table(["size"] + [LABEL[s] for s in systems], rows,
                         ["l"] + ["r"] * len(systems)))
    if plan.get("train"):
        tr = plan["train"]
        out += ["", f"Training step, scaling.py's mlp (batch 128 per rank, {tr['reps']} x "
                    f"{tr['steps']} steps per job): samples/s over all 4 ranks", ""]
        trains = {s: stats[s].get("train") for s in systems}

        def phase_cells(s):
            ph = stats[s].get("phases")
            return [f"{v:.1f}" for v in ph] if ph else ["-"] * 5
        rows = [[LABEL[s], f"{v:.0f}" if v else cell(stats, s)[1] if stats[s].get("skipped")
                 else "FAIL", f"{NP * 128 / v * 1e3:.0f}" if v else "-",
                 f"{trains['hier'] / v:.2f}x" if v and trains.get("hier") else "-",
                 *phase_cells(s),
                 ", ".join(f"{r:.0f}" for r in stats[s].get("train_rounds") or [])]
                for s, v in trains.items()]
        out.append(table(["system", "samples/s", "step ms", "hier/this", "fwd+bwd ms",
                          "wait ms", "update ms", "CPU ms", "tail ms", "per round"], rows,
                         ["l", "r", "r", "r", "r", "r", "r", "r", "r", "l"]))
        out.append("(rank 0's medians per step: forward and backward, where DDP also waits "
                   "for its allreduces; then the wait for the gradients; then the update; the "
                   "CPU time of all the process's threads. Tail: from the last rank's last "
                   "gradient computed to the last rank's gradients averaged, the communication "
                   "backward did not hide)")
    out += ["", f"Targets (issue 23): hier's bus bandwidth at >= {fmt_size(TARGET_BIG_BYTES)}; "
                "(issue 30) the training step:"]
    verdicts = []
    for nbytes, _, _ in plan["sizes"]:
        if nbytes < TARGET_BIG_BYTES:
            continue
        for other, target in TARGETS:
            if other not in systems or "hier" not in systems:
                continue
            (a, why_a), (b, why_b) = cell(stats, "hier", nbytes), cell(stats, other, nbytes)
            if a is None or b is None:
                word = "SKIP" if a is not None and why_b == "skip" else "FAIL"
                text = f"no result (hier {why_a or 'ok'}, {LABEL[other]} {why_b or 'ok'})"
            else:
                word = "PASS" if a / b >= target else "FAIL"
                text = f"{a / b:.2f}x ({fmt_bw(a)} vs {fmt_bw(b)} GB/s)"
            verdicts.append(word)
            out.append(f"  {word}  {fmt_size(nbytes):>7} hier >= {target:g}x {LABEL[other]}: "
                       f"{text}")
    trains = {s: stats[s].get("train") for s in systems}
    if trains.get("hier") and trains.get("gloo"):
        # Issue 30: the training step at least as fast as DDP over gloo.
        ratio = trains["hier"] / trains["gloo"]
        word = "PASS" if ratio >= TARGET_TRAIN_VS_GLOO else "FAIL"
        verdicts.append(word)
        out.append(f"  {word}  training step hier >= {TARGET_TRAIN_VS_GLOO:g}x gloo (DDP): "
                   f"{ratio:.2f}x ({trains['hier']:.0f} vs {trains['gloo']:.0f} samples/s)")
    out.append(f"  => {verdicts.count('PASS')} PASS, {verdicts.count('FAIL')} FAIL, "
               f"{verdicts.count('SKIP')} SKIP")
    return "\n".join(out), verdicts


# ---------------------------------------------------------------------------------------------

def build_plan(args):
    sizes = []
    for nbytes in [] if args.train_only else args.sizes:
        # 60 reps at 1 MiB falling with sqrt(size) to 5 at 256 MiB (about 1 s each at 2 Gbit/s).
        reps = args.reps or max(5, round(60 * (MiB / nbytes) ** 0.45))
        if args.quick:
            reps = args.reps or 3
        sizes.append([nbytes, 1 if args.quick else 2, reps])
    train = None if args.no_train else (
        {"warmup": 1, "reps": 1, "steps": 2} if args.quick else
        {"warmup": 3, "reps": 10 if args.train_only else 5, "steps": 5})
    return {"sizes": sizes, "train": train}


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Tables (Markdown) on stdout, progress on stderr.")
    p.add_argument("--quick", action="store_true",
                   help=f"sizes {', '.join(fmt_size(s) for s in QUICK_SIZES)}, 3 repetitions, "
                        "a short training run, 1 round: a smoke test")
    p.add_argument("--rate", default="2gbit", help="egress limit of each host (tc tbf rate)")
    p.add_argument("--rounds", type=int, default=0, help="default 3, 1 with --quick")
    p.add_argument("--reps", type=int, default=0, help="repetitions at every size")
    p.add_argument("--sizes", default=None,
                   help="comma-separated sizes (default 1MiB,4MiB,16MiB,64MiB,256MiB)")
    p.add_argument("--systems", default="hier,flat,mpi,gloo",
                   help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--baseline", metavar="DIR",
                   help="also run the spark_hvd checkout in DIR (built) as system 'base' "
                        "(hierarchical), e.g. the commit before a change")
    p.add_argument("--no-train", action="store_true", help="skip the training step")
    p.add_argument("--train-only", action="store_true",
                   help="only the training step (no allreduce sizes), 10 x 5 steps per job")
    p.add_argument("--mpirun-arg", dest="mpirun_args", action="append", default=[],
                   help="extra mpirun argument (repeatable), e.g. --mpirun-arg=--mca ...")
    p.add_argument("--timeout", type=float, default=0,
                   help="seconds one job may run (default 400, 120 with --quick)")
    p.add_argument("--json", metavar="FILE", help="also write every record to FILE")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target FAILs")
    # worker mode
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=NP, help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    args.sizes = sorted({parse_size(x) for x in args.sizes.split(",")}) if args.sizes else \
        list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.timeout = args.timeout or (120 if args.quick else 400)
    link_ceiling(args.rate)  # a bad --rate fails here, before the bed is made
    systems = [s for s in args.systems.split(",") if s]
    if args.baseline and "base" not in systems:
        systems.append("base")
    if not systems or set(systems) - set(SYSTEMS):
        p.error(f"--systems: choose from {','.join(SYSTEMS)}")
    from bed import Bed, unavailable_reason
    reason = unavailable_reason()
    if reason:
        sys.exit(f"cannot make the multi-host bed: {reason}")
    plan, started = build_plan(args), datetime.datetime.now()
    runs = {s: [] for s in systems}
    with Bed(HOSTS, rate=args.rate) as bed:
        access = bed.start_sshd()
        log(f"bed: {', '.join(f'{h.hostname} {h.addr}' for h in bed.hosts)}, {args.rate} each")
        for rnd in range(args.rounds):
            log(f"--- round {rnd + 1} of {args.rounds}")
            for s in systems[rnd % len(systems):] + systems[:rnd % len(systems)]:
                if not (runs[s] and runs[s][0].get("skipped")):
                    runs[s].append(one_job(s, bed, access, plan, args))
    stats = summarize(runs)
    text, verdicts = report(stats, runs, plan, args, started)
    print()
    print(text, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"started": started.isoformat(timespec="seconds"), "rate": args.rate,
                       "host": host_description(), "source": source_version(), "plan": plan,
                       "runs": runs, "verdicts": verdicts}, f, indent=1, default=str)
    if any(st.get("errors") for st in stats.values()):
        return 1
    return 1 if args.strict and "FAIL" in verdicts else 0


if __name__ == "__main__":
    sys.exit(main())
