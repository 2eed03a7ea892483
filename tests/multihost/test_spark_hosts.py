"""Spark across hosts of the bed: a standalone master in the root namespace, one worker (two
cores) per host bound to the host's address, drivers spark-submit'ed from the root namespace
(see spark_bed.py). ``spark_hvd.spark.run`` and ``TorchEstimator.fit`` on 4 ranks, 2 per host;
a host whose processes are all killed (worker, executor, Python workers, ranks) mid-run and
mid-fit; the fit resumed from its checkpoint once the host is back; the interface the ranks
use chosen by the Spark configuration (the hosts have two: eth0 connects them, mgmt0 reaches
only the root namespace).

One cluster serves the module (starting one costs ~20 s of the two cores); a test that kills a
host restarts its worker before the next one.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from bed import Bed
from spark_bed import SparkBed, wait_for_file

pytest.importorskip("pyspark")
pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(240)

JOB = Path(__file__).resolve().parent / "spark_hosts_job.py"
# One executor of two cores per host: two ranks per host.
CONFS = ["spark.executor.cores=2", "spark.cores.max=4"]
# The documented bound on a lost host (heartbeat timeout 10 s, then the survivors' stop).
LOST_HOST_BOUND_SECONDS = 30
EPOCHS = 5   # spark_hosts_job.EPOCHS


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    bed = Bed(2, mgmt_links=True)
    with bed:
        spark = SparkBed(bed, tmp_path_factory.mktemp("spark-bed"))
        try:
            spark.start()
            yield spark
        finally:
            spark.close()
    assert bed.leftovers() == [] and spark.leftovers() == []


@pytest.fixture
def spark_bed(cluster):
    """The module's cluster with a worker alive in every host (a test may have lost one)."""
    alive = cluster.alive_workers()
    for host in cluster.bed.hosts:
        if host.addr not in alive:
            cluster.start_worker(host)
    cluster.wait_workers(len(cluster.bed.hosts))
    return cluster


def _finish(spark: SparkBed, proc, timeout: float) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except Exception:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the driver did not finish in {timeout} s\n{out[-3000:]}\n{err[-6000:]}"
                    f"\n{spark.logs()}")
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-8000:]}\n{spark.logs()}"
    return out, err


def _kill_a_host_once_ready(spark_bed, mode, tmp_path, ready_timeout, finish_timeout):
    """Submits the job's ``mode``, waits until each of its 4 ranks wrote ``ready.<rank>``,
    SIGKILLs every process of the second host, and waits for the driver to finish. Returns
    (the host killed, when, the driver's stdout, its stderr)."""
    proc = spark_bed.submit(JOB, mode, tmp_path, confs=CONFS)
    for rank in range(4):
        wait_for_file(tmp_path / f"ready.{rank}", proc, ready_timeout)
    victim = spark_bed.bed.hosts[1]
    killed_at = time.time()
    assert spark_bed.bed.signal_host(victim, signal.SIGKILL)
    out, err = _finish(spark_bed, proc, finish_timeout)
    return victim, killed_at, out, err


def test_run_and_fit_across_hosts(spark_bed, tmp_path):
    proc = spark_bed.submit(JOB, "run", tmp_path, confs=CONFS)
    out, err = _finish(spark_bed, proc, 200)
    result = json.loads((tmp_path / "result.json").read_text())
    places = result["places"]
    by_name = {h.hostname: h for h in spark_bed.bed.hosts}
    assert [p["rank"] for p in places] == [0, 1, 2, 3]
    # Each rank runs in one of the bed's hosts and listens on that host's own address.
    assert all(p["hostname"] in by_name for p in places), places
    assert all(p["bind"] == by_name[p["hostname"]].addr for p in places), places
    # Host-major: ranks 0-1 on one host, 2-3 on the other, Horovod's local/cross numbers.
    assert places[0]["hostname"] == places[1]["hostname"] != places[2]["hostname"] == \
        places[3]["hostname"]
    assert [(p["local_rank"], p["local_size"], p["cross_rank"], p["cross_size"])
            for p in places] == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    assert all(p["sum"] == 10.0 for p in places)
    # The fit trained across both hosts: its loss went down.
    loss = result["history"]["loss"]
    assert len(loss) == 2 and loss[1] < loss[0], result["history"]
    print(f"run {result['run_seconds']:.1f} s, fit {result['fit_seconds']:.1f} s")


def test_lost_host_during_run(spark_bed, tmp_path):
    victim, killed_at, out, err = _kill_a_host_once_ready(spark_bed, "lose-run", tmp_path,
                                                          150, 120)
    error = json.loads((tmp_path / "result.json").read_text())["error"]
    assert error is not None, "spark_hvd.spark.run returned although a host was lost"
    seconds = error["time"] - killed_at
    assert seconds <= LOST_HOST_BOUND_SECONDS, (seconds, error)
    assert error["kind"] == "lost" and error["host"] == victim.addr, error
    lost = error["lost_ranks"]
    assert len(lost) == 2 and lost[1] == lost[0] + 1, error   # the host's two ranks
    assert f"ranks {lost} on host {victim.addr} ({victim.hostname}) were lost" in \
        error["message"], error
    print(f"RunError {seconds:.1f} s after the host was killed: {error['message'][:300]}")


@pytest.mark.timeout(420)   # two fits and a worker restart: ~3 min on a loaded 2-core machine
def test_lost_host_during_fit_then_resume(spark_bed, tmp_path):
    proc = spark_bed.submit(JOB, "lose-fit", tmp_path, confs=CONFS)
    wait_for_file(tmp_path / "ready", proc, 180)
    victim = spark_bed.bed.hosts[0]
    killed_at = time.time()
    assert spark_bed.bed.signal_host(victim, signal.SIGKILL)
    failed = json.loads(wait_for_file(tmp_path / "failed.json", proc, 60))
    error = failed["error"]
    assert error is not None, "the fit ended although a host was lost"
    assert error["time"] - killed_at <= LOST_HOST_BOUND_SECONDS, (error, killed_at)
    assert error["kind"] == "lost" and error["host"] == victim.addr, error
    assert len(error["lost_ranks"]) == 2, error
    checkpoints = failed["checkpoints"]
    assert checkpoints and checkpoints[-1] < EPOCHS - 1, failed
    # The host comes back; the same run_id resumes after the last checkpoint.
    spark_bed.start_worker(victim)
    spark_bed.wait_workers(2)
    (tmp_path / "back").write_text("1")
    out, err = _finish(spark_bed, proc, 200)
    result = json.loads((tmp_path / "result.json").read_text())
    resumed = [int(e) for e in (tmp_path / "epochs.2").read_text().split()]
    assert resumed == list(range(checkpoints[-1] + 1, EPOCHS)), (resumed, checkpoints)
    assert len(result["history"]["loss"]) == EPOCHS, result["history"]
    assert "spark_hvd: resuming run lost_host_run from" in out, out[-3000:]
    print(f"RunError {error['time'] - killed_at:.1f} s after the host was killed (checkpoints "
          f"{checkpoints}); the resumed fit took {result['resumed_fit_seconds']:.1f} s")


@pytest.mark.timeout(420)
def test_lost_host_during_a_fit_that_survives(spark_bed, tmp_path):
    """Issue 31: the fit goes on in memory on the other host's ranks, and returns a model
    whose history has every epoch once."""
    proc = spark_bed.submit(JOB, "survive-fit", tmp_path, confs=CONFS)
    wait_for_file(tmp_path / "ready", proc, 180)
    victim = spark_bed.bed.hosts[1]
    killed_at = time.time()
    assert spark_bed.bed.signal_host(victim, signal.SIGKILL)
    out, err = _finish(spark_bed, proc, 300)
    result = json.loads((tmp_path / "result.json").read_text())
    assert len(result["history"]["loss"]) == EPOCHS, result
    assert result["checkpoints"][-1] == EPOCHS - 1, result
    assert "spark_hvd: fit surviving_run: reset 1 of 3 in memory: lost rank" in out, \
        out[-4000:] + err[-4000:]
    assert f"@{victim.addr}" in out, out[-4000:]
    reset = next(line for line in out.splitlines() if "reset 1 of 3 in memory" in line)
    print(f"fit with a host killed {time.time() - killed_at:.0f} s before it returned; "
          f"{result['fit_seconds']:.0f} s in all; {reset}")


@pytest.mark.timeout(420)
def test_lost_host_during_run_elastic(spark_bed, tmp_path):
    """Issue 31: run_elastic on the standalone cluster; one worker host killed mid-training
    (its executor, its worker daemon and its ranks): the two ranks of the other host go on
    from their last commit at size 2, finish every step once, and agree bitwise."""
    _, killed_at, out, err = _kill_a_host_once_ready(spark_bed, "elastic-run", tmp_path, 180,
                                                     300)
    result = json.loads((tmp_path / "result.json").read_text())
    results = result["results"]
    assert [r["rank"] for r in results] == [0, 1] and {r["size"] for r in results} == {2}, \
        results
    assert len({r["hash"] for r in results}) == 1, results   # bitwise the same weights
    sizes = results[0]["sizes"]
    assert len(sizes) == results[0]["steps"] == 300, results   # every step once
    assert sizes[0] == 4 and sizes[-1] == 2 and 4 not in sizes[sizes.index(2):], sizes
    assert re.search(r"reset 1 \(round [^)]*\): lost rank", out + err), (out + err)[-4000:]
    print(f"run_elastic finished at size 2, {time.time() - killed_at:.0f} s after the host "
          f"was killed; {sizes.count(4)} steps at size 4, {sizes.count(2)} at size 2")


def test_network_interface_from_the_spark_configuration(spark_bed, tmp_path):
    # spark.spark_hvd.networkInterface chooses the interface every rank binds to and
    # advertises: eth0 works; on mgmt0, whose addresses the other host cannot reach, the ranks
    # cannot meet and the run fails within its start timeout, naming those addresses.
    proc = spark_bed.submit(JOB, "iface", tmp_path, confs=CONFS)
    _finish(spark_bed, proc, 200)
    result = json.loads((tmp_path / "result.json").read_text())
    hosts = {h.hostname: h for h in spark_bed.bed.hosts}
    places = result["eth0"]
    assert [p["rank"] for p in places] == [0, 1, 2, 3]
    assert {p["hostname"] for p in places} == set(hosts)
    assert all(p["iface"] == "eth0" for p in places), places
    assert all(p["sum"] == 10.0 for p in places)
    mgmt = result["mgmt0"]
    assert "places" not in mgmt, f"ranks met over links that do not connect them: {mgmt}"
    assert mgmt["seconds"] < 90, mgmt
    assert any(h.mgmt_addr in mgmt["message"] for h in spark_bed.bed.hosts), \
        mgmt["message"][:3000]
    print(f"on mgmt0: RunError after {mgmt['seconds']:.1f} s: {mgmt['message'][:300]}")
