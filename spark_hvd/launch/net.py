"""Which hosts are this machine, and which address to bind or advertise."""

from __future__ import annotations

import functools
import ipaddress
import socket

from spark_hvd.common._network import (  # noqa: F401  (re-exported)
    interface_addresses, route_address)

_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


@functools.lru_cache(maxsize=1)
def local_identities() -> frozenset[str]:
    """Names and addresses that mean "this machine"."""
    names = set(_LOCAL_NAMES)
    hostname = socket.gethostname()
    names.update({hostname, hostname.split(".")[0], socket.getfqdn()})
    names.update(interface_addresses().values())
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


