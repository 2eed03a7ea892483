"""Autotuning between the bed's hosts (2 network namespaces x 2 ranks, started by
``spark-hvd-run`` over ssh): the job spans hosts, so the hierarchical switches are tuned too
(both values of each are tried, and every rank runs every step with the same settings), and a
switch the user gave stays fixed. Whether autotune finds a setting as good as a grid search's:
benchmarks/autotune.py on the same bed (benchmarks/README.md, Autotune)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from launcher_job import host_list, launch

PY = sys.executable
WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "autotune.py")
SAMPLES = 6
STEPS = 45  # warm-up 1 + 6 samples of 3 steps, then the final setting



def _autotune_job(bed2_2gbit_sshd, tmp_path, *flags):
    bed, access = bed2_2gbit_sshd
    log = tmp_path / "autotune.csv"
    done = launch(["-np", "4", "-H", host_list(bed.hosts, 2), "-i", access.identity_file,
                   "--start-timeout", "30", "--autotune", "--autotune-log-file", str(log),
                   "--autotune-warmup-samples", "1", "--autotune-steps-per-sample", "3",
                   "--autotune-bayes-opt-max-samples", str(SAMPLES), *flags,
                   PY, WORKER, str(STEPS)], timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(4):  # each rank checked the sums and that all ranks ran the same settings
        assert f"[{rank}]<stdout>: OK rank={rank}" in done.stdout, done.stdout + done.stderr
    with open(log) as f:
        rows = list(csv.DictReader(f))
    line = next(x for x in done.stdout.splitlines() if "RECORD " in x)
    return rows, json.loads(line.split("RECORD ", 1)[1])


@pytest.mark.timeout(120)
def test_hierarchical_switches_tuned_across_hosts(bed2_2gbit_sshd, tmp_path):
    rows, record = _autotune_job(bed2_2gbit_sshd, tmp_path)
    assert len(rows) == SAMPLES + 1, rows
    samples = rows[:-1]
    for column in ("hierarchical_allreduce", "hierarchical_allgather"):
        # The first sample is the dispatcher's own choice (-1), then both forced values.
        assert samples[0][column] == "-1", rows
        assert {r[column] for r in samples[1:]} == {"0", "1"}, rows
    assert record["generations"] == SAMPLES and record["tuning_at_end"] is False, record
    assert len({tuple(s[3:5]) for s in record["settings"]}) >= 2, record  # switched for real


@pytest.mark.timeout(120)
def test_hierarchical_switch_given_stays_fixed(bed2_2gbit_sshd, tmp_path):
    rows, record = _autotune_job(bed2_2gbit_sshd, tmp_path, "--hierarchical-allreduce")
    assert len(rows) == SAMPLES + 1, rows
    assert {r["hierarchical_allreduce"] for r in rows} == {"1"}, rows
    assert {r["hierarchical_allgather"] for r in rows[1:-1]} == {"0", "1"}, rows
    assert {s[3] for s in record["settings"]} == {1}, record
