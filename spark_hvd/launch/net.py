"""Which hosts are this machine, and which address to bind or advertise."""

from __future__ import annotations

import functools
import ipaddress
import socket
import struct
import sys

from spark_hvd.common._network import route_address  # noqa: F401  (re-exported)

_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def interface_ipv4(name: str) -> str:
    """Return the IPv4 address of network interface ``name`` (e.g. ``"eth0"``, ``"lo"``).

    Raises ``ValueError`` naming the interfaces that exist when it has none.
    """
    addr = _interface_addrs().get(name)
    if addr is None:
        known = ", ".join(sorted(_interface_addrs())) or "none found"
        raise ValueError(f"network interface {name!r} has no IPv4 address "
                         f"(interfaces with one: {known})")
    return addr


@functools.lru_cache(maxsize=1)
def _interface_addrs() -> dict[str, str]:
    """Map interface name -> first IPv4 address."""
    try:
        import psutil  # optional: portable beyond Linux
    except ImportError:
        psutil = None
    if psutil is not None:
        out = {}
        for name, addrs in psutil.net_if_addrs().items():
            for a in addrs:
                if a.family == socket.AF_INET:
                    out.setdefault(name, a.address)
        return out
    if not sys.platform.startswith("linux"):
        return {}
    import fcntl
    siocgifaddr = 0x8915
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                out[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24])
            except OSError:
                pass  # interface without an IPv4 address
    return out


@functools.lru_cache(maxsize=1)
def local_identities() -> frozenset[str]:
    """Names and addresses that mean "this machine"."""
    names = set(_LOCAL_NAMES)
    hostname = socket.gethostname()
    names.update({hostname, hostname.split(".")[0], socket.getfqdn()})
    names.update(_interface_addrs().values())
    try:
        for info in socket.getaddrinfo(hostname, None):
            names.add(info[4][0])
    except OSError:
        pass
    return frozenset(n.lower() for n in names if n)


def is_loopback(host: str) -> bool:
    """True for 127.x.x.x and ::1 literals."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_host(host: str, identities: frozenset[str] | None = None) -> bool:
    """True when ``host`` is this machine: ranks there are spawned directly, without ssh.

    Literal loopback addresses and known names/addresses are decided without DNS; any other name
    is resolved and is local when it resolves to a loopback or local address.
    """
    ids = local_identities() if identities is None else identities
    if is_loopback(host) or host.lower() in ids:
        return True
    try:
        ipaddress.ip_address(host)
        return False  # a literal address that is not ours
    except ValueError:
        pass
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False  # let ssh report the unknown host
    return any(is_loopback(a) or a.lower() in ids for a in resolved)


