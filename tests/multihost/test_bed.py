"""The bed itself: hosts reach each other by their own addresses, a rate limit holds, a link
can be cut, and nothing is left behind."""

from __future__ import annotations

import subprocess
import sys
import time

from bed import Bed

PY = sys.executable

_ECHO_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5000)); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
c.sendall(str(n).encode()); c.close()
"""

_SENDER = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5000), timeout=10)
data = b"x" * (1 << 20); n = int(sys.argv[2]); t = time.perf_counter()
for _ in range(n): c.sendall(data)
c.shutdown(socket.SHUT_WR); got = int(c.recv(64)); dt = time.perf_counter() - t
print(got, dt)
"""


def _transfer(bed, n_mib):
    h0, h1 = bed.hosts
    server = bed.popen(h1, [PY, "-c", _ECHO_SERVER, h1.addr], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"
    done = bed.run(h0, [PY, "-c", _SENDER, h1.addr, str(n_mib)], timeout=60)
    assert done.returncode == 0, done.stderr
    got, seconds = done.stdout.split()
    server.wait(timeout=10)
    return int(got), float(seconds)


def test_hosts_reach_each_other_and_teardown_is_complete():
    bed = Bed(2)
    with bed:
        h0, h1 = bed.hosts
        assert h0.addr != h1.addr
        got, _ = _transfer(bed, 8)
        assert got == 8 << 20
        sleeper = bed.popen(h0, ["sleep", "600"])
        # `ip netns exec` joins the namespace after Popen returns: on a busy machine that takes
        # a moment, so wait for the sleeper to show up in it.
        deadline = time.monotonic() + 20
        while sleeper.pid not in bed.pids(h0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sleeper.pid in bed.pids(h0)
    assert bed.leftovers() == []
    assert sleeper.poll() is not None


def test_rate_limit_holds():
    with Bed(2, rate="200mbit") as bed:
        got, seconds = _transfer(bed, 50)  # 50 MiB at 200 Mbit/s: >= 2.1 s
        assert got == 50 << 20
        rate = got * 8 / seconds / 1e6
        assert rate < 240, f"{rate:.0f} Mbit/s through a 200 Mbit/s limit"


def test_link_down_cuts_the_host_off(bed2):
    h0, h1 = bed2.hosts
    bed2.link_down(h1)
    probe = "import socket,sys; socket.create_connection((sys.argv[1], 9), timeout=2)"
    done = bed2.run(h0, [PY, "-c", probe, h1.addr], timeout=30)
    assert done.returncode != 0 and ("timed out" in done.stderr or "unreachable" in done.stderr)


def test_management_links_reach_the_root_namespace_only(bed2_mgmt):
    h0, h1 = bed2_mgmt.hosts
    probe = ("import socket,sys\n"
             "try: socket.create_connection((sys.argv[1], 9), timeout=2)\n"
             "except ConnectionRefusedError: print('reached')\n"
             "except OSError as e: print('unreachable', e)\n")
    to_peer_mgmt = bed2_mgmt.run(h0, [PY, "-c", probe, h1.mgmt_addr]).stdout
    to_peer_data = bed2_mgmt.run(h0, [PY, "-c", probe, h1.addr]).stdout
    assert to_peer_data.startswith("reached"), to_peer_data
    assert to_peer_mgmt.startswith("unreachable"), to_peer_mgmt


def test_hosts_have_their_own_names_and_sshd(bed2):
    h0, h1 = bed2.hosts
    access = bed2.start_sshd()
    # Logged into h1 over ssh from the root namespace: its hostname, and h0's name resolves
    # to h0's address there.
    probe = f"hostname; getent hosts {h0.hostname}"
    done = subprocess.run(access.ssh_argv(h1.addr, probe), capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    name, resolved = done.stdout.splitlines()[:2]
    assert name == h1.hostname
    assert resolved.split()[0] == h0.addr
