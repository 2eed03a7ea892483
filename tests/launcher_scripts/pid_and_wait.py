"""Writes its pid (and its child's) to DIR, then either fails or waits forever.

usage: pid_and_wait.py DIR [--fail-rank R --code C] [--ignore-term] [--child]
The failing rank first waits until every rank has written its pid file, so the test knows
which processes must be gone afterwards.
"""
import argparse
import os
import signal
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("dir")
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--code", type=int, default=3)
p.add_argument("--ignore-term", action="store_true")
p.add_argument("--child", action="store_true")
args = p.parse_args()

rank = int(os.environ["SPARK_HVD_RANK"])
size = int(os.environ["SPARK_HVD_SIZE"])
if args.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
pids = [os.getpid()]
if args.child:
    # A grandchild of the launcher in the rank's process group: must die with the rank.
    pids.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"]).pid)
tmp = os.path.join(args.dir, f"{rank}.tmp")
with open(tmp, "w") as f:
    f.write(" ".join(map(str, pids)))
os.rename(tmp, os.path.join(args.dir, f"{rank}.pid"))
print(f"rank {rank} ready", flush=True)

if rank == args.fail_rank:
    while len([n for n in os.listdir(args.dir) if n.endswith(".pid")]) < size:
        time.sleep(0.02)
    print(f"rank {rank} failing with {args.code}", file=sys.stderr, flush=True)
    sys.exit(args.code)
while True:
    time.sleep(1000)
