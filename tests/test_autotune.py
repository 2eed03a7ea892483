"""Autotuning (HOROVOD_AUTOTUNE / --autotune) in real jobs through the launcher: the log has
Horovod's header, one row per sample and the best setting last; every rank runs every step with
the same settings (the worker compares the settings each step's collectives ran with across
ranks); settings the user gave stay fixed; bad values fail with a clear message.
"""

from __future__ import annotations

import csv
import json

import pytest

from conftest import load_timeline, run_job

HEADER = ["hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce",
          "cache_enabled", "cycle_time_ms", "tensor_fusion_threshold", "score"]
SAMPLES = 6
# Warm-up 1 and 6 samples of 3 steps each: 21 steps; 45 leave room for the final setting.
STEPS = 45


def read_log(path):
    with open(path) as f:
        rows = list(csv.reader(f))
    assert rows and rows[0] == HEADER, rows[:1]
    return [[float(v) for v in row] for row in rows[1:]]


def record_of(result):
    line = next(line for line in result.stdout.splitlines() if "RECORD " in line)
    return json.loads(line.split("RECORD ", 1)[1])


def check_job(result, np_):
    assert result.returncode == 0, result.describe()
    for rank in range(np_):
        assert f"OK rank={rank}" in result.stdout, result.describe()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport,np_,spelling", [
    ("shm", 2, "horovod_env"),   # one host: cached allreduces agreed through shared memory
    ("hosts", 3, "launcher"),    # two "hosts": negotiation over TCP
])
def test_samples_logged_and_ranks_switch_together(tmp_path, transport, np_, spelling):
    log = tmp_path / "autotune.csv"
    if spelling == "horovod_env":
        env = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log),
               "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "3",
               "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(SAMPLES)}
        flags = []
    else:
        env = {}
        flags = ["--autotune", "--autotune-log-file", log, "--autotune-warmup-samples", "1",
                 "--autotune-steps-per-sample", "3", "--autotune-bayes-opt-max-samples",
                 SAMPLES, "--autotune-gaussian-process-noise", "0.5"]
    r = run_job(np_, "autotune", STEPS, transport=transport, env=env, launcher_args=flags,
                timeout=50)
    check_job(r, np_)
    rows = read_log(log)
    # One row per sample, then the best setting with its score (as Horovod writes it).
    assert len(rows) == SAMPLES + 1, rows
    best = max(rows[:-1], key=lambda row: row[-1])
    assert rows[-1] == best, rows
    settings = {tuple(row[3:6]) for row in rows[:-1]}
    assert len(settings) >= SAMPLES - 1, rows  # the samples tried different settings
    assert {row[3] for row in rows} <= {0.0, 1.0}
    # The ranks ran the same settings at every step (checked in the worker) and switched once
    # per sample, the last time to the best setting, which they keep.
    record = record_of(r)
    assert record["generations"] == SAMPLES, record
    assert record["tuning_at_end"] is False
    fusion_bytes, cycle_ms, cache = best[5] * 1024 * 1024, best[4], bool(best[3])
    # (the log prints MiB to 6 decimals: equal to within a KiB)
    assert any(abs(f - fusion_bytes) < 1024 and c == cycle_ms and k == cache
               for f, c, k, *_ in record["settings"]), (best, record)


@pytest.mark.timeout(60)
def test_settings_changes_marked_in_the_timeline(tmp_path):
    """Rank 0's timeline has a row "autotune" with an instant event at each change of
    settings, naming them; the last one is the setting kept (tuning=0)."""
    log, timeline = tmp_path / "autotune.csv", tmp_path / "timeline.json"
    r = run_job(2, "autotune", STEPS, transport="shm",
                env={"SPARK_HVD_TIMELINE": str(timeline)},
                launcher_args=["--autotune", "--autotune-log-file", log,
                               "--autotune-warmup-samples", "1", "--autotune-steps-per-sample",
                               "3", "--autotune-bayes-opt-max-samples", SAMPLES], timeout=50)
    check_job(r, 2)
    marks = [name for ph, name in load_timeline(timeline)["autotune"] if ph == "i"]
    assert 1 <= len(marks) <= SAMPLES, marks
    assert all(m.startswith("AUTOTUNE fusion_threshold=") for m in marks), marks
    best = read_log(log)[-1]
    assert f"cycle_time_ms={best[4]:.3f}" in marks[-1] and marks[-1].endswith("tuning=0"), \
        (marks, best)


@pytest.mark.timeout(60)
def test_switches_without_a_hierarchy_not_tuned(tmp_path):
    """Two hosts of one rank each: nothing to do within hosts, so the hierarchical switches are
    not tuned (they stay the dispatcher's choice in every sample); the other settings are."""
    log = tmp_path / "autotune.csv"
    r = run_job(2, "autotune", STEPS, transport="hosts",
                launcher_args=["--autotune", "--autotune-log-file", log,
                               "--autotune-warmup-samples", "1", "--autotune-steps-per-sample",
                               "3", "--autotune-bayes-opt-max-samples", SAMPLES], timeout=50)
    check_job(r, 2)
    rows = read_log(log)
    assert len(rows) == SAMPLES + 1, rows
    assert {(row[0], row[1]) for row in rows} == {(-1.0, -1.0)}, rows
    assert len({tuple(row[3:6]) for row in rows[:-1]}) >= SAMPLES - 1, rows


@pytest.mark.timeout(60)
def test_rank0_hierarchical_settings_apply_to_every_rank():
    """Without autotuning, rank 2 alone is told not to use hierarchical allreduce while the
    others are told to: every rank runs rank 0's setting at every step (the worker compares
    them across ranks and checks every sum), and that is no new generation of settings."""
    r = run_job(4, "autotune", 8, transport="hosts",
                env={"SPARK_HVD_HIERARCHICAL_ALLREDUCE": "1",
                     "ENV_OF_RANK_2": "SPARK_HVD_HIERARCHICAL_ALLREDUCE=0 "
                                      "SPARK_HVD_HIERARCHICAL_ALLGATHER=1"}, timeout=50)
    check_job(r, 4)
    record = record_of(r)
    assert record["generations"] == 0, record
    assert [s[3:5] for s in record["settings"]] == [[1, -1]], record


@pytest.mark.timeout(60)
def test_user_settings_stay_fixed(tmp_path):
    """The fusion threshold and cycle time the user gave are not tuned: every sample has them,
    and every step's collectives ran with them; the response cache is still tuned."""
    log = tmp_path / "autotune.csv"
    r = run_job(2, "autotune", 30, 1024 * 1024, transport="shm",
                env={"SPARK_HVD_AUTOTUNE_LOG": str(log),
                     "SPARK_HVD_AUTOTUNE_WARMUP_SAMPLES": "0",
                     "SPARK_HVD_AUTOTUNE_STEPS_PER_SAMPLE": "2",
                     "SPARK_HVD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "5"},
                launcher_args=["--autotune", "--fusion-threshold-mb", "1", "--cycle-time-ms",
                               "2"], timeout=50)
    check_job(r, 2)
    rows = read_log(log)
    assert len(rows) == 5 + 1, rows
    assert all(row[5] == 1.0 and row[4] == 2.0 for row in rows), rows
    assert {row[3] for row in rows[:-1]} == {0.0, 1.0}, rows


@pytest.mark.timeout(60)
def test_nothing_to_tune_keeps_the_settings(tmp_path):
    """Every tunable setting given: the job runs with them, says so, and writes no rows."""
    log = tmp_path / "autotune.csv"
    r = run_job(2, "autotune", 10, 4096, transport="shm",
                env={"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log),
                     "HOROVOD_FUSION_THRESHOLD": "4096", "HOROVOD_CYCLE_TIME": "1",
                     "HOROVOD_CACHE_CAPACITY": "64"}, timeout=50)
    check_job(r, 2)
    assert read_log(log) == []
    assert "autotune: nothing to tune" in r.stderr, r.describe()
    record = record_of(r)
    assert record["settings"] == [[4096, 1.0, True, -1, -1]]
    assert record["tuning_at_end"] is False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env,flags,message", [
    ({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "0"}, [],
     "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE must be >= 1, got 0"),
    ({"SPARK_HVD_AUTOTUNE": "1", "SPARK_HVD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "lots"}, [],
     "SPARK_HVD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE='lots' is not a number"),
    ({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "/nonexistent/dir/at.csv"}, [],
     "the folder /nonexistent/dir does not exist"),
])
def test_bad_values_fail_at_init(env, flags, message):
    """Every rank checks the values in init(), before connecting (the launcher may stop the
    other ranks as soon as the first one fails, so the test asks for the message once)."""
    r = run_job(2, "autotune", 3, transport="shm", env=env, launcher_args=flags, timeout=50)
    assert r.returncode != 0, r.describe()
    assert any(message in line for rank in range(2) for line in r.lines(rank, "stderr")), \
        r.describe()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag,value,message", [
    ("--autotune-steps-per-sample", "0", "--autotune-steps-per-sample must be >= 1, got 0"),
    ("--autotune-warmup-samples", "-1", "--autotune-warmup-samples must be >= 0, got -1"),
    ("--autotune-gaussian-process-noise", "0", "--autotune-gaussian-process-noise must be > 0"),
])
def test_bad_flags_refused_by_the_launcher(flag, value, message):
    r = run_job(2, "autotune", 3, transport="shm", launcher_args=["--autotune", flag, value],
                timeout=30)
    assert r.returncode == 2, r.describe()
    assert message in r.stderr, r.describe()
