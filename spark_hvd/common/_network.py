"""Network helpers shared by the bootstrap and the launcher: routes, interface addresses, and
the interface a job's traffic is pinned to (``--network-interface``)."""

import functools
import socket
import struct
import sys

from . import _bootstrap_contract as contract

# Where the interface setting comes from, in lookup order: ours (also HOROVOD_NETWORK_INTERFACE
# through the contract's alias rule), then Horovod's per-rank Gloo variable.
INTERFACE_SETTINGS = (contract.NETWORK_INTERFACE[len(contract.PREFIX):], "GLOO_IFACE")


def route_address(host: str) -> str:
    """The local address this machine would use to reach ``host`` (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def interface_addresses() -> dict[str, str]:
    """Map interface name -> its first IPv4 address, for the interfaces that have one."""
    return dict(_interface_addrs())


def _known_interfaces() -> str:
    return ", ".join(f"{n} {a}" for n, a in sorted(_interface_addrs())) or "none found"


@functools.lru_cache(maxsize=1)
def _interface_addrs() -> tuple[tuple[str, str], ...]:
    """(interface name, first IPv4 address) pairs; a tuple so the cached value is immutable."""
    try:
        import psutil  # optional: portable beyond Linux
    except ImportError:
        psutil = None
    out = {}
    if psutil is not None:
        for name, addrs in psutil.net_if_addrs().items():
            for a in addrs:
                if a.family == socket.AF_INET:
                    out.setdefault(name, a.address)
        return tuple(out.items())
    if not sys.platform.startswith("linux"):
        return ()
    import fcntl
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                out[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24])
            except OSError:
                pass  # interface without an IPv4 address
    return tuple(out.items())


def interface_setting(env=None) -> tuple[str, list[str]] | None:
    """The interface(s) the job's traffic is pinned to, as (the variable that set it, names):
    ``SPARK_HVD_NETWORK_INTERFACE`` / ``HOROVOD_NETWORK_INTERFACE`` (the launcher's
    ``--network-interface``; Spark sets it from its config), else Horovod's per-rank
    ``HOROVOD_GLOO_IFACE``. A comma list names alternatives; None when nothing is set."""
    for name in INTERFACE_SETTINGS:
        value = contract.setting(name, env)
        if value is not None:
            names = [n.strip() for n in value.split(",") if n.strip()]
            if names:
                return contract.set_name(name, env), names
    return None


def pinned_interface_address(env=None) -> tuple[str, str] | None:
    """(interface, its IPv4 address on this host) for the interface setting, or None when no
    interface is set. Names are resolved here, on the rank's own host: hosts share interface
    names, not addresses. Of a comma list the first name this host has is taken.

    Raises ``ValueError`` naming this host and the interfaces it has when none of the names
    exists here."""
    setting = interface_setting(env)
    if setting is None:
        return None
    variable, names = setting
    addrs = dict(_interface_addrs())
    for name in names:
        if name in addrs:
            return name, addrs[name]
    raise ValueError(f"{variable}={','.join(names)}: host {socket.gethostname()} has no "
                     f"network interface of that name with an IPv4 address (interfaces with "
                     f"one here: {_known_interfaces()})")
