#!/usr/bin/env python3
"""Elastic training's costs and bounds (issue 31), as medians.

    .venv/bin/python benchmarks/elastic.py                 # 5 repetitions (about 2 minutes)
    .venv/bin/python benchmarks/elastic.py --reps 3 --json out.json --skip commit

Measured, each repetition a fresh ``spark-hvd-run`` job on hosts ``localhost``, ``127.0.0.2``,
``127.0.0.3`` of this machine (TCP between them; NumPy SGD, every step committed, 20 ms/step):

  kill      3 ranks, ``--min-np 2``; one rank SIGKILLs itself mid-training.
            detect: until the survivors' collective failed (their ``State.restore()`` ran);
            resume: until the first step at the new size (reset, re-form, sync included).
  grow      2 ranks; the discovery script starts listing a third host.
            full size: from the write of the host file to the first step on 3 ranks
            (discovery every 1 s, the new process's start and imports, the members'
            interrupt at their next commit, re-form and sync).
  check     ``State.check_host_updates()`` when nothing changed, in a rank of an elastic job:
            ns per call (median of 20 batches of 100 000).
  commit    ``TorchState.commit()`` of a 25 M-parameter torch model (5 x Linear(2236, 2236))
            with SGD momentum buffers, in a 1-rank job: ms per commit (median of 10).

All times of one repetition come from one machine's clock (``time.time()`` in the ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "workers" / "elastic_train.py"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _helpers.machine import host_description, loadavg  # noqa: E402
from _helpers.printing import log, table  # noqa: E402


def launcher():
    exe = Path(sys.executable).parent / "spark-hvd-run"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "spark_hvd.runner"]


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e["PYTHONUNBUFFERED"] = "1"
    e.setdefault("SPARK_HVD_KILL_GRACE_SECONDS", "2")
    return e


def run_job(args, timeout=120):
    done = subprocess.run([*launcher(), *args], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"job failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    return done.stdout


def markers(stdout, word):
    out = []
    for line in stdout.splitlines():
        _, sep, rest = line.partition(f"<stdout>: {word} ")
        if sep:
            out.append(dict(kv.split("=", 1) for kv in rest.split()))
    return out


def measure_kill():
    out = run_job(["-np", "3", "--min-np", "2", "-H", "localhost:1,127.0.0.2:1,127.0.0.3:1",
                   sys.executable, str(WORKER), "--steps", "40", "--sleep", "0.02",
                   "--kill", "127.0.0.2/0/2:15", "--timed"])
    killed = float(markers(out, "KILL")[0]["t"])
    restored = [float(m["t"]) for m in markers(out, "RESTORE")]
    first = min(float(m["t"]) for m in markers(out, "STEP") if m["size"] == "2")
    return {"detect": max(restored) - killed, "resume": first - killed}


def measure_grow():
    with tempfile.TemporaryDirectory() as tmp:
        hosts = Path(tmp) / "hosts"
        hosts.write_text("localhost:1\n127.0.0.2:1\n")
        script = Path(tmp) / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {hosts}\n")
        script.chmod(0o755)
        written = {}

        def add_host():
            hosts.write_text("localhost:1\n127.0.0.2:1\n127.0.0.3:1\n")
            written["t"] = time.time()

        timer = threading.Timer(3.0, add_host)
        timer.start()
        try:
            out = run_job(["-np", "2", "--min-np", "2", "--host-discovery-script", str(script),
                           sys.executable, str(WORKER), "--steps", "10", "--sleep", "0.02",
                           "--grow-to", "3", "--grow-wait", "60"])
        finally:
            timer.cancel()
    first = min(float(m["t"]) for m in markers(out, "STEP") if m["size"] == "3")
    return {"full_size": first - written["t"]}


CHECK_WORKER = """
import time, statistics
import spark_hvd.numpy as hvd
from spark_hvd.common.elastic import ObjectState
hvd.init()
state = ObjectState(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, step=0)
check = state.check_host_updates
per = []
for _ in range(20):
    t = time.perf_counter()
    for _ in range(100000):
        check()
    per.append((time.perf_counter() - t) / 100000 * 1e9)
print(f"CHECK ns={statistics.median(per):.1f}", flush=True)
"""

COMMIT_WORKER = """
import time, statistics, torch
import spark_hvd.torch as hvd
hvd.init()
model = torch.nn.Sequential(*[torch.nn.Linear(2236, 2236) for _ in range(5)])
params = sum(p.numel() for p in model.parameters())
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
model(torch.ones(1, 2236)).sum().backward()
opt.step()  # momentum buffers exist
state = hvd.elastic.TorchState(model, opt, epoch=0)
per = []
for _ in range(10):
    t = time.perf_counter()
    state.commit()
    per.append((time.perf_counter() - t) * 1e3)
print(f"COMMIT ms={statistics.median(per):.1f} params={params}", flush=True)
"""


def measure_check():
    out = run_job(["-np", "2", "--min-np", "2", "-H", "localhost:1,127.0.0.2:1",
                   sys.executable, "-c", CHECK_WORKER])
    return {"check_ns": max(float(m["ns"]) for m in markers(out, "CHECK"))}


def measure_commit():
    out = run_job(["-np", "1", "--min-np", "1", sys.executable, "-c", COMMIT_WORKER],
                  timeout=300)
    m = markers(out, "COMMIT")[0]
    return {"commit_ms": float(m["ms"]), "params": int(m["params"])}


MEASURES = {"kill": measure_kill, "grow": measure_grow, "check": measure_check,
            "commit": measure_commit}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="repetitions of kill and grow")
    p.add_argument("--skip", nargs="*", default=[], choices=list(MEASURES))
    p.add_argument("--json", help="write every repetition's numbers here")
    args = p.parse_args()
    log(f"host: {host_description()}; load {loadavg()}")
    records = {}
    for name, fn in MEASURES.items():
        if name in args.skip:
            continue
        reps = args.reps if name in ("kill", "grow") else 1
        for i in range(reps):
            rec = fn()
            log(f"{name} {i + 1}/{reps}: " + ", ".join(f"{k} {v:.3f}" for k, v in rec.items()))
            for k, v in rec.items():
                records.setdefault(k, []).append(v)
    rows = []
    units = {"detect": ("s", 1), "resume": ("s", 1), "full_size": ("s", 1),
             "check_ns": ("µs", 1e-3), "commit_ms": ("ms", 1)}
    labels = {"detect": "process killed -> survivors' op fails",
              "resume": "process killed -> first step at the new size",
              "full_size": "host back in discovery -> first step at full size",
              "check_ns": "idle check_host_updates()",
              "commit_ms": "TorchState.commit(), 25 M parameters + momentum"}
    for key, label in labels.items():
        if key in records:
            unit, scale = units[key]
            values = [v * scale for v in records[key]]
            rows.append([label, f"{statistics.median(values):.3g} {unit}",
                         f"{min(values):.3g}-{max(values):.3g}", str(len(values))])
    print(table(["measure", "median", "range", "n"], rows, "lrrr"))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
