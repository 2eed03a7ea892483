#!/usr/bin/env python3
"""Allreduce benchmark: spark_hvd vs torch.distributed (gloo) vs OpenMPI (mpi4py), side by side.

    .venv/bin/python benchmarks/allreduce.py            # full run (4-6 minutes)
    .venv/bin/python benchmarks/allreduce.py --quick    # about a minute, fewer repetitions
    .venv/bin/python benchmarks/allreduce.py --systems spark_hvd,mpi --sizes 4B,16MiB
    python3 benchmarks/allreduce.py --device cuda [--quick]   # CUDA tensors: vs torch NCCL

Each system runs on its own (never two at once) as 2 processes on this host:
  spark_hvd  spark-hvd-run -np 2 ...; hvd.allreduce_(arr, op=hvd.Sum, name=...) on float32
  gloo       2 subprocesses; torch.distributed.all_reduce on a CPU float32 tensor (tcp://127.0.0.1)
  mpi        mpirun -np 2 ...; comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM) (skipped without
             mpirun or mpi4py)

For every size: one correctness check (a rank- and position-dependent pattern must sum exactly),
warm-up, then repetitions; before each repetition all ranks meet at the system's own barrier, and
each op is timed alone. Reported: rank 0's median. Bus bandwidth = bytes / time * 2(n-1)/n.
The whole set runs --rounds times (default 3), in rotated order; per size, each system's best
round is shown (the machine may be shared and noisy).
Then the "gradient set": 200 tensors of 16 KiB per step, all submitted asynchronously and then
waited for (spark_hvd allreduce_async_ + synchronize, MPI Iallreduce + Waitall, gloo
all_reduce(async_op=True) + wait; gloo one by one too); median step time.
The end lists the targets of issue 2 as PASS/FAIL lines. See benchmarks/README.md.

--device cuda: float32 CUDA tensors (rank r on GPU r % the visible GPUs), side by side:
  spark_hvd  spark-hvd-run -np 2 ...; spark_hvd.torch's hvd.allreduce_(t, op=hvd.Sum, name=...)
  nccl       2 subprocesses; torch.distributed.all_reduce with the NCCL backend
  gloo       2 subprocesses; torch.distributed.all_reduce with gloo on the CUDA tensors
When the ranks share a GPU (one GPU, 2 ranks) NCCL refuses duplicate GPUs within a host: torch's
ranks then get NCCL_HOSTID=<job>-<rank> each and spark_hvd runs with SPARK_HVD_SHARED_GPU=nccl
(the core gives each rank its own NCCL host identity), with NCCL_SOCKET_IFNAME=lo for both, so
both use the same NCCL transport; the transport NCCL picked (NCCL_DEBUG=INFO, subsystems
INIT,NET, unless NCCL_DEBUG is set) is printed per system. A timed repetition is --cuda-batch
back-to-back ops (sizes up to 1 MiB; one op above) ended by torch.cuda.synchronize(), as
nccl-tests times them; latency = elapsed / ops. Targets (issue 22): busbw >= 0.95x torch NCCL
at >= 16 MiB, 4 B latency <= 1.5x torch NCCL, and no CUDA tensor copied through host memory
(spark_hvd.common.gpu_counters()["host_staged_bytes"] stays 0).
"""

import argparse
import collections
import datetime
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_helpers", "allreduce_worker.py")
sys.path.insert(0, os.path.join(HERE, "_helpers"))

from machine import free_port, host_description, loadavg, probe_gpus, source_version  # noqa: E402
from printing import KiB, MiB, fmt_bw, fmt_size, log, parse_size, table  # noqa: E402

MARK = "@@BENCH "
NP = 2

DEFAULT_SIZES = [4, 64, KiB, 16 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
SYSTEM_ORDER = ["spark_hvd", "spark_hvd_base", "gloo", "mpi"]
CUDA_SYSTEM_ORDER = ["spark_hvd", "spark_hvd_base", "nccl", "gloo"]
LABEL = {"spark_hvd": "spark_hvd", "spark_hvd_base": "baseline", "gloo": "gloo", "mpi": "MPI",
         "nccl": "torch NCCL"}

# Targets (issue 2, "Benchmark"): ratios measured in the same run.
TARGET_BIG_BYTES = 16 * MiB      # at this size and above:
TARGET_BW_VS_GLOO = 2.0          #   busbw >= 2x gloo's
TARGET_BW_VS_MPI = 1.0           #   busbw >= 1x MPI's
TARGET_SMALL_BYTES = 4           # at 4 B:
TARGET_LAT_VS_GLOO = 0.35        #   latency <= 0.35x gloo's
TARGET_GRAD_VS_MPI = 1.5         # gradient-set step <= 1.5x MPI Iallreduce+Waitall
# Targets with --device cuda (issue 22, point 6): against torch.distributed's NCCL.
TARGET_CUDA_BW_VS_NCCL = 0.95    #   busbw >= 0.95x torch NCCL's at >= TARGET_BIG_BYTES
TARGET_CUDA_LAT_VS_NCCL = 1.5    #   latency <= 1.5x torch NCCL's at TARGET_SMALL_BYTES


# ---------------------------------------------------------------------------------------------
# Plan

def default_reps(nbytes, quick):
    """1000 repetitions up to 16 KiB, then 1000*sqrt(16 KiB/size): 250 at 256 KiB, 31 at
    16 MiB, 10 (the floor) at 256 MiB; a tenth of that (at least 3) with --quick."""
    reps = 1000 * min(1.0, (16 * KiB / nbytes) ** 0.5)
    if quick:
        return max(3, min(100, round(reps / 10)))
    return max(10, min(1000, round(reps)))


def build_plan(args):
    sizes = []
    for nbytes in args.sizes:
        if args.reps:
            reps = args.reps
        else:
            reps = max(1, round(default_reps(nbytes, args.quick) * args.rep_scale))
        warmup = max(1 if args.quick else 2, min(20 if args.quick else 100, reps // 10))
        sizes.append([nbytes, warmup, reps])
    grad = None
    if args.grad_tensors > 0:
        steps = args.grad_steps or (10 if args.quick else 50)
        grad = {"tensors": args.grad_tensors, "elems": args.grad_bytes // 4,
                "warmup": 3 if args.quick else 10, "steps": steps,
                "sync_steps": 0 if args.no_gloo_sync or args.device == "cuda"
                else (3 if args.quick else 10)}
    plan = {"sizes": sizes, "grad": grad, "idle_s": args.idle_cpu}
    if args.device == "cuda":
        plan["cuda_batch"] = args.cuda_batch
    return plan


# ---------------------------------------------------------------------------------------------
# Running one system

def find_launcher():
    exe_dir = os.path.dirname(sys.executable)
    for candidate in (os.path.join(exe_dir, "spark-hvd-run"), shutil.which("spark-hvd-run")):
        if candidate and os.path.exists(candidate):
            return [candidate]
    return [sys.executable, "-m", "spark_hvd.runner"]


def commands_for(system, plan_json, args):
    """(list of argv, env, reason-to-skip or None)."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    worker = [sys.executable, WORKER, "--system", system, "--plan", plan_json]
    if args.device == "cuda":
        return cuda_commands_for(system, worker, env, args)
    if system == "spark_hvd":
        return [find_launcher() + ["-np", str(NP)] + args.hvd_args + worker], env, None
    if system == "spark_hvd_base":
        # Another checkout of spark_hvd (its package and built core), e.g. the commit before a
        # change, run by the same worker: before/after side by side in one run.
        if not args.baseline:
            return None, env, "no --baseline checkout given"
        env["PYTHONPATH"] = args.baseline
        worker[worker.index("--system") + 1] = "spark_hvd"
        return [[sys.executable, "-m", "spark_hvd.runner", "-np", str(NP)] + args.hvd_args +
                worker], env, None
    if system == "gloo":
        try:
            import importlib.util
            if importlib.util.find_spec("torch") is None:
                return None, env, "torch is not installed"
        except (ImportError, ValueError):
            return None, env, "torch is not importable"
        if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
            env["GLOO_SOCKET_IFNAME"] = "lo"  # one host: keep gloo on loopback
        port = str(free_port())
        return [worker + ["--rank", str(r), "--size", str(NP), "--port", port]
                for r in range(NP)], env, None
    if system == "mpi":
        mpirun = shutil.which(args.mpirun) if args.mpirun else shutil.which("mpirun")
        if not mpirun:
            return None, env, (f"{args.mpirun} is not an executable" if args.mpirun else
                               "mpirun not found on PATH (install OpenMPI or pass --mpirun)")
        try:
            import importlib.util
            if importlib.util.find_spec("mpi4py") is None:
                return None, env, "mpi4py is not installed in this Python"
        except (ImportError, ValueError):
            return None, env, "mpi4py is not importable"
        cmd = [mpirun, "-np", str(NP), "--bind-to", "none", "--oversubscribe"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        return [cmd + args.mpirun_args + worker], env, None
    raise ValueError(system)


def cuda_commands_for(system, worker, env, args):
    """commands_for with --device cuda."""
    worker = worker + ["--device", "cuda"]
    shared = args.gpu["count"] < NP
    if "NCCL_DEBUG" not in env:  # which transport NCCL picked, for the report
        env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET")
    if shared:
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if system in ("spark_hvd", "spark_hvd_base"):
        if shared:
            env["SPARK_HVD_SHARED_GPU"] = "nccl"
        launcher = find_launcher()
        if system == "spark_hvd_base":
            if not args.baseline:
                return None, env, "no --baseline checkout given"
            env["PYTHONPATH"] = args.baseline
            worker[worker.index("--system") + 1] = "spark_hvd"
            launcher = [sys.executable, "-m", "spark_hvd.runner"]
        return [launcher + ["-np", str(NP)] + args.hvd_args + worker], env, None
    if system in ("nccl", "gloo"):
        if system == "gloo" and "GLOO_SOCKET_IFNAME" not in env and \
                os.path.exists("/sys/class/net/lo"):
            env["GLOO_SOCKET_IFNAME"] = "lo"
        port = str(free_port())
        extra = ["--nccl-hostid", f"bench{os.getpid()}-{port}"] \
            if system == "nccl" and shared else []
        return [worker + ["--rank", str(r), "--size", str(NP), "--port", port] + extra
                for r in range(NP)], env, None
    return None, env, "not measured with --device cuda"


_NCCL_VIA = re.compile(r"NCCL INFO .*\bvia (\S+)")
_NCCL_NET = re.compile(r"NCCL INFO .*Using network (\S+)")


class Job:
    """Processes of one system, their output streamed line by line into a queue."""

    def __init__(self, cmds, env):
        self.queue = queue.Queue()
        self.procs = []
        for i, cmd in enumerate(cmds):
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env, text=True, bufsize=1,
                                 errors="replace", start_new_session=True)
            self.procs.append(p)
            threading.Thread(target=self._pump, args=(i, p), daemon=True).start()
        self.open_streams = len(self.procs)

    def _pump(self, i, p):
        for line in p.stdout:
            self.queue.put((i, line.rstrip("\n")))
        self.queue.put((i, None))

    def kill(self):
        """Stops the process groups this job started (each process leads its own)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self.procs if p.poll() is None]
            for p in alive:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + 3
            while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
                time.sleep(0.05)


def run_system(system, plan, args):
    result = {"system": system, "meta": {}, "sizes": {}, "grad": {}, "errors": [],
              "skipped": None, "wall_s": None}
    plan_json = json.dumps(plan, separators=(",", ":"))
    cmds, env, skip = commands_for(system, plan_json, args)
    if skip:
        result["skipped"] = skip
        log(f"[{system}] skipped: {skip}")
        return result
    log(f"[{system}] starting: {' '.join(cmds[0][:cmds[0].index('--plan')])} ...")
    result["load"] = [loadavg()]
    t0 = result["_t0"] = time.monotonic()
    try:
        job = Job(cmds, env)
    except OSError as e:
        result["errors"].append(f"could not start {cmds[0][0]}: {e}")
        result["wall_s"] = 0.0
        log(f"[{system}] FAILED: {result['errors'][-1]}")
        return result
    tail = collections.deque(maxlen=40)
    last_progress = time.monotonic()
    first_exit = None
    reason = None
    decoder = json.JSONDecoder()
    while job.open_streams:
        try:
            i, line = job.queue.get(timeout=0.5)
        except queue.Empty:
            line = ""
            i = None
        now = time.monotonic()
        if line is None:
            job.open_streams -= 1
        elif line:
            k = line.find(MARK)
            if k < 0 and "NCCL INFO" in line:  # transport lines (--device cuda), not output
                m = _NCCL_VIA.search(line) or _NCCL_NET.search(line)
                if m:
                    result.setdefault("nccl_transport", set()).add(
                        ("via " if m.re is _NCCL_VIA else "network ") + m.group(1))
            elif k < 0:
                tail.append(line if len(job.procs) == 1 else f"[proc {i}] {line}")
            while k >= 0:
                try:
                    rec, end = decoder.raw_decode(line, k + len(MARK))
                except json.JSONDecodeError:
                    log(f"[{system}] could not parse a result line: {line[k:k + 200]!r}")
                    tail.append(line)
                    break
                last_progress = now
                handle_record(result, rec)
                k = line.find(MARK, end)
        # A dead rank leaves its peers blocked in a collective: give them a moment, then stop.
        if first_exit is None and any(p.poll() not in (None, 0) for p in job.procs):
            first_exit = now
        if first_exit is not None and now - first_exit > 5 and \
                any(p.poll() is None for p in job.procs):
            reason = "a process failed; stopped the others"
            job.kill()
        if now - t0 > args.timeout:
            reason = f"timed out after {args.timeout:.0f} s (--timeout)"
            job.kill()
        elif now - last_progress > args.idle_timeout:
            reason = (f"no result for {args.idle_timeout:.0f} s (hung?) (--idle-timeout)")
            job.kill()
        if reason and all(p.poll() is not None for p in job.procs):
            break
    for p in job.procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            job.kill()
    result["wall_s"] = time.monotonic() - t0
    result["load"].append(loadavg())
    rcs = [p.returncode for p in job.procs]
    done = result.pop("_done", set())
    result.pop("_t0", None)
    if reason:
        result["errors"].append(reason)
    if any(rc != 0 for rc in rcs) or len(done) < NP:
        result["errors"].append(f"exit status {rcs} (negative: killed by that signal); "
                                f"ranks that finished: {sorted(done) or 'none'}")
        result["output_tail"] = list(tail)
    if result["errors"]:
        log(f"[{system}] FAILED after {result['wall_s']:.0f} s: {'; '.join(result['errors'])}")
        if tail:
            log(f"[{system}] last output lines:\n    " + "\n    ".join(tail))
    else:
        log(f"[{system}] done in {result['wall_s']:.0f} s")
    return result


def handle_record(result, rec):
    kind, rank = rec.get("kind"), rec.get("rank")
    system = f"{result['system']} {time.monotonic() - result['_t0']:5.1f}s"
    if kind == "meta":
        result["meta"] = rec
    elif kind == "size":
        entry = result["sizes"].setdefault(rec["bytes"], {})
        entry[rank] = rec
        if not rec["correct"]:
            msg = f"WRONG RESULT at {fmt_size(rec['bytes'])} on rank {rank}: {rec['error']}"
            result["errors"].append(msg)
            log(f"[{system}] {msg}")
        if rank == 0:
            log(f"[{system}] {fmt_size(rec['bytes']):>8}: median {fmt_us(rec['median_s'])} us, "
                f"busbw {fmt_bw(busbw(rec['bytes'], rec['median_s']))} GB/s "
                f"({rec['n']} reps)")
    elif kind == "grad":
        entry = result["grad"].setdefault(rec["variant"], {})
        entry[rank] = rec
        if not rec["correct"]:
            msg = f"WRONG RESULT in gradient set ({rec['variant']}) on rank {rank}: {rec['error']}"
            result["errors"].append(msg)
            log(f"[{system}] {msg}")
        if rank == 0:
            log(f"[{system}] gradient set ({rec['variant']}): median step "
                f"{rec['median_s'] * 1e3:.3f} ms ({rec['n']} steps)")
    elif kind == "idle":
        result.setdefault("idle", []).append(rec["cpu_s"] / rec["seconds"])
        log(f"[{system}] idle rank {rank}: {rec['cpu_s'] / rec['seconds'] * 100:.2f} % of a core "
            f"over {rec['seconds']:g} s")
    elif kind == "final":
        result.setdefault("final", {})[rank] = rec
    elif kind == "error":
        result["errors"].append(f"rank {rank}: {rec.get('error')}")
        tb = rec.get("traceback")
        if tb:
            log(f"[{system}] rank {rank} raised:\n" + tb.rstrip())
    elif kind == "done":
        result.setdefault("_done", set()).add(rank)


def merge_rounds(runs):
    """One result per system from its rounds: for every size (and gradient variant) the round
    whose rank-0 median is lowest; a wrong result or an error in any round is kept."""
    merged = {"system": runs[0]["system"], "meta": {}, "sizes": {}, "grad": {}, "errors": [],
              "skipped": runs[0].get("skipped"), "wall_s": sum(r["wall_s"] or 0 for r in runs),
              "rounds": len(runs), "round_medians": {"sizes": {}, "grad": {}},
              "load": [x for r in runs for x in r.get("load", []) if x is not None],
              "idle": [x for r in runs for x in r.get("idle", [])],
              "nccl_transport": sorted({t for r in runs for t in r.get("nccl_transport", ())}),
              "final": {}}
    cores = []
    for i, run in enumerate(runs):
        merged["meta"] = merged["meta"] or run["meta"]
        merged["final"] = run.get("final") or merged["final"]
        core = run["meta"].get("core")
        if core and core not in cores:
            cores.append(core)
        merged["errors"] += [f"round {i + 1}: {e}" if len(runs) > 1 else e
                             for e in run["errors"]]
    merged["cores"] = cores
    for section in ("sizes", "grad"):
        keys = sorted({k for run in runs for k in run[section]}, key=str)
        for key in keys:
            tables = [run[section][key] for run in runs if key in run[section]]
            wrong = [t for t in tables if not all(r.get("correct") for r in t.values())]
            with_rank0 = [t for t in tables if 0 in t]
            if wrong:
                merged[section][key] = wrong[0]
            elif with_rank0:
                merged[section][key] = min(with_rank0, key=lambda t: t[0]["median_s"])
            else:
                merged[section][key] = tables[0]
            merged["round_medians"][section][key] = [t[0]["median_s"] for t in with_rank0]
    return merged


# ---------------------------------------------------------------------------------------------
# Report

def busbw(nbytes, seconds):
    return nbytes / seconds * 2 * (NP - 1) / NP / 1e9


def fmt_us(seconds):
    us = seconds * 1e6
    if us < 10:
        return f"{us:.2f}"
    if us < 1000:
        return f"{us:.1f}"
    return f"{us:,.0f}"


def fmt_ratio(r):
    return "-" if r is None else (f"{r:.2f}x" if r < 100 else f"{r:.0f}x")


def usable(result, key, variant=None):
    """Rank 0's record for a size (or gradient variant), or None if missing/wrong/failed."""
    if result is None or result.get("skipped"):
        return None
    table = result["grad"].get(variant) if variant else result["sizes"].get(key)
    if not table or 0 not in table:
        return None
    if not all(r.get("correct") for r in table.values()):
        return None
    return table[0]


def cell_missing(result, key=None, variant=None):
    if result is None:
        return "-"
    if result.get("skipped"):
        return "skip"
    table = result["grad"].get(variant) if variant else result["sizes"].get(key)
    if table and not all(r.get("correct") for r in table.values()):
        return "WRONG"
    return "FAIL"


def report(results, plan, args, started):
    cuda = args.device == "cuda"
    systems = [s for s in (CUDA_SYSTEM_ORDER if cuda else SYSTEM_ORDER) if s in results]
    hvd, gloo, mpi = results.get("spark_hvd"), results.get("gloo"), results.get("mpi")
    out = []
    if cuda:
        gpu = args.gpu
        share = (f"both ranks share cuda:0 ({gpu['count']} GPU visible)" if gpu["count"] < NP
                 else f"one GPU per rank ({gpu['count']} visible)")
        out.append(f"Allreduce benchmark, {NP} processes on one host, float32 CUDA tensors on "
                   f"{gpu['name']}, {share}; torch {gpu.get('torch')}, CUDA "
                   f"{gpu.get('cuda')}; {started:%Y-%m-%d %H:%M}, {host_description()}")
        out.append(f"CUDA timing: {args.cuda_batch} back-to-back ops per repetition up to "
                   "1 MiB (one above), then torch.cuda.synchronize(); latency = elapsed / ops.")
    else:
        out.append(f"Allreduce benchmark, {NP} processes on one host, float32, "
                   f"{started:%Y-%m-%d %H:%M}, {host_description()}")
    rounds = max((r.get("rounds", 1) for r in results.values()), default=1)
    out.append(f"Each system ran alone, {rounds} round(s) interleaved; per size the best round's "
               "numbers." if rounds > 1 else "Each system ran alone, one round.")
    loads = [x for r in results.values() for x in r.get("load", [])]
    if loads:
        ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count()
        out.append(f"1-minute load average at the start/end of each system's runs: "
                   f"{min(loads):.1f}–{max(loads):.1f} on {ncpu} cores" +
                   (" (busy: other processes competed for the CPUs; expect noise)"
                    if max(loads) > 0.75 * ncpu else ""))
    out.append("Latency = rank 0's median time per op; busbw = bytes/latency*2(n-1)/n; "
               "ratios: busbw ours/theirs (>1: we are faster), latency ours/theirs (<1: faster).")
    for s in systems:
        r = results[s]
        if r.get("skipped"):
            out.append(f"  {LABEL[s]}: skipped ({r['skipped']})")
        else:
            m = r.get("meta") or {}
            extra = f", shared memory {'on' if m.get('shared_memory') else 'OFF'}" \
                if s.startswith("spark_hvd") and "shared_memory" in m else ""
            if s == "spark_hvd" and args.source:
                extra += f", source {args.source}"
            if s.startswith("spark_hvd") and m.get("core"):
                extra += f", core {m['core']} built {m.get('core_built', '?')}"
            if len(r.get("cores", [])) > 1:
                extra += (f"  [WARNING: the native core was rebuilt during the run "
                          f"({' -> '.join(r['cores'])}): rounds mix versions; run again]")
            if cuda:
                extra += cuda_system_note(s, r)
            out.append(f"  {LABEL[s]}: {m.get('version', '?')}{extra}"
                       + (f"  [FAILED: {'; '.join(r['errors'])}]" if r["errors"] else ""))
    out.append("")

    headers = ["size", "reps"] + [f"{LABEL[s]} µs" for s in systems] + \
              [f"{LABEL[s]} GB/s" for s in systems]
    ratio_cols = []
    refs = [o for o in (("nccl", "gloo") if cuda else ("gloo", "mpi")) if results.get(o)]
    for kind in ("bw", "lat"):
        if hvd:
            ratio_cols += [(f"{kind} vs {LABEL[o]}", o, kind) for o in refs]
    base_ref = "nccl" if cuda else "mpi"
    if results.get("spark_hvd_base") and results.get(base_ref):
        ratio_cols.append((f"baseline lat vs {LABEL[base_ref]}", base_ref, "lat_base"))
    headers += [h for h, _, _ in ratio_cols]
    rows = []
    for nbytes, _, reps in plan["sizes"]:
        recs = {s: usable(results[s], nbytes) for s in systems}
        row = [fmt_size(nbytes), str(reps)]
        row += [fmt_us(recs[s]["median_s"]) if recs[s] else cell_missing(results[s], nbytes)
                for s in systems]
        row += [fmt_bw(busbw(nbytes, recs[s]["median_s"])) if recs[s]
                else cell_missing(results[s], nbytes) for s in systems]
        for _, other, kind in ratio_cols:
            a = recs.get("spark_hvd_base" if kind == "lat_base" else "spark_hvd")
            b = recs.get(other)
            if not (a and b):
                row.append("-")
            elif kind == "bw":
                row.append(fmt_ratio(b["median_s"] / a["median_s"]))
            else:
                row.append(fmt_ratio(a["median_s"] / b["median_s"]))
        rows.append(row)
    out.append(table(headers, rows, ["l"] + ["r"] * (len(headers) - 1)))

    if plan.get("grad"):
        g = plan["grad"]
        out.append("")
        out.append(f"Gradient set: {g['tensors']} tensors of {fmt_size(g['elems'] * 4)} per step, "
                   f"median step time over {g['steps']} steps "
                   + (f"({g['sync_steps']} for gloo one by one) " if g["sync_steps"] else "")
                   + "after warm-up")
        out.append("")
        rows = []
        first = "nccl" if cuda else "mpi"
        mpi_rec = usable(results.get(first), None, "async")
        gloo_rec = usable(gloo, None, "async")
        variants = [("spark_hvd", "async", "allreduce_async_ x N + synchronize"),
                    ("spark_hvd_base", "async", "the same, --baseline checkout"),
                    ("mpi", "async", "Iallreduce x N + Waitall"),
                    ("nccl", "async", "all_reduce(async_op=True) x N + wait"),
                    ("gloo", "async", "all_reduce(async_op=True) x N + wait"),
                    ("gloo", "sync", "all_reduce x N, one by one")]
        for s, variant, how in variants:
            if s not in results or (variant == "sync" and not g["sync_steps"]):
                continue
            rec = usable(results[s], None, variant)
            if rec is None:
                rows.append([LABEL[s], how, cell_missing(results[s], None, variant)] + ["-"] * 4)
                continue
            t = rec["median_s"]
            rows.append([LABEL[s], how, f"{t * 1e3:.3f}",
                         f"{rec['p10_s'] * 1e3:.3f}–{rec['p90_s'] * 1e3:.3f}",
                         f"{t / g['tensors'] * 1e6:.1f}",
                         fmt_ratio(t / mpi_rec["median_s"]) if mpi_rec else "-",
                         fmt_ratio(t / gloo_rec["median_s"]) if gloo_rec else "-"])
        out.append(table(["system", "how", "step ms", "p10–p90 ms", "µs/tensor",
                          f"vs {LABEL[first]}", "vs gloo async"], rows,
                         ["l", "l", "r", "r", "r", "r", "r"]))

    idle = [(s, max(results[s]["idle"])) for s in systems if results[s].get("idle")]
    if idle:
        out.append("")
        out.append(f"Idle initialized rank, nothing in flight: CPU time over {plan['idle_s']:g} s "
                   "(the busiest rank of any round): " +
                   ", ".join(f"{LABEL[s]} {x * 100:.2f} % of a core" for s, x in idle))

    # Targets
    out.append("")
    out.append(f"Targets (issue {22 if cuda else 2}), spark_hvd vs the others in this run:")
    verdicts = []

    def verdict(ok, text):
        word = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
        verdicts.append(word)
        out.append(f"  {word}  {text}")

    def compare(label, ours, theirs, other, passes, describe):
        """ours/theirs: rank-0 records or None. A missing spark_hvd result is a FAIL (it
        should have run); a missing reference is a SKIP."""
        if hvd is None or other not in results:
            verdict(None, f"{label}: {'spark_hvd' if hvd is None else LABEL[other]} "
                          f"not in this run")
        elif ours is None:
            verdict(False, f"{label}: no spark_hvd result")
        elif theirs is None:
            why = results[other]["skipped"] if results.get(other) and \
                results[other].get("skipped") else "not measured"
            verdict(None, f"{label}: {LABEL[other]} {why}")
        else:
            ok, text = passes(ours["median_s"], theirs["median_s"]), describe(ours, theirs)
            verdict(ok, f"{label}: {text}")

    if cuda:
        cuda_targets(results, plan, verdict, compare)
        out.append(f"  => {verdicts.count('PASS')} PASS, {verdicts.count('FAIL')} FAIL, "
                   f"{verdicts.count('SKIP')} SKIP")
        return "\n".join(out), verdicts
    big = [n for n, _, _ in plan["sizes"] if n >= TARGET_BIG_BYTES]
    if not big:
        verdict(None, f"busbw at >= {fmt_size(TARGET_BIG_BYTES)}: no such size in this run")
    for nbytes in big:
        for other, target in (("gloo", TARGET_BW_VS_GLOO), ("mpi", TARGET_BW_VS_MPI)):
            compare(f"{fmt_size(nbytes):>7} busbw >= {target:g}x {LABEL[other]}",
                    usable(hvd, nbytes), usable(results.get(other), nbytes), other,
                    lambda a, b, t=target: b / a >= t,
                    lambda a, b, n=nbytes: f"{b['median_s'] / a['median_s']:.2f}x "
                    f"({fmt_bw(busbw(n, a['median_s']))} vs "
                    f"{fmt_bw(busbw(n, b['median_s']))} GB/s)")
    if TARGET_SMALL_BYTES in [n for n, _, _ in plan["sizes"]]:
        compare(f"{fmt_size(TARGET_SMALL_BYTES):>7} latency <= {TARGET_LAT_VS_GLOO:g}x gloo",
                usable(hvd, TARGET_SMALL_BYTES), usable(gloo, TARGET_SMALL_BYTES), "gloo",
                lambda a, b: a / b <= TARGET_LAT_VS_GLOO,
                lambda a, b: f"{a['median_s'] / b['median_s']:.3f}x "
                f"({fmt_us(a['median_s'])} vs {fmt_us(b['median_s'])} µs)")
    else:
        verdict(None, f"latency at {fmt_size(TARGET_SMALL_BYTES)}: not in this run's sizes")
    if plan.get("grad"):
        compare(f"gradient set step <= {TARGET_GRAD_VS_MPI:g}x MPI Iallreduce+Waitall",
                usable(hvd, None, "async"), usable(mpi, None, "async"), "mpi",
                lambda a, b: a / b <= TARGET_GRAD_VS_MPI,
                lambda a, b: f"{a['median_s'] / b['median_s']:.2f}x "
                f"({a['median_s'] * 1e3:.3f} vs {b['median_s'] * 1e3:.3f} ms)")
    else:
        verdict(None, "gradient set: not run (--grad-tensors 0)")
    out.append(f"  => {verdicts.count('PASS')} PASS, {verdicts.count('FAIL')} FAIL, "
               f"{verdicts.count('SKIP')} SKIP")
    return "\n".join(out), verdicts


def cuda_system_note(system, result):
    """The GPU, the transport NCCL reported and, for spark_hvd, what its GPU counters say."""
    m = result.get("meta") or {}
    parts = []
    if m.get("gpu"):
        parts.append(f"{m['gpu']} ({m.get('device')})")
    if m.get("nccl_version"):
        parts.append(f"NCCL {m['nccl_version']}")
    if m.get("NCCL_HOSTID"):
        parts.append("NCCL_HOSTID per rank")
    if system.startswith("spark_hvd"):
        parts.append(f"SPARK_HVD_SHARED_GPU={m.get('SPARK_HVD_SHARED_GPU') or '(unset)'}, "
                     f"nccl_built={m.get('nccl_built')}")
        staged, nccl = path_counters(result)
        if staged is None:
            parts.append(f"gpu_counters unavailable ({nccl})")
        else:
            parts.append(f"over the run: {nccl} NCCL collectives, {staged} bytes of CUDA "
                         f"tensors copied through host memory"
                         + ("  [NOT the NCCL path]" if staged else ""))
    if system in ("spark_hvd", "spark_hvd_base", "nccl"):
        parts.append("NCCL transport: " + (", ".join(result.get("nccl_transport") or [])
                                           or "not reported (NCCL_DEBUG set by the caller?)"))
    return "; " + "; ".join(parts) if parts else ""


def path_counters(result):
    """(host_staged_bytes, nccl_collectives) rank 0's core counted over the run, or
    (None, why) when the core has no gpu_counters."""
    final = (result.get("final") or {}).get(0) or {}
    after, before = final.get("gpu_counters") or {}, final.get("gpu_counters_before") or {}
    if "host_staged_bytes" not in after:
        return None, after.get("unavailable", "no final record")
    return (after["host_staged_bytes"] - before.get("host_staged_bytes", 0),
            after.get("nccl_collectives", 0) - before.get("nccl_collectives", 0))


def cuda_targets(results, plan, verdict, compare):
    """Issue 22's targets, with --device cuda."""
    hvd, nccl = results.get("spark_hvd"), results.get("nccl")
    big = [n for n, _, _ in plan["sizes"] if n >= TARGET_BIG_BYTES]
    if not big:
        verdict(None, f"busbw at >= {fmt_size(TARGET_BIG_BYTES)}: no such size in this run")
    for nbytes in big:
        compare(f"{fmt_size(nbytes):>7} busbw >= {TARGET_CUDA_BW_VS_NCCL:g}x torch NCCL",
                usable(hvd, nbytes), usable(nccl, nbytes), "nccl",
                lambda a, b: b / a >= TARGET_CUDA_BW_VS_NCCL,
                lambda a, b, n=nbytes: f"{b['median_s'] / a['median_s']:.2f}x "
                f"({fmt_bw(busbw(n, a['median_s']))} vs {fmt_bw(busbw(n, b['median_s']))} GB/s)")
    if TARGET_SMALL_BYTES in [n for n, _, _ in plan["sizes"]]:
        compare(f"{fmt_size(TARGET_SMALL_BYTES):>7} latency <= {TARGET_CUDA_LAT_VS_NCCL:g}x "
                "torch NCCL", usable(hvd, TARGET_SMALL_BYTES), usable(nccl, TARGET_SMALL_BYTES),
                "nccl", lambda a, b: a / b <= TARGET_CUDA_LAT_VS_NCCL,
                lambda a, b: f"{a['median_s'] / b['median_s']:.2f}x "
                f"({fmt_us(a['median_s'])} vs {fmt_us(b['median_s'])} µs)")
    else:
        verdict(None, f"latency at {fmt_size(TARGET_SMALL_BYTES)}: not in this run's sizes")
    if hvd is None or hvd.get("skipped"):
        verdict(None, "no host copy of a CUDA tensor: spark_hvd not in this run")
    else:
        staged, nccl_ops = path_counters(hvd)
        if staged is None:
            verdict(False, f"no host copy of a CUDA tensor: gpu_counters unavailable ({nccl_ops})")
        else:
            verdict(staged == 0 and nccl_ops > 0, f"no host copy of a CUDA tensor: "
                    f"{staged} bytes staged through host memory, {nccl_ops} NCCL collectives "
                    "(rank 0, whole run)")


# ---------------------------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Progress goes to stderr; the tables and verdicts to "
                                       "stdout (Markdown).")
    p.add_argument("--quick", action="store_true",
                   help="a tenth of the repetitions, 1 round, fewer gradient-set steps "
                        "(about 1 minute)")
    p.add_argument("--rounds", type=int, default=0,
                   help="run every system this many times, interleaved, and keep each size's "
                        "best round (default 3, 1 with --quick)")
    p.add_argument("--reps", type=int, default=0,
                   help="the same number of timed repetitions at every size "
                        "(default: 1000 up to 16 KiB falling to 10 at 256 MiB)")
    p.add_argument("--rep-scale", type=float, default=1.0,
                   help="multiply the default repetition counts")
    p.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.replace(",", " ").split()],
                   nargs="+", default=None,
                   help="message sizes, e.g. --sizes 4B 1KiB 16MiB (or comma-separated); "
                        "default: 4 B, 64 B, 1 KiB, 16 KiB, 256 KiB, 1 MiB ... 256 MiB")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default): NumPy arrays and CPU tensors; cuda: CUDA tensors, "
                        "against torch.distributed's NCCL and gloo")
    p.add_argument("--cuda-batch", type=int, default=10, metavar="N",
                   help="--device cuda: back-to-back ops per timed repetition for sizes up to "
                        "1 MiB (default 10; 1 times each op alone)")
    p.add_argument("--systems", default=None,
                   help="comma-separated subset of spark_hvd,gloo,mpi (default: all); with "
                        "--device cuda of spark_hvd,nccl,gloo")
    p.add_argument("--grad-tensors", type=int, default=200,
                   help="tensors per gradient-set step (0: skip the gradient set)")
    p.add_argument("--grad-bytes", type=parse_size, default=16 * KiB,
                   help="bytes per gradient-set tensor (default 16KiB)")
    p.add_argument("--grad-steps", type=int, default=0, help="timed gradient-set steps "
                   "(default 50, 10 with --quick)")
    p.add_argument("--no-gloo-sync", action="store_true",
                   help="skip gloo's one-by-one gradient-set variant")
    p.add_argument("--timeout", type=float, default=0,
                   help="seconds one system may run (default 420, 120 with --quick)")
    p.add_argument("--idle-timeout", type=float, default=120,
                   help="stop a system that reports nothing for this long (default 120)")
    p.add_argument("--mpirun", default=None, help="path to mpirun (default: from PATH)")
    p.add_argument("--mpirun-arg", dest="mpirun_args", action="append", default=[],
                   help="extra mpirun argument (repeatable), e.g. --mpirun-arg=--mca ...")
    p.add_argument("--hvd-arg", dest="hvd_args", action="append", default=[],
                   help="extra spark-hvd-run argument (repeatable), "
                        "e.g. --hvd-arg=--cycle-time-ms=1")
    p.add_argument("--idle-cpu", type=float, default=None, metavar="SECONDS",
                   help="at the end, measure each rank's CPU use while initialized and idle for "
                        "this long (0: skip; default 5, 0 with --device cuda)")
    p.add_argument("--baseline", metavar="DIR",
                   help="also run the spark_hvd checkout in DIR (built) as system "
                        "spark_hvd_base, e.g. the commit before a change")
    p.add_argument("--json", metavar="FILE", help="also write every record to FILE")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target FAILs")
    args = p.parse_args(argv)

    args.sizes = sorted(set(x for group in args.sizes for x in group)) if args.sizes \
        else list(DEFAULT_SIZES)
    if not args.rounds:
        args.rounds = 1 if args.quick else 3
    if not args.timeout:
        args.timeout = 120 if args.quick else 420
    known = CUDA_SYSTEM_ORDER if args.device == "cuda" else SYSTEM_ORDER
    if args.systems is None:
        args.systems = ",".join(known)
    if args.idle_cpu is None:
        args.idle_cpu = 0.0 if args.device == "cuda" else 5.0
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.baseline and "spark_hvd_base" not in systems:
        systems.append("spark_hvd_base")
    unknown = [s for s in systems if s not in known]
    if unknown or not systems:
        p.error(f"--systems: unknown {unknown}; choose from {','.join(known)}")
    if args.reps < 0 or args.rep_scale <= 0 or args.rounds < 1 or args.cuda_batch < 1:
        p.error("--reps, --rep-scale, --rounds and --cuda-batch must be positive")
    args.gpu = None
    if args.device == "cuda":
        args.gpu = probe_gpus()
        if args.gpu.get("error"):
            log(f"--device cuda: no usable GPU ({args.gpu['error']})")
            return 2
        log(f"GPU: {args.gpu['name']} ({args.gpu['count']} visible); ranks "
            + ("share cuda:0: torch NCCL with NCCL_HOSTID per rank, spark_hvd with "
               "SPARK_HVD_SHARED_GPU=nccl" if args.gpu["count"] < NP else "one GPU each"))

    plan = build_plan(args)
    args.source = source_version()
    started = datetime.datetime.now()
    log(f"plan: {len(plan['sizes'])} sizes "
        f"({', '.join(f'{fmt_size(n)}x{r}' for n, _, r in plan['sizes'])}), "
        f"systems {', '.join(systems)}" +
        (f", gradient set {plan['grad']['tensors']} x {fmt_size(plan['grad']['elems'] * 4)}"
         if plan["grad"] else ""))
    rounds = {s: [] for s in systems}
    order = [s for s in known if s in systems]
    for rnd in range(args.rounds):
        if args.rounds > 1:
            log(f"--- round {rnd + 1} of {args.rounds}")
        for s in order[rnd % len(order):] + order[:rnd % len(order)]:  # rotate the order
            if rounds[s] and rounds[s][0].get("skipped"):
                continue
            rounds[s].append(run_system(s, plan, args))
    results = {s: merge_rounds(rounds[s]) for s in order}
    text, verdicts = report(results, plan, args, started)
    print()
    print(text, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"started": started.isoformat(timespec="seconds"),
                       "host": host_description(), "gpu": args.gpu, "device": args.device,
                       "source": args.source, "plan": plan,
                       "results": results, "rounds": rounds, "verdicts": verdicts},
                      f, indent=1,
                      default=lambda o: sorted(o) if isinstance(o, set) else str(o))
        log(f"records written to {args.json}")
    failed = [s for s, r in results.items() if r["errors"]]
    if failed:
        log(f"FAILED: {', '.join(failed)} (see the messages above)")
        return 1
    if args.strict and "FAIL" in verdicts:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
