"""Elastic jobs on the multi-host bed: 3 hosts x 1 rank, the launcher in the root namespace
starting the workers over ssh (``tests/workers/elastic_train.py``: NumPy SGD, every step
committed). A host whose processes are killed, a host whose link goes down (no FIN, no RST:
only the peer timeout tells), and rank 0's host lost: the survivors go on from their last
commit at size 2, their new rank 0 holding the state, and agree bitwise at the end.

The workers print ``time.time()`` (every namespace shares the machine's clock): the test
compares the survivors' failed collective (``RESTORE t=``) with its own time of the fault."""

from __future__ import annotations

import re
import signal
import time

import pytest

from test_lost_hosts import REPO, BedJob

WORKER = REPO / "tests" / "workers" / "elastic_train.py"
PEER_TIMEOUT = 4.0
# The kernel's probe interval and Python's error path on a loaded 2-core machine.
SLACK = 4.0


def fields(job, word):
    out = []
    for line in job.lines:
        m = re.match(rf"\[\S+\]<stdout>: {word} (.*)", line)
        if m:
            out.append(dict(kv.split("=", 1) for kv in m.group(1).split()))
    return out


def start(bed, tmp_path, steps=200):
    return BedJob(bed, tmp_path, ["--steps", steps, "--sleep", "0.05", "--timed"],
                  {"SPARK_HVD_PEER_TIMEOUT_SECONDS": PEER_TIMEOUT,
                   "SPARK_HVD_KILL_GRACE_SECONDS": "2"},
                  ranks_per_host=1, worker=WORKER,
                  launcher_args=["--min-np", "2", "--elastic-timeout", "60"])


def finish(job, survivors: set[str], fault_at: float, bound: float | None):
    rc = job.wait_exit(timeout=120)
    assert rc == 0, job.describe()
    ok = fields(job, "OK")
    assert {f["size"] for f in ok} == {"2"} and len(ok) == 2, job.describe()
    assert len({f["hash"] for f in ok}) == 1, job.describe()  # bitwise the same
    assert {f["wid"].split("/")[0] for f in ok} == survivors, job.describe()
    after = [s for s in fields(job, "STEP") if s["size"] == "2"]
    assert after, job.describe()
    took = float(after[0]["t"]) - fault_at
    print(f"first step at size 2 {took:.2f} s after the fault")
    if bound is not None:
        restored = [float(r["t"]) - fault_at for r in fields(job, "RESTORE")]
        print(f"survivors' collectives failed after {restored} s")
        assert restored and max(restored) <= bound, job.describe()
    return ok


def cut_link(bed, tmp_path, host, survivors):
    """Takes ``host``'s link down mid-training; the survivors must finish at size 2, their
    collective failed within the peer timeout + 1 s (+ slack); nothing is left in ``host``
    once its link is back. Returns the job and the survivors' final markers."""
    job = start(bed, tmp_path)
    job.wait_for(r"STEP rank=\d size=3 step=20 ", 3, timeout=120)
    fault_at = time.time()
    bed.link_down(host)
    try:
        ok = finish(job, survivors, fault_at, bound=PEER_TIMEOUT + 1 + SLACK)
    finally:
        bed.link_up(host)
    job.assert_nothing_left(host, timeout=40)
    return job, ok


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_host_processes_killed(bed3, tmp_path):
    """Every process of h2 (its sshd too) SIGKILLed mid-training: the survivors' collective
    fails at once, they re-form at size 2 and finish."""
    h0, h1, h2 = bed3.hosts
    job = start(bed3, tmp_path)
    job.wait_for(r"STEP rank=\d size=3 step=20 ", 3, timeout=120)
    fault_at = time.time()
    bed3.signal_host(h2, signal.SIGKILL)
    # Below the peer timeout: the closed connections, not the timeout, ended the collective.
    finish(job, {h0.addr, h1.addr}, fault_at, bound=PEER_TIMEOUT - 0.5)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_host_link_cut(bed3, tmp_path):
    """h2's link goes down mid-training (its processes live on, silent): the survivors'
    collective fails within the peer timeout + 1 s (+ slack), the driver sees h2's listener
    time out, and the survivors finish at size 2."""
    h0, h1, h2 = bed3.hosts
    job, ok = cut_link(bed3, tmp_path, h2, {h0.addr, h1.addr})
    assert any(f"blacklisted host {h2.addr}" in line for line in job.lines), job.describe()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rank0_host_lost(bed3, tmp_path):
    """Rank 0's host (h0) cut off: h1's worker becomes rank 0, holding the state it committed,
    and the job finishes on h1 and h2."""
    h0, h1, h2 = bed3.hosts
    job, ok = cut_link(bed3, tmp_path, h0, {h1.addr, h2.addr})
    assert {f["rank"]: f["wid"].split("/")[0] for f in ok} == {"0": h1.addr, "1": h2.addr}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("min_np", [2, 3])
def test_host_back_after_a_link_cut(bed3, tmp_path, min_np):
    """h2's link is cut mid-training. With --min-np 2 the survivors go on at size 2 from their
    last commit; with --min-np 3 they wait (no deadlock, no progress). The link comes back
    and h2, out for its cooldown (1-2 s), gets a new worker, which joins at the next reset:
    the job is at size 3 again, the older hosts keeping ranks 0 and 1. At the end the three
    agree bitwise and the loss went down."""
    h0, h1, h2 = bed3.hosts
    job = BedJob(bed3, tmp_path, ["--steps", 400, "--sleep", "0.05", "--timed"],
                 {"SPARK_HVD_PEER_TIMEOUT_SECONDS": PEER_TIMEOUT,
                  "SPARK_HVD_KILL_GRACE_SECONDS": "2"},
                 ranks_per_host=1, worker=WORKER,
                 launcher_args=["--min-np", str(min_np), "--max-np", "3",
                                "--elastic-timeout", "60", "--blacklist-cooldown-range", "1",
                                "2"])
    job.wait_for(r"STEP rank=\d size=3 step=20 ", 3, timeout=120)
    bed3.link_down(h2)
    try:
        if min_np == 2:
            job.wait_for(r"STEP rank=\d size=2 ", 2, timeout=PEER_TIMEOUT + 30)
        else:
            job.wait_for(r"fewer than --min-np 3: waiting", 1, timeout=PEER_TIMEOUT + 30)
            time.sleep(3)
    finally:
        bed3.link_up(h2)
    shrunk = max(int(s["step"]) for s in fields(job, "STEP") if s["size"] == "3")
    job.wait_for(r"STEP rank=2 size=3 ", 1, timeout=90)  # h2's new worker, back at size 3
    rc = job.wait_exit(timeout=150)
    assert rc == 0, job.describe()
    ok = fields(job, "OK")
    assert {f["size"] for f in ok} == {"3"} and len(ok) == 3, job.describe()
    assert len({f["hash"] for f in ok}) == 1, job.describe()
    ranks = {f["rank"]: f["wid"] for f in ok}
    assert ranks["0"].startswith(h0.addr) and ranks["1"].startswith(h1.addr), ranks
    assert ranks["2"].startswith(h2.addr) and not ranks["2"].endswith("/3"), ranks  # new spawn
    steps = fields(job, "STEP")
    assert [s for s in steps if s["size"] == "3" and int(s["step"]) > shrunk], job.describe()
    if min_np == 3:
        assert not [s for s in steps if s["size"] == "2"], job.describe()
    losses = [float(s["loss"]) for s in steps if s["rank"] == "0"]
    assert losses[-1] < losses[0] / 10, (losses[0], losses[-1])
    job.assert_nothing_left(h2, timeout=40, ignore_sshd=True)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_host_failing_is_a_clear_error(bed3, tmp_path):
    """Every process of all three hosts (their sshd too) SIGKILLed mid-training: nobody is
    left to go on and no host can take a new worker, so the job ends, within
    --elastic-timeout, with an error that says no process is left, and nothing is left
    behind in any host."""
    job = BedJob(bed3, tmp_path, ["--steps", 2000, "--sleep", "0.05", "--timed"],
                 {"SPARK_HVD_PEER_TIMEOUT_SECONDS": PEER_TIMEOUT,
                  "SPARK_HVD_KILL_GRACE_SECONDS": "2"},
                 ranks_per_host=1, worker=WORKER,
                 launcher_args=["--min-np", "2", "--elastic-timeout", "20"])
    job.wait_for(r"STEP rank=\d size=3 step=20 ", 3, timeout=120)
    fault_at = time.monotonic()
    # Every host in each pass (a list, not any()'s short circuit, which killed them one by
    # one), until nothing is left: a process forked while the pids were listed (an sshd
    # session) would outlive one pass.
    deadline = time.monotonic() + 5
    while any([bed3.signal_host(host, signal.SIGKILL) for host in bed3.hosts]):
        assert time.monotonic() < deadline, [bed3.pids(h) for h in bed3.hosts]
        time.sleep(0.05)
    rc = job.wait_exit(timeout=60)
    took = job.exited_at - fault_at
    print(f"the launcher exited {took:.1f} s after every host was lost, code {rc}")
    assert rc == 1, job.describe()
    text = "\n".join(job.lines)
    # Round 1, or a later one when the launcher re-formed on the hosts not yet killed.
    assert re.search(r"no process of round \d+ is left", text), job.describe()
    assert took <= 20 + SLACK + 5, job.describe()
    for host in bed3.hosts:
        job.assert_nothing_left(host, timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_host_failing_at_every_start_ends_at_the_reset_limit(bed3, tmp_path):
    """h2's worker fails before init() at every start: h2 is blacklisted, back after its
    cooldown (1-2 s), failing again; each return is a reset, and the job ends at
    --reset-limit 2 with Horovod's error naming the limit, h2's failure in the output."""
    h0, h1, h2 = bed3.hosts
    job = BedJob(bed3, tmp_path, ["--steps", 4000, "--sleep", "0.05", "--fail-on-host",
                                  h2.addr],
                 {"SPARK_HVD_PEER_TIMEOUT_SECONDS": PEER_TIMEOUT,
                  "SPARK_HVD_KILL_GRACE_SECONDS": "2"},
                 ranks_per_host=1, worker=WORKER,
                 launcher_args=["--min-np", "2", "--reset-limit", "2",
                                "--blacklist-cooldown-range", "1", "2",
                                "--elastic-timeout", "60"])
    rc = job.wait_exit(timeout=180)
    assert rc == 1, job.describe()
    text = "\n".join(job.lines)
    limit = ("Horovod was shutdown because number of resets during elastic job exceeded "
             "limit: 2")
    assert limit in text, job.describe()
    assert h2.addr in text.split(limit)[1], job.describe()
    assert fields(job, "STEP"), job.describe()   # h0 and h1 trained in between
    for host in bed3.hosts:
        job.assert_nothing_left(host, timeout=20, ignore_sshd=True)
