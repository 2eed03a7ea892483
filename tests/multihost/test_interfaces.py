"""Interface choice on hosts with two networks, of which only one connects them.

Each bed host has ``eth0`` (the bridge: reaches the other hosts) and ``mgmt0`` (reaches only the
root namespace, where the launcher runs). The launcher reaches the hosts by their management
addresses, so each rank's route to the launcher's rendezvous, and with it the address a rank
advertises by default, is on ``mgmt0``, where its peers cannot reach it. Pinning the interface
(``--network-interface``, ``SPARK_HVD_NETWORK_INTERFACE``, Horovod's ``HOROVOD_GLOO_IFACE``)
makes every rank bind to, and advertise, its own ``eth0`` address.
"""

from __future__ import annotations

import re

import pytest
from bed import Bed
from launcher_job import host_list, launch, rank_command, start_mgmt_sshd, wait_until_only

# Short, so a job that cannot connect fails soon, but long enough for four ranks to start
# over ssh and meet in the rendezvous on this loaded machine (they must, for the failure to be
# the one under test: peers that cannot connect).
START_TIMEOUT = 10
# The start timeout, the launcher's kill grace (5 s), and room for this loaded machine.
FAILURE_BOUND = START_TIMEOUT + 5 + 25


@pytest.fixture(scope="module")
def mgmt_hosts():
    """The ``bed2_mgmt`` bed (two hosts with eth0 and mgmt0), shared by this module's tests,
    with sshd on both of each host's addresses. Yields (bed, ssh access, {host: its sshds})."""
    with Bed(2, mgmt_links=True) as bed:
        access = bed.start_sshd()
        start_mgmt_sshd(bed, access)
        baseline = {h.name: set(bed.pids(h)) for h in bed.hosts}
        yield bed, access, baseline
    assert bed.leftovers() == []


def _launch_through_mgmt(mgmt_hosts, *args, env=None):
    bed, access, _ = mgmt_hosts
    return launch(["-np", "4", "-H", host_list(bed.hosts, 2, "mgmt_addr"), "-i",
                   access.identity_file, "--start-timeout", str(START_TIMEOUT),
                   "--log-level", "DEBUG", *args, *rank_command()], env=env)


def _advertised(stderr: str) -> dict[int, str]:
    """rank -> the address it advertised (the bootstrap's debug line)."""
    found = re.findall(r"^\[(\d)\]<stderr>: spark_hvd DEBUG: rank \d listens on \S+"
                       r"(?: \(interface \w+\))?, advertised as (\S+)$", stderr, re.M)
    return {int(rank): addr for rank, addr in found}


@pytest.mark.timeout(120)
def test_without_a_setting_ranks_advertise_the_management_network_and_fail(mgmt_hosts):
    bed, _, baseline = mgmt_hosts
    h0, h1 = bed.hosts
    done = _launch_through_mgmt(mgmt_hosts)
    assert done.returncode != 0, done.stdout
    assert done.seconds < FAILURE_BOUND, done.seconds
    assert _advertised(done.stderr) == {0: h0.mgmt_addr, 1: h0.mgmt_addr, 2: h1.mgmt_addr,
                                        3: h1.mgmt_addr}, done.stderr
    # The error says what failed, what was advertised, and what to do about it.
    assert re.search(rf"connect to ({re.escape(h0.mgmt_addr)}|{re.escape(h1.mgmt_addr)}):\d+: "
                     "Network is unreachable", done.stderr), done.stderr
    assert f"rank 3: {h1.mgmt_addr}:" in done.stderr
    assert "--network-interface IF (SPARK_HVD_NETWORK_INTERFACE=IF)" in done.stderr
    assert wait_until_only(bed, baseline) == {}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", [
    ["--network-interface", "eth0"],
    ["--network-interfaces", "ib0,eth0"],  # Horovod's list: the first one a host has
    "SPARK_HVD_NETWORK_INTERFACE",
    "HOROVOD_GLOO_IFACE",
])
def test_pinned_interface_connects_the_ranks_over_it(mgmt_hosts, setting):
    bed, _, baseline = mgmt_hosts
    h0, h1 = bed.hosts
    if isinstance(setting, list):
        done = _launch_through_mgmt(mgmt_hosts, *setting)
    else:  # set in the launcher's environment, which the ranks inherit
        done = _launch_through_mgmt(mgmt_hosts, env={setting: "eth0"})
    assert done.returncode == 0, done.stderr
    reports = done.reports()
    assert sorted(reports) == [0, 1, 2, 3]
    assert all(r["sums"] == [10.0] for r in reports.values()), reports
    # Each rank resolved eth0 on its own host; mgmt0 does not connect the hosts, so the
    # allreduce above crossed between them over eth0.
    assert _advertised(done.stderr) == {0: h0.addr, 1: h0.addr, 2: h1.addr, 3: h1.addr}
    assert "(interface eth0)" in done.stderr
    assert wait_until_only(bed, baseline) == {}


@pytest.mark.timeout(120)
def test_unknown_interface_is_an_error_naming_the_hosts_interfaces(mgmt_hosts):
    bed, _, baseline = mgmt_hosts
    done = _launch_through_mgmt(mgmt_hosts, "--network-interface", "bogus0")
    assert done.returncode == 1, done.stderr
    assert done.seconds < FAILURE_BOUND, done.seconds
    # The first rank to fail stops the job; its error names its host and that host's own
    # interfaces (the launcher's machine has others).
    m = re.search(r"ValueError: spark_hvd.init: rank (\d): SPARK_HVD_NETWORK_INTERFACE=bogus0: "
                  r"host (\S+) has no network interface of that name with an IPv4 address "
                  r"\(interfaces with one here: (.*)\)", done.stderr)
    assert m, done.stderr
    host = bed.hosts[int(m.group(1)) // 2]
    assert m.group(2) == host.hostname
    assert m.group(3) == f"eth0 {host.addr}, lo 127.0.0.1, mgmt0 {host.mgmt_addr}"
    assert wait_until_only(bed, baseline) == {}
