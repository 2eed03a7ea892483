"""Spark with hosts of two interfaces, of which only one connects them: eth0 on the bed's
bridge, and mgmt0, a management link that reaches only the root namespace. The Spark
configuration ``spark.spark_hvd.networkInterface`` chooses the interface every rank binds to
and advertises: eth0 works; mgmt0, whose addresses the other host cannot reach, fails the run
(within the start timeout) naming the interface's addresses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bed import Bed
from spark_bed import SparkBed

pytest.importorskip("pyspark")
pytestmark = pytest.mark.timeout(300)

JOB = Path(__file__).resolve().parent / "spark_hosts_job.py"


def test_network_interface_from_the_spark_configuration(tmp_path):
    bed = Bed(2, mgmt_links=True)
    with bed:
        spark = SparkBed(bed, tmp_path / "cluster")
        try:
            spark.start()
            proc = spark.submit(JOB, "iface", tmp_path,
                                confs=["spark.executor.cores=2", "spark.cores.max=4"])
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, f"{out[-3000:]}\n{err[-8000:]}\n{spark.logs()}"
        finally:
            spark.close()
        result = json.loads((tmp_path / "result.json").read_text())
        hosts = {h.hostname: h for h in bed.hosts}
    assert bed.leftovers() == [] and spark.leftovers() == []
    places = result["eth0"]
    assert [p["rank"] for p in places] == [0, 1, 2, 3]
    assert {p["hostname"] for p in places} == set(hosts)
    # The setting reached every rank, which bound to its host's eth0 address.
    assert all(p["iface"] == "eth0" for p in places), places
    assert all(p["bind"] == hosts[p["hostname"]].addr for p in places), places
    assert all(p["sum"] == 10.0 for p in places)
    # On mgmt0 the ranks advertise addresses the other host cannot reach: they cannot meet.
    mgmt = result["mgmt0"]
    assert "places" not in mgmt, f"ranks met over links that do not connect them: {mgmt}"
    assert mgmt["seconds"] < 90, mgmt
    assert any(h.mgmt_addr in mgmt["message"] for h in bed.hosts), mgmt["message"][:3000]
    print(f"on mgmt0: RunError after {mgmt['seconds']:.1f} s: {mgmt['message'][:300]}")
