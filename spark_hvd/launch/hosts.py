"""Host lists and rank assignment: pure functions, no network.

Ranks are host-major: the ranks on one host are consecutive and hosts are filled in the order
given. ``local_rank``/``local_size`` count within a host. ``cross_rank``/``cross_size`` follow
Horovod: the cross communicator of a process is the set of processes with the same
``local_rank`` (one per host that has that many ranks), so ``cross_rank`` is the index of the
host among those hosts. On a homogeneous job this is simply the host index and the number of
hosts.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HostSlots:
    """A host and how many ranks it may run."""
    host: str
    slots: int


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """Where one rank runs and its place in the job."""
    hostname: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def parse_host(spec: str) -> HostSlots:
    """Parse one ``host[:slots]`` entry (``[v6addr]:slots`` for IPv6; slots default to 1)."""
    spec = spec.strip()
    if not spec:
        raise ValueError("empty host entry")
    if spec.startswith("["):
        host, sep, rest = spec[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"bad host entry {spec!r}: expected [address]:slots")
        slots = rest[1:] if rest else "1"
    elif spec.count(":") > 1:  # a bare IPv6 address
        host, slots = spec, "1"
    else:
        host, _, slots = spec.partition(":")
        slots = slots or "1"
    if not host:
        raise ValueError(f"bad host entry {spec!r}: missing host name")
    return HostSlots(host, _parse_slots(slots, spec))


def _parse_slots(text: str, context: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise ValueError(f"bad slot count {text!r} in {context!r}") from None
    if slots < 1:
        raise ValueError(f"slot count must be at least 1 in {context!r}")
    return slots


def parse_hosts(spec: str) -> list[HostSlots]:
    """Parse ``-H``: comma-separated ``host:slots`` entries, e.g. ``"a:2,b:2"``.

    A host named twice gets the sum of its slots, at its first position.
    """
    return _merge(parse_host(part) for part in spec.split(",") if part.strip())


def parse_hostfile(path: str) -> list[HostSlots]:
    """Parse a hostfile: one host a line, as ``host slots=N`` or ``host:N`` (or just ``host``
    for one slot). ``#`` starts a comment; blank lines are skipped."""
    entries = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            tokens = line.split("#", 1)[0].split()
            if not tokens:
                continue
            where = f"{path}:{lineno}"
            entry = parse_host(tokens[0])
            for token in tokens[1:]:
                key, sep, value = token.partition("=")
                if key == "slots" and sep:
                    entry = HostSlots(entry.host, _parse_slots(value, where))
                elif key in ("max_slots", "max-slots") and sep:
                    pass  # Open MPI hostfile syntax: harmless, we never oversubscribe
                else:
                    raise ValueError(f"{where}: unknown hostfile token {token!r} "
                                     "(expected 'host slots=N' or 'host:N')")
            entries.append(entry)
    if not entries:
        raise ValueError(f"hostfile {path} lists no hosts")
    return _merge(entries)


def _merge(entries) -> list[HostSlots]:
    slots: dict[str, int] = {}
    for e in entries:
        slots[e.host] = slots.get(e.host, 0) + e.slots
    if not slots:
        raise ValueError("no hosts given")
    return [HostSlots(h, n) for h, n in slots.items()]


def assign_ranks(hosts: list[HostSlots], np: int) -> list[SlotInfo]:
    """Place ``np`` ranks on ``hosts`` host-major, filling hosts in order.

    Returns one :class:`SlotInfo` per rank, in rank order. Hosts left without ranks are not part
    of the job. Raises ``ValueError`` when ``np`` exceeds the total slots.
    """
    total = sum(h.slots for h in hosts)
    if np < 1:
        raise ValueError(f"-np must be at least 1, got {np}")
    if np > total:
        listed = ",".join(f"{h.host}:{h.slots}" for h in hosts)
        raise ValueError(f"-np {np} asks for more processes than there are slots ({total}) on "
                         f"the hosts {listed}: add hosts or slots, or lower -np")
    per_host: list[tuple[str, int]] = []
    left = np
    for h in hosts:
        n = min(h.slots, left)
        if n:
            per_host.append((h.host, n))
        left -= n
    # Hosts with at least k+1 ranks form the cross communicator of local rank k.
    cross_size = [sum(1 for _, n in per_host if n > k) for k in range(max(n for _, n in per_host))]
    slots = []
    rank = 0
    for host_index, (host, n) in enumerate(per_host):
        for local_rank in range(n):
            cross_rank = sum(1 for _, m in per_host[:host_index] if m > local_rank)
            slots.append(SlotInfo(hostname=host, rank=rank, size=np, local_rank=local_rank,
                                  local_size=n, cross_rank=cross_rank,
                                  cross_size=cross_size[local_rank]))
            rank += 1
    return slots
