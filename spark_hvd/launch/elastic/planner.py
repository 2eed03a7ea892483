"""Who gets which rank in a round, and whether the round syncs: pure functions.

Ranks are host-major, hosts in the host manager's assignment order (older hosts first, so they
keep the lower ranks), and within a host the workers by age (spawn order), so survivors keep
their local ranks when other hosts change. Rank 0 is the oldest member that holds training
state (it was inside ``hvd.elastic.run``): the state every other rank syncs to. If its host is
not the first, that host moves to the front (rare; the first host's workers were all new).

``sync`` is one flag for every member (Horovod's #3494 came from survivors skipping the sync
while newcomers waited in it): the round skips the sync only when every member left the last
round at the same commit because hosts changed, none is new, and all hold state.
"""

from __future__ import annotations

import dataclasses

from spark_hvd.common._elastic_protocol import REASON_INTERRUPT
from spark_hvd.launch.hosts import HostSlots, SlotInfo, assign_ranks


@dataclasses.dataclass
class Candidate:
    """A worker that joined (or is expected to join) the round being formed."""
    wid: str
    host: str
    seq: int                   # spawn order: lower is older
    in_run: bool = False       # inside hvd.elastic.run: it holds training state
    reason: str = "start"      # why it joined
    commit: tuple = (0, 0)     # its commit token: (round of last sync, commits since)
    new: bool = True           # not a member of the previous round
    addr: str = ""             # its listener line


@dataclasses.dataclass
class Plan:
    round: int
    members: list[Candidate]   # by rank
    slots: list[SlotInfo]      # by rank
    sync: bool

    @property
    def size(self) -> int:
        return len(self.members)

    def hosts(self) -> list[tuple[str, int]]:
        """(host, ranks there) in rank order."""
        out: list[tuple[str, int]] = []
        for s in self.slots:
            if out and out[-1][0] == s.hostname:
                out[-1] = (s.hostname, out[-1][1] + 1)
            else:
                out.append((s.hostname, 1))
        return out


def order_members(candidates, host_order) -> list[Candidate]:
    """Candidates in rank order (see the module's docstring)."""
    order = list(dict.fromkeys(list(host_order) + [c.host for c in candidates]))
    with_state = [c for c in candidates if c.in_run]
    root = min(with_state, key=lambda c: c.seq) if with_state else None
    if root is not None and order and order[0] != root.host:
        order.remove(root.host)
        order.insert(0, root.host)
    by_host: dict[str, list[Candidate]] = {h: [] for h in order}
    for c in candidates:
        by_host[c.host].append(c)
    ranked = []
    for host in order:
        workers = sorted(by_host[host], key=lambda c: c.seq)
        if root is not None and root in workers:
            workers.remove(root)
            workers.insert(0, root)
        ranked.extend(workers)
    return ranked


def slots_of(members) -> list[SlotInfo]:
    """Host-major placement (local and cross ranks as ``launch.hosts.assign_ranks``) of workers
    already in rank order (consecutive on each host)."""
    per_host: list[HostSlots] = []
    for m in members:
        if per_host and per_host[-1].host == m.host:
            per_host[-1] = HostSlots(m.host, per_host[-1].slots + 1)
        else:
            per_host.append(HostSlots(m.host, 1))
    return assign_ranks(per_host, len(members)) if members else []


def needs_sync(candidates) -> bool:
    """False only when every member left the last round at the same commit because hosts
    changed, none is new, and all hold state."""
    if not candidates:
        return True
    first = tuple(candidates[0].commit)
    return not all(c.reason == REASON_INTERRUPT and not c.new and c.in_run
                   and tuple(c.commit) == first for c in candidates)


def plan_round(round_: int, candidates, host_order) -> Plan:
    members = order_members(candidates, host_order)
    return Plan(round_, members, slots_of(members), needs_sync(members))


def desired_slots(host_order, host_slots, max_np=None) -> list[tuple[str, int]]:
    """How many workers each host should run: its slots, hosts in order, at most ``max_np``
    in all."""
    out, left = [], (max_np if max_np is not None else float("inf"))
    for host in host_order:
        n = int(min(host_slots.get(host, 0), left))
        if n > 0:
            out.append((host, n))
            left -= n
    return out
