"""benchmarks/multihost.py --quick runs on its own bed and prints every column with a number:
each of the four systems ran 4 ranks on 2 hosts, got correct sums, and trained the mlp; the flat
ring sent 1.5x the message across per allreduce, and the hierarchical one (where this build has
it) the least possible, 1x."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYSTEMS = ["hier", "flat", "Open MPI", "gloo"]


def test_quick_benchmark_prints_every_column():
    done = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "multihost.py"),
                           "--quick"], capture_output=True, text=True, timeout=280, cwd=REPO)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    out = done.stdout
    # Open MPI may be absent from a machine: then its cells say why ("skip"), nothing else may.
    missing_ok = {"Open MPI"} if shutil.which("mpirun") is None else set()
    header = next(line for line in out.splitlines() if line.startswith("| size"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    expected = ([f"{s} GB/s" for s in SYSTEMS] + [f"hier/{s}" for s in SYSTEMS[1:]]
                + [f"{s} % link" for s in SYSTEMS])
    assert cells[1:] == expected, header
    for size in ("1 MiB", "16 MiB"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {size} "))
        values = dict(zip(cells, (c.strip() for c in row.strip("|").split("|"))))
        for s in SYSTEMS:
            if s in missing_ok:
                assert values[f"{s} GB/s"] == "skip", row
                continue
            assert float(values[f"{s} GB/s"]) > 0, row
            assert re.fullmatch(r"\d+%", values[f"{s} % link"]), row
    for s in SYSTEMS:
        if s not in missing_ok:
            assert re.search(rf"^\| {re.escape(s)} +\| +\d+ \| +\d+ \|", out, re.M), \
                f"no training result for {s}:\n{out}"
    assert re.search(r"=> \d+ PASS, \d+ FAIL, \d+ SKIP", out), out
    wire = out[out.index("Bytes h0 sent"):]
    for size in ("1 MiB", "16 MiB"):
        row = next(line for line in wire.splitlines() if line.startswith(f"| {size} "))
        hier, flat = (float(c.split()[0]) for c in row.strip("|").split("|")[1:3])
        assert 1.45 <= flat <= 1.6, row
        if "hierarchical: implemented" in out:
            assert 0.95 <= hier <= 1.1, row
