"""A multi-host test bed on one machine: each "host" is a Linux network namespace.

Hosts get their own address on a bridge the bed creates (``198.18.<net>.<10+i>/24``; 198.18.0.0/15
is the range reserved for benchmark networks), ``lo`` up, and optionally an egress rate limit
(``tc qdisc ... tbf``; these kernels have ``tbf`` and ``htb`` but no ``netem``). The bridge
itself has ``198.18.<net>.1``, so processes of the root namespace (the test, a launcher, a Spark
driver) reach every host, the way a login node reaches a cluster. With ``mgmt_links=True`` every
host also gets a point-to-point management link to the root namespace (``mgmt0``,
``198.19.<net>.<4i+2>/30``) that does not reach the other hosts (IP forwarding is off in the root
namespace): a host with two interfaces of which only one connects it to its peers.

Each host also has a hostname of its own (``shvd<net>-h<i>``, the namespace's name): processes
started in it get a UTS namespace of their own, and ``/etc/netns/<ns>/hosts`` (which ``ip netns
exec`` mounts over ``/etc/hosts``) resolves every host's name to its address. Open MPI and Spark
tell machines apart by hostname, so they need it. :meth:`Bed.start_sshd` runs an ``sshd`` in
every host, reached with a key the bed makes: the path a user's launcher takes.

Everything is torn down by :meth:`Bed.close` whatever happens: every process in a host namespace
is killed, the namespaces, veths and bridge are deleted, and :meth:`Bed.leftovers` tells what
remains (tests assert it is empty). Several beds may exist at once (parallel test sessions): each
takes a free ``<net>`` number under a lock file.

Use from a test through the ``bed`` fixtures of ``tests/multihost/conftest.py``, or from a shell
(benchmarks, debugging)::

    python tests/multihost/bed.py up 2 --rate 2gbit   # prints the hosts, waits for Ctrl-C

Needs root and iproute2; :func:`unavailable_reason` says why a bed cannot be made.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time

_LOCK_DIR = "/tmp"
_MAX_NETS = 64


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def unavailable_reason() -> str | None:
    """None when network namespaces can be made here, else the reason they cannot."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"shvd-probe-{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"cannot create a network namespace: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclasses.dataclass
class Host:
    """One simulated machine."""
    index: int
    name: str        # a name to use in -H lists and logs, e.g. "h0"
    netns: str       # the network namespace
    addr: str        # its address on the bed's bridge (interface eth0)
    mgmt_addr: str | None = None  # its management-link address (interface mgmt0), if any
    veth: str = ""   # root-namespace end of its bridge link (ip link set <veth> down cuts it)

    @property
    def hostname(self) -> str:
        return self.netns

    def exec_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's network namespace, with the host's hostname."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostname, *argv]


class Bed:
    """``n_hosts`` namespaces on one bridge; a context manager that always tears down."""

    def __init__(self, n_hosts: int, rate: str | None = None, mgmt_links: bool = False):
        self.n_hosts = n_hosts
        self.rate = rate
        self.mgmt_links = mgmt_links
        self.hosts: list[Host] = []
        self.net = -1
        self._lock = None
        self._procs: list[subprocess.Popen] = []
        self.bridge = ""
        self.bridge_addr = ""

    # -- set-up and tear-down -------------------------------------------------------------------

    def _take_net(self) -> None:
        for net in range(_MAX_NETS):
            f = open(os.path.join(_LOCK_DIR, f"shvd-bed-{net}.lock"), "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                continue
            self.net, self._lock = net, f
            return
        raise RuntimeError(f"all {_MAX_NETS} bed networks are in use")

    def __enter__(self) -> "Bed":
        self._take_net()
        n = self.net
        self.bridge = f"shvdbr{n}"
        self.bridge_addr = f"198.18.{n}.1"
        try:
            self._remove_stale()
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.n_hosts):
                self.hosts.append(self._add_host(i))
            self._write_hosts_files()
        except BaseException:
            self.close()
            raise
        return self

    def _add_host(self, i: int) -> Host:
        n = self.net
        host = Host(index=i, name=f"h{i}", netns=f"shvd{n}-h{i}", addr=f"198.18.{n}.{10 + i}",
                    veth=f"shvd{n}h{i}")
        _ip("netns", "add", host.netns)
        _ip("-n", host.netns, "link", "set", "lo", "up")
        _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        _ip("link", "set", host.veth, "master", self.bridge, "up")
        _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        if self.rate:
            self.set_rate(host, self.rate)
        if self.mgmt_links:
            root_end, host.mgmt_addr = f"198.19.{n}.{4 * i + 1}", f"198.19.{n}.{4 * i + 2}"
            _ip("link", "add", f"shvd{n}m{i}", "type", "veth", "peer", "name", "mgmt0",
                "netns", host.netns)
            _ip("addr", "add", f"{root_end}/30", "dev", f"shvd{n}m{i}")
            _ip("link", "set", f"shvd{n}m{i}", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.mgmt_addr}/30", "dev", "mgmt0")
            _ip("-n", host.netns, "link", "set", "mgmt0", "up")
        return host

    def _our_links(self) -> list[str]:
        prefix = f"shvd{self.net}"
        names = [line.split(":")[1].strip().split("@")[0]
                 for line in _ip("-o", "link", check=False).stdout.splitlines()]
        return [n for n in names
                if n.startswith((prefix + "h", prefix + "m")) or n == f"shvdbr{self.net}"]

    def _write_hosts_files(self) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [f"{h.addr} {h.hostname}" for h in self.hosts]
        for h in self.hosts:
            etc = f"/etc/netns/{h.netns}"
            os.makedirs(etc, exist_ok=True)
            with open(f"{etc}/hosts", "w") as f:
                f.write("\n".join(lines) + "\n")

    def _remove_stale(self) -> None:
        """Removes what this bed, or a killed earlier bed with this number, left behind."""
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(f"shvd{self.net}-"):
                self._kill_netns_pids(name)
                _ip("netns", "del", name, check=False)
        for d in (os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []):
            if d.startswith(f"shvd{self.net}-"):
                shutil.rmtree(f"/etc/netns/{d}", ignore_errors=True)
        # A namespace's end of a veth goes with it, but asynchronously: delete the root ends
        # (which takes the pair) and wait, so the next bed with this number can reuse the names.
        for _ in range(100):
            links = self._our_links()
            if not links:
                return
            for link in links:
                _ip("link", "del", link, check=False)
            time.sleep(0.05)

    @staticmethod
    def _kill_netns_pids(netns: str) -> None:
        for _ in range(50):
            pids = _ip("netns", "pids", netns, check=False).stdout.split()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGCONT)  # a frozen process cannot die otherwise
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            time.sleep(0.1)

    def close(self) -> None:
        """Kills every process in the bed's hosts and deletes namespaces, links and bridge."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        for host in self.hosts:
            self._kill_netns_pids(host.netns)
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.net >= 0:
            self._remove_stale()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __exit__(self, *exc) -> None:
        self.close()

    def leftovers(self) -> list[str]:
        """What of this bed still exists: namespaces, links, processes (empty after close)."""
        if self.net < 0:
            return []
        prefix = f"shvd{self.net}"
        left = [f"netns {line.split()[0]}" for line in _ip("netns", "list").stdout.splitlines()
                if line.startswith(prefix + "-")]
        left += [f"link {name}" for name in self._our_links()]
        if os.path.isdir("/etc/netns"):
            left += [f"/etc/netns/{d}" for d in os.listdir("/etc/netns")
                     if d.startswith(prefix + "-")]
        left += [f"process {p.pid} {p.args}" for p in self._procs if p.poll() is None]
        return left

    # -- running things in hosts -----------------------------------------------------------------

    def popen(self, host: Host, argv: list[str], **kwargs) -> subprocess.Popen:
        """Starts ``argv`` in ``host`` (under ``ip netns exec``, in a session of its own);
        :meth:`close` kills it if it is still running."""
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(host.exec_argv(argv), **kwargs)
        self._procs.append(p)
        return p

    def run(self, host: Host, argv: list[str], timeout: float = 60,
            **kwargs) -> subprocess.CompletedProcess:
        """Runs ``argv`` in ``host`` to completion (killed after ``timeout`` seconds)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(host.exec_argv(argv), timeout=timeout, **kwargs)

    def start_sshd(self) -> "SshAccess":
        """Starts ``sshd`` in every host (port 22 on its bridge address, root login with a key
        made here, host key kept across beds so ``known_hosts`` stays valid) and returns how to
        reach them: ``spark-hvd-run -i <access.identity_file> -H <h.addr>:N,...``."""
        access = SshAccess.make()
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        for h in self.hosts:
            config = os.path.join(access.directory, f"sshd_config.{h.netns}")
            with open(config, "w") as f:
                f.write("\n".join([
                    f"ListenAddress {h.addr}", "Port 22", f"HostKey {access.host_key}",
                    f"AuthorizedKeysFile {access.authorized_keys}", "PermitRootLogin yes",
                    "PasswordAuthentication no", "KbdInteractiveAuthentication no",
                    "StrictModes no", "UsePAM no", "PermitUserEnvironment no",
                    f"PidFile {access.directory}/sshd.{h.netns}.pid", "LogLevel ERROR",
                    "MaxStartups 100:30:200", "MaxSessions 100"]) + "\n")
            self.popen(h, ["/usr/sbin/sshd", "-D", "-e", "-f", config],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for h in self.hosts:  # ready when a key login runs a command
            deadline = time.monotonic() + 20
            while True:
                done = subprocess.run(access.ssh_argv(h.addr, "true"), capture_output=True,
                                      text=True, timeout=30)
                if done.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {h.name} did not come up: {done.stderr}")
                time.sleep(0.2)
        return access

    # -- faults and limits ----------------------------------------------------------------------

    def set_rate(self, host: Host, rate: str) -> None:
        """Limits ``host``'s egress on its bridge link to ``rate`` (e.g. ``"2gbit"``) with tbf."""
        _ip("netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
            "rate", rate, "burst", "512kb", "latency", "50ms")

    def link_down(self, host: Host) -> None:
        """Cuts ``host`` off its peers without telling anyone: no FIN, no RST reaches them."""
        _ip("link", "set", host.veth, "down")

    def link_up(self, host: Host) -> None:
        _ip("link", "set", host.veth, "up")

    def pids(self, host: Host) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", host.netns, check=False).stdout.split()]

    def signal_host(self, host: Host, sig: int) -> list[int]:
        """Sends ``sig`` to every process of ``host`` (SIGKILL: the host is lost; SIGSTOP: it
        freezes); returns the pids signalled."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids


@dataclasses.dataclass
class SshAccess:
    """The key pair and files with which the root namespace logs into the bed's hosts."""
    directory: str
    identity_file: str
    host_key: str
    authorized_keys: str

    @classmethod
    def make(cls) -> "SshAccess":
        d = "/tmp/shvd-bed-ssh"
        os.makedirs(d, mode=0o700, exist_ok=True)
        with open(os.path.join(d, ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # parallel beds make the keys once
            for key in ("id_ed25519", "host_ed25519"):
                if not os.path.exists(os.path.join(d, key)):
                    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                                    os.path.join(d, key)], check=True, capture_output=True)
            shutil.copyfile(os.path.join(d, "id_ed25519.pub"), os.path.join(d, "authorized_keys"))
        return cls(d, os.path.join(d, "id_ed25519"), os.path.join(d, "host_ed25519"),
                   os.path.join(d, "authorized_keys"))

    def ssh_argv(self, addr: str, command: str) -> list[str]:
        return ["ssh", "-i", self.identity_file, "-o", "BatchMode=yes", "-o",
                "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o",
                "LogLevel=ERROR", "-o", "ConnectTimeout=5", addr, command]


def _main() -> None:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["up"])
    parser.add_argument("hosts", type=int)
    parser.add_argument("--rate", help="egress limit per host, e.g. 2gbit")
    parser.add_argument("--mgmt-links", action="store_true")
    parser.add_argument("--sshd", action="store_true", help="start sshd in every host")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        sys.exit(f"cannot make a bed: {reason}")
    with Bed(args.hosts, rate=args.rate, mgmt_links=args.mgmt_links) as bed:
        if args.sshd:
            print(f"ssh key: {bed.start_sshd().identity_file}", flush=True)
        for h in bed.hosts:
            print(f"{h.name} netns={h.netns} hostname={h.hostname} addr={h.addr} "
                  f"mgmt={h.mgmt_addr}", flush=True)
        print(f"bridge {bed.bridge} {bed.bridge_addr}; Ctrl-C tears it down", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    _main()
