"""``spark-hvd-run`` across the bed's hosts over ssh, the path users take: ranks really run in
each host (host-major, local and cross ranks right, allreduce across hosts), output comes back
prefixed, a failing remote rank stops every rank in every host, a host that cannot be reached
fails the launch within a bound with ssh's reason, and hosts may be given by name or in a
hostfile."""

from __future__ import annotations

import re
import signal
import subprocess
import time

import pytest
from bed import Bed
from launcher_job import host_list, launch, rank_command, wait_until_only

# The hosts' ranks sleep 600 s after a failure elsewhere: a launch that returns within this
# many seconds was ended by the launcher's teardown.
TEARDOWN_BOUND = 45


@pytest.fixture(scope="module")
def hosts3():
    """Three hosts: h0 and h1 run sshd; h2 is up on the bridge but its sshd is not running.
    Yields (bed, ssh access, {host name: pids that belong there, i.e. sshd})."""
    with Bed(3) as bed:
        access = bed.start_sshd()
        h2 = bed.hosts[2]
        bed.signal_host(h2, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while bed.pids(h2) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not bed.pids(h2), "h2's sshd did not stop"
        baseline = {h.name: set(bed.pids(h)) for h in bed.hosts}
        yield bed, access, baseline
    assert bed.leftovers() == []


def _forget_host_keys(*hosts) -> None:
    """Drops the hosts' keys from known_hosts (an earlier run, or bed, at the same address or
    name), so the launch below is ssh's first contact with them: the one where ssh says it
    added a key."""
    for h in hosts:
        for name in (h.addr, h.hostname):
            subprocess.run(["ssh-keygen", "-R", name], capture_output=True, timeout=30)


def _assert_ranks_in_their_hosts(done, hosts) -> None:
    assert done.returncode == 0, done.stderr
    reports = done.reports()
    assert sorted(reports) == [0, 1, 2, 3], done.stdout + done.stderr
    for rank, report in reports.items():
        host = hosts[rank // 2]
        assert report["hostname"] == host.hostname, (rank, report)
        placement = tuple(report[k] for k in ("size", "local_rank", "local_size", "cross_rank",
                                              "cross_size"))
        assert placement == (4, rank % 2, 2, rank // 2, 2), (rank, report)
        assert report["sums"] == [1 + 2 + 3 + 4], (rank, report)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["-H", "--hostfile"])
def test_ranks_run_in_their_hosts(hosts3, tmp_path, how):
    bed, access, baseline = hosts3
    h0, h1 = bed.hosts[:2]
    if how == "-H":
        where = ["-H", host_list([h0, h1], 2)]
    else:  # both of the hostfile's syntaxes, and a comment
        hostfile = tmp_path / "hostfile"
        hostfile.write_text(f"# the bed\n{h0.addr} slots=2\n{h1.addr}:2\n")
        where = ["--hostfile", str(hostfile)]
    _forget_host_keys(h0, h1)
    done = launch(["-np", "4", *where, "-i", access.identity_file, "--start-timeout", "20",
                   *rank_command()])
    _assert_ranks_in_their_hosts(done, [h0, h1])
    # Every line the ranks wrote carries its rank's prefix.
    assert all(re.match(r"\[[0-3]\]<stdout>: ", line) for line in done.stdout.splitlines())
    # A first contact with each host, yet no "Permanently added ... to the list of known hosts"
    # from ssh in the ranks' stderr.
    assert "known hosts" not in done.stderr, done.stderr
    assert wait_until_only(bed, baseline) == {}


@pytest.mark.timeout(120)
def test_failing_remote_rank_stops_every_rank_in_every_host(hosts3):
    bed, access, baseline = hosts3
    h0, h1 = bed.hosts[:2]
    done = launch(["-np", "4", "-H", host_list([h0, h1], 2), "-i", access.identity_file,
                   "--start-timeout", "20", *rank_command("--fail-rank", "3")])
    assert done.returncode == 3, done.stderr  # the failed rank's own exit code, through ssh
    assert sorted(done.reports()) == [0, 1, 2, 3]  # all were running when rank 3 failed
    assert "[3]<stderr>: rank 3 fails on purpose" in done.stderr
    assert f"rank 3 on {h1.addr} exited with code 3" in done.stderr
    assert done.seconds < TEARDOWN_BOUND, done.seconds
    # Nothing of the job is left in either host: the ranks of h0 (its own and the other
    # local rank on h1) were stopped, not left to sleep.
    assert wait_until_only(bed, baseline) == {}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["no machine", "no sshd", "unknown name"])
def test_unreachable_host_fails_the_launch_within_a_bound(hosts3, case):
    bed, access, baseline = hosts3
    h0 = bed.hosts[0]
    target, reason = {
        # An address on the bridge where nothing answers ARP.
        "no machine": (f"198.18.{bed.net}.99", "(No route to host|Connection timed out)"),
        "no sshd": (bed.hosts[2].addr, "Connection refused"),
        "unknown name": ("no-such-host.invalid", "Could not resolve hostname"),
    }[case]
    start_timeout = 5
    done = launch(["-np", "4", "-H", f"{h0.addr}:2,{target}:2", "-i", access.identity_file,
                   "--start-timeout", str(start_timeout), *rank_command()])
    assert done.returncode == 255, done.stderr  # ssh's exit code for its own failure
    # ssh's connect timeout is the start timeout; then the kill grace (5 s) at most.
    assert done.seconds < start_timeout + 5 + 15, done.seconds
    assert re.search(rf"rank [23] on {re.escape(target)} exited with code 255 \(ssh's code "
                     "for a connection failure", done.stderr), done.stderr
    assert re.search(rf"\[[23]\]<stderr>: ssh: (?=.*{re.escape(target)})(?=.*{reason})",
                     done.stderr), done.stderr
    assert wait_until_only(bed, baseline) == {}  # h0's ranks did not stay waiting


@pytest.mark.timeout(120)
def test_hosts_by_name_with_the_launcher_on_one_of_them(hosts3):
    """The launcher runs in h0 (its hostname resolves there, as does h1's): h0's ranks start
    locally, h1's over ssh, and everything meets. With the interface pinned, the launcher,
    which runs ranks here, binds its rendezvous to h0's address on it too."""
    bed, access, baseline = hosts3
    h0, h1 = bed.hosts[:2]
    done = launch(["-np", "4", "-H", host_list([h0, h1], 2, "hostname"), "-i",
                   access.identity_file, "--start-timeout", "20", "--verbose",
                   "--network-interface", "eth0", *rank_command()], bed=bed, host=h0)
    _assert_ranks_in_their_hosts(done, [h0, h1])
    assert f"rendezvous on {h0.addr} port" in done.stderr, done.stderr
    for rank in (0, 1):
        assert f"rank {rank} on {h0.hostname} locally" in done.stderr, done.stderr
    for rank in (2, 3):
        assert f"rank {rank} on {h1.hostname} over ssh" in done.stderr, done.stderr
    assert wait_until_only(bed, baseline) == {}
