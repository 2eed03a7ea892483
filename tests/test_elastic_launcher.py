"""Elastic jobs with real processes: ``spark-hvd-run --min-np ...`` and ``spark_hvd.run(...,
min_num_proc=...)`` on hosts ``localhost``, ``127.0.0.2``, ``127.0.0.3`` (distinct hosts to the
launcher: TCP between them). The worker is ``tests/workers/elastic_train.py`` (NumPy SGD,
every step committed; markers ``STEP rank= size= step= t= loss=`` and ``OK ... hash=``)."""

from __future__ import annotations

import re
import sys
import threading
import time

import pytest

import fake_cuda
from conftest import REPO, job_env, run_job

pytestmark = pytest.mark.mostly_waiting   # beside the bed in make test (scripts/run_tests.py)

THREE = "localhost:1,127.0.0.2:1,127.0.0.3:1"
FAST = {"SPARK_HVD_KILL_GRACE_SECONDS": "2"}


def markers(result, word):
    """Every ``word`` marker (STEP, OK) of the output: dicts of its fields, in order."""
    out = []
    for line in result.stdout.splitlines():
        m = re.match(rf"\[\S+\]<stdout>: {word} (.*)", line)
        if m:
            out.append(dict(kv.split("=", 1) for kv in m.group(1).split()))
    return out


def steps(result):
    return markers(result, "STEP")


def finals(result):
    return markers(result, "OK")


def assert_agree(result, size):
    ok = finals(result)
    assert len(ok) == size, result.describe()
    assert {f["size"] for f in ok} == {str(size)}, result.describe()
    assert len({f["hash"] for f in ok}) == 1, result.describe()  # bitwise the same weights
    assert sorted(int(f["rank"]) for f in ok) == list(range(size))
    return ok


def elastic(np_, *args, launcher_args=(), timeout=120, env=None, hosts=THREE):
    return run_job(np_, "elastic_train", *args, hosts=hosts, timeout=timeout,
                   env={**FAST, **(env or {})}, launcher_args=list(launcher_args))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("tensors", ["cpu", "emulated-nccl"])
def test_killed_rank_survivors_continue_from_the_last_commit(tensors, tmp_path):
    """kill -9 of one rank mid-training: its host is blacklisted, the survivors re-form at
    size 2 within a second, continue from the last commit (no step lost, none repeated),
    the loss keeps going down, and the survivors agree bitwise at the end.
    ``emulated-nccl``: the gradients are CUDA tensors of the emulated CUDA runtime and NCCL
    (tests/fake_cuda): the reset aborts the NCCL communicators, and the re-formed job makes
    new ones and goes on through NCCL."""
    env = {}
    if tensors == "emulated-nccl":
        env = {**fake_cuda.build(tmp_path), "FRAMEWORK": "emulated-cuda"}
    r = elastic(3, "--steps", "30", "--kill", "127.0.0.2/0/2:8",
                launcher_args=["--min-np", "2"], env=env)
    assert r.returncode == 0, r.describe()
    ok = assert_agree(r, 2)
    if tensors == "emulated-nccl":  # steps 1-8 before the reset, 9-30 through the new NCCL
        assert all(int(f["nccl"]) >= 30 for f in ok), ok  # at most 9 before it
    s = steps(r)
    before = [x for x in s if x["size"] == "3"]
    after = [x for x in s if x["size"] == "2"]
    assert max(int(x["step"]) for x in before) == 8, r.describe()
    assert int(after[0]["step"]) == 9, r.describe()  # the last commit was step 8
    assert sorted({int(x["step"]) for x in after}) == list(range(9, 31))
    gap = float(after[0]["t"]) - max(float(x["t"]) for x in before)
    # About 1 s; well under the default peer timeout (30 s), which a missed abort would take.
    assert gap < 10.0, f"first step at the new size {gap:.2f} s after the last one"
    losses = [float(x["loss"]) for x in s if x["rank"] == "0"]
    assert losses[-1] < losses[0] / 10
    assert "blacklisted host 127.0.0.2" in r.stderr
    assert re.search(r"reset 1 \(round 2\): lost rank 1 on 127\.0\.0\.2 was killed by signal 9 "
                     r"\(SIGKILL\); 2 rank\(s\) now: localhost:1, 127\.0\.0\.3:1", r.stderr), \
        r.describe()


@pytest.mark.timeout(150)
def test_frozen_rank_is_stopped_and_the_survivors_continue():
    """A rank frozen with SIGSTOP (alive, its host's kernel still answers): the survivors' op
    fails at the stall shutdown, the frozen member does not answer the reset's abort, so
    SPARK_HVD_ELASTIC_REJOIN_SECONDS after the reset began it is stopped and its host
    blacklisted, and the survivors go on at size 2 from the last commit."""
    t0 = time.monotonic()
    r = elastic(3, "--steps", "20", "--stop", "127.0.0.2/0/2:6",
                launcher_args=["--min-np", "2"],
                env={"SPARK_HVD_STALL_CHECK_TIME_SECONDS": "1",
                     "SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS": "2",
                     "SPARK_HVD_ELASTIC_REJOIN_SECONDS": "4"})
    took = time.monotonic() - t0
    assert r.returncode == 0, r.describe()
    assert_agree(r, 2)
    after = [x for x in steps(r) if x["size"] == "2"]
    assert int(after[0]["step"]) == 7, r.describe()  # the last commit was step 6
    assert "frozen or hung" in r.stderr and "blacklisted host 127.0.0.2" in r.stderr, \
        r.describe()
    assert took < 60, f"the frozen rank held the job for {took:.0f} s"


@pytest.mark.timeout(150)
def test_user_exception_ends_the_job_with_its_traceback():
    """A user exception is not a loss: exit code 1, the traceback, Horovod's words, no
    blacklisting, no reset."""
    r = elastic(2, "--steps", "30", "--raise", "127.0.0.2/0/2:5", hosts="localhost:1,127.0.0.2:1",
                launcher_args=["--min-np", "1"])
    assert r.returncode == 1, r.describe()
    assert "ValueError: user error on purpose at step 5" in r.stderr
    assert "Traceback (most recent call last)" in r.stderr
    assert ("Horovod detected that one or more processes exited with non-zero status: rank 1 "
            "on 127.0.0.2 raised ValueError") in r.stderr, r.describe()
    assert "blacklisted" not in r.stderr and "reset 1" not in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_discovered_host_grows_the_job(tmp_path):
    """A host the discovery script starts to list joins at the next reset, with the higher
    ranks; the members keep theirs."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.2:1\n")
    calls = tmp_path / "calls"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho >> {calls}\ncat {hosts}\n")
    script.chmod(0o755)
    stop = threading.Event()

    def third_host_after_the_first_round_started():
        # Counted from the launcher's first discovery, not from here: its start-up may take
        # seconds on a busy machine.
        deadline = time.monotonic() + 60
        while not calls.exists() and time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.1)
        if not stop.wait(3.0):
            hosts.write_text("localhost:1\n127.0.0.2:1\n127.0.0.3:1\n")

    grower = threading.Thread(target=third_host_after_the_first_round_started, daemon=True)
    grower.start()
    try:
        r = elastic(2, "--steps", "20", "--grow-to", "3", "--grow-wait", "60", "--sleep", "0.1",
                    hosts=None, launcher_args=["--min-np", "2", "--host-discovery-script",
                                               script])
    finally:
        stop.set()
        grower.join()
    assert r.returncode == 0, r.describe()
    ok = assert_agree(r, 3)
    assert {f["rank"]: f["wid"] for f in ok} == {"0": "localhost/0/1", "1": "127.0.0.2/0/2",
                                                 "2": "127.0.0.3/0/3"}
    assert re.search(r"reset 1 \(round 2\): .*3 rank\(s\) now: localhost:1, 127\.0\.0\.2:1, "
                     r"127\.0\.0\.3:1", r.stderr), r.describe()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_below_min_np_waits_then_continues_when_the_host_returns():
    """Below --min-np the survivor waits; its host comes back after its cooldown (1-2 s) and
    a new worker there joins: the job finishes on 2 ranks again."""
    r = elastic(2, "--steps", "25", "--kill", "127.0.0.2/0/2:5", hosts="localhost:1,127.0.0.2:1",
                launcher_args=["--min-np", "2", "--blacklist-cooldown-range", "1", "2"])
    assert r.returncode == 0, r.describe()
    ok = assert_agree(r, 2)
    assert {f["wid"] for f in ok} == {"localhost/0/1", "127.0.0.2/0/3"}
    assert "fewer than --min-np 2: waiting up to" in r.stderr, r.describe()
    after = [x for x in steps(r) if x["wid"] == "127.0.0.2/0/3"]
    assert int(after[0]["step"]) == 6  # the newcomer synced the survivor's last commit


@pytest.mark.timeout(120)
def test_every_host_failing_is_a_clear_error():
    r = elastic(2, "--steps", "30", "--kill", "localhost/0/1:4", "--kill",
                "127.0.0.2/0/2:4", hosts="localhost:1,127.0.0.2:1",
                launcher_args=["--min-np", "1"], timeout=90)
    assert r.returncode == 1, r.describe()
    assert "Horovod detected that one or more processes exited with non-zero status" in r.stderr
    assert "no process of round 1 is left" in r.stderr, r.describe()
    assert "killed by signal 9" in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_host_failing_at_every_start_ends_at_the_reset_limit():
    """127.0.0.3's worker always fails before init(): blacklisted, back after its cooldown,
    failing again: each return is a reset, and the job ends at --reset-limit."""
    r = elastic(2, "--steps", "2000", "--fail-on-host", "127.0.0.3",
                launcher_args=["--min-np", "2", "--reset-limit", "2",
                               "--blacklist-cooldown-range", "1", "2"], timeout=120)
    assert r.returncode == 1, r.describe()
    assert ("Horovod was shutdown because number of resets during elastic job exceeded "
            "limit: 2") in r.stderr, r.describe()
    assert "127.0.0.3" in r.stderr.split("exceeded limit: 2")[1]


@pytest.mark.timeout(120)
def test_spark_hvd_run_elastic_function_mode(tmp_path):
    """spark_hvd.run's elastic arguments (Horovod's elastic horovod.run): results in rank
    order, from functions that join rounds and from ones that never call init(); a user error
    raises RunError with the traceback."""
    code = r'''
import os, sys, json
import spark_hvd
from spark_hvd.spark import RunError

def env_rank():
    return int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])

def joined():
    import numpy as np
    import spark_hvd.numpy as hvd
    hvd.init()
    return hvd.rank(), float(hvd.allreduce(np.ones(1), op=hvd.Sum)[0])

def bad():
    import spark_hvd.numpy as hvd
    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("rank 1 gives up")
    import time; time.sleep(30)

out = {"env": spark_hvd.run(env_rank, num_proc=2, min_num_proc=2, max_num_proc=2,
                            hosts="localhost:2,127.0.0.1:2"),
       "joined": spark_hvd.run(joined, num_proc=2, min_num_proc=1,
                               hosts="localhost:1,127.0.0.2:1")}
try:
    spark_hvd.run(bad, num_proc=2, min_num_proc=2, hosts="localhost:1,127.0.0.2:1")
except RunError as e:
    out["error"] = [e.kind, str(e)]
print("RESULT " + json.dumps(out))
'''
    import subprocess
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=job_env(FAST),
                          capture_output=True, text=True, timeout=110)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, done.stdout + done.stderr
    import json
    out = json.loads(line[0][7:])
    assert out["env"] == [[0, 2], [1, 2]]
    assert out["joined"] == [[0, 2.0], [1, 2.0]]
    kind, message = out["error"]
    assert kind == "user" and "KeyError: 'rank 1 gives up'" in message
    assert "rank 1 on 127.0.0.2 raised KeyError" in message


def test_elastic_flag_errors():
    from conftest import PY
    import subprocess

    def launch(*args):
        return subprocess.run([PY, "-m", "spark_hvd.runner", *args], cwd=REPO, env=job_env(),
                              capture_output=True, text=True, timeout=60)

    for args, message in (
            (["-np", "2", "--min-np", "3", "true"], "--min-np 3 is above -np 2"),
            (["-np", "2", "--min-np", "1", "--max-np", "1", "true"], "--max-np 1 is below -np 2"),
            (["-np", "2", "--reset-limit", "1", "true"], "--reset-limit applies to elastic jobs"),
            (["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "0", "5", "true"],
             "cooldown lower limit"),
            (["-np", "2", "--min-np", "1", "--mpi", "true"], "--mpi cannot run an elastic")):
        done = launch(*args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
    start = time.monotonic()
    done = launch("-np", "1", "--host-discovery-script", "false", "true")
    assert done.returncode == 1 and "host discovery failed" in done.stderr, done.stderr
    assert time.monotonic() - start < 30
