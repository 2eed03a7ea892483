"""The hosts an elastic job may use: discovery, and a blacklist whose entries come back.

``HostManager`` keeps what discovery last said (hosts and slots) in assignment order: hosts
keep their place while they stay, new ones are appended, so older hosts keep the lower ranks
(Horovod's ``order_available_hosts``). A host where a worker was lost is blacklisted for a
cooldown that doubles with every failure of that host (Horovod's formula: ``lower * 2**n``
plus up to ``lower`` of jitter, within ``[lower, upper]``). Unlike Horovod, the cooldown is on by
default (10 to 600 s), so no host is out for good; it comes back at the first discovery that
lists it after its cooldown. Names and signatures are Horovod's
(``horovod.runner.elastic.discovery``); the clock is injectable for tests.
"""

from __future__ import annotations

import random
import subprocess
import time

from spark_hvd.common._elastic_protocol import HostUpdateResult

# Horovod's bounds on a cooldown range; ours is on by default.
DEFAULT_COOLDOWN_LOWER_LIMIT_SECONDS = 1
DEFAULT_COOLDOWN_UPPER_LIMIT_SECONDS = 1 * 60 * 60
DEFAULT_COOLDOWN_RANGE = (10, 600)
# A discovery script that runs longer is killed (its call counts as failed).
DISCOVERY_SCRIPT_TIMEOUT_SECONDS = 10.0


def validate_cooldown_range(cooldown_range) -> tuple[float, float]:
    """``(lower, upper)`` checked against Horovod's limits: 1 <= lower <= upper <= 3600."""
    lower, upper = (float(x) for x in cooldown_range)
    if lower < DEFAULT_COOLDOWN_LOWER_LIMIT_SECONDS:
        raise ValueError(f"cooldown lower limit {lower:g} s is below the minimum of "
                         f"{DEFAULT_COOLDOWN_LOWER_LIMIT_SECONDS} s")
    if upper > DEFAULT_COOLDOWN_UPPER_LIMIT_SECONDS:
        raise ValueError(f"cooldown upper limit {upper:g} s is above the maximum of "
                         f"{DEFAULT_COOLDOWN_UPPER_LIMIT_SECONDS} s")
    if lower > upper:
        raise ValueError(f"cooldown range {lower:g} {upper:g}: the lower limit is above the "
                         "upper one")
    return lower, upper


class HostState:
    """One host's blacklisting."""

    def __init__(self, cooldown_range=None, clock=time.time, rng=random.random):
        self._lower, self._upper = validate_cooldown_range(cooldown_range or
                                                           DEFAULT_COOLDOWN_RANGE)
        self._clock = clock
        self._rng = rng
        self._blacklisted = False
        self._blacklist_count = 0
        self._cooldown_period_end_ts = 0.0

    def blacklist(self) -> None:
        """Blacklists the host and starts (or keeps) its cooldown."""
        self._blacklisted = True
        now = self._clock()
        if self._cooldown_period_end_ts > now:
            return
        self._blacklist_count += 1
        delay = self._lower * (1 << self._blacklist_count) + self._rng() * self._lower
        self._cooldown_period_end_ts = now + max(self._lower, min(self._upper, delay))

    def whitelist(self) -> None:
        self._cooldown_period_end_ts = 0.0
        self._blacklisted = False

    def is_blacklisted(self) -> bool:
        return self._blacklisted

    def is_resurrected(self) -> bool:
        """The host was blacklisted and its cooldown is over."""
        return self._cooldown_period_end_ts > 0 and self._cooldown_period_end_ts <= self._clock()

    @property
    def cooldown_end(self) -> float:
        return self._cooldown_period_end_ts


class DiscoveredHosts:
    """Hosts and slots as discovery last listed them, with the assignment order."""

    def __init__(self, host_slots, host_assignment_order):
        self._host_slots = dict(host_slots)
        self._host_assignment_order = list(host_assignment_order)

    @property
    def host_slots(self) -> dict[str, int]:
        return self._host_slots

    @property
    def available_hosts(self) -> set[str]:
        return set(self._host_assignment_order)

    @property
    def host_assignment_order(self) -> list[str]:
        return self._host_assignment_order

    def get_slots(self, host) -> int:
        return self._host_slots.get(host, 0)

    def count_available_slots(self) -> int:
        return sum(self.get_slots(h) for h in self._host_assignment_order)

    def __str__(self):
        return ", ".join(f"{h}:{self.get_slots(h)}" for h in self._host_assignment_order) or "none"


class HostManager:
    """Discovery's latest answer, minus blacklisted hosts (see the module's docstring)."""

    def __init__(self, discovery=None, cooldown_range=None, clock=time.time, rng=random.random):
        self._discovery = discovery
        self._cooldown_range = cooldown_range
        self._clock = clock
        self._rng = rng
        self._states: dict[str, HostState] = {}
        self._host_slots: dict[str, int] = {}
        self._order: list[str] = []

    def _state(self, host) -> HostState:
        if host not in self._states:
            self._states[host] = HostState(self._cooldown_range, self._clock, self._rng)
        return self._states[host]

    def update_available_hosts(self) -> HostUpdateResult:
        """Asks discovery, then :meth:`update` (Horovod's method)."""
        return self.update(self._discovery.find_available_hosts_and_slots())

    def update(self, host_slots: dict[str, int]) -> HostUpdateResult:
        """Takes discovery's answer; returns what changed for the job (a host or slots added,
        a blacklisted host back after its cooldown, a host or slots removed)."""
        host_slots = {h: int(n) for h, n in host_slots.items() if int(n) > 0}
        resurrected = [h for h in host_slots if self._state(h).is_resurrected()]
        previous = self._host_slots
        if host_slots == previous and not resurrected:
            return HostUpdateResult.no_update
        result = HostUpdateResult.no_update
        for host, slots in previous.items():
            if host not in host_slots or host_slots[host] < slots:
                result |= HostUpdateResult.removed
        for host, slots in host_slots.items():
            if host not in previous or slots > previous[host] or host in resurrected:
                result |= HostUpdateResult.added
        for host in resurrected:
            self._state(host).whitelist()
        self._host_slots = host_slots
        self._order = self.order_available_hosts(list(host_slots), self._order)
        return result

    @property
    def current_hosts(self) -> DiscoveredHosts:
        """The hosts the job may use now, in assignment order (blacklisted ones left out)."""
        order = [h for h in self._order if not self._state(h).is_blacklisted()]
        return DiscoveredHosts(self._host_slots, order)

    def blacklist(self, host) -> None:
        self._state(host).blacklist()

    def is_blacklisted(self, host) -> bool:
        return self._state(host).is_blacklisted()

    def cooldown_left(self, host) -> float:
        """Seconds until a blacklisted host may come back (0 when it may)."""
        return max(0.0, self._state(host).cooldown_end - self._clock())

    @staticmethod
    def order_available_hosts(available_hosts, prev_host_assignment_order) -> list[str]:
        """``prev_host_assignment_order`` without the hosts gone, then the new ones in the order
        ``available_hosts`` lists them: older hosts keep the lower ranks."""
        order = [h for h in prev_host_assignment_order if h in set(available_hosts)]
        known = set(order)
        for host in available_hosts:
            if host not in known:
                order.append(host)
                known.add(host)
        return order


class HostDiscovery:
    """Where the job's hosts come from (Horovod's interface)."""

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """``{host: slots}``."""
        raise NotImplementedError()


class HostDiscoveryScript(HostDiscovery):
    """Runs ``discovery_script``: one host a line, ``host`` or ``host:slots`` (``slots`` is the
    default, ``--slots-per-host``). A non-zero exit, or a run over 10 s, is an error."""

    def __init__(self, discovery_script, slots=None, timeout=DISCOVERY_SCRIPT_TIMEOUT_SECONDS):
        self._discovery_script = discovery_script
        self._default_slots = slots
        self._timeout = timeout

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        try:
            done = subprocess.run(self._discovery_script, shell=True, capture_output=True,
                                  text=True, timeout=self._timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"discovery script {self._discovery_script} ran longer than "
                               f"{self._timeout:g} s") from None
        if done.returncode != 0:
            raise RuntimeError(f"Failed to execute discovery script: {self._discovery_script}. "
                               f"Exit code: {done.returncode}"
                               + (f": {done.stderr.strip()[-500:]}" if done.stderr.strip()
                                  else ""))
        return parse_discovery_output(done.stdout, self._default_slots,
                                      self._discovery_script)


def parse_discovery_output(text: str, default_slots=None, where="discovery") -> dict[str, int]:
    """``{host: slots}`` from a discovery script's lines, in their order."""
    host_slots: dict[str, int] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        host, sep, slots = line.rpartition(":")
        if not sep or not slots.isdigit():
            host, slots = line, None
        if slots is None:
            if default_slots is None:
                raise RuntimeError(f"{where} printed {line!r} without slots: print host:slots "
                                   "or give --slots-per-host")
            slots = default_slots
        host_slots[host] = int(slots)
    return host_slots


class FixedHosts(HostDiscovery):
    """Hosts given once (``-H``): elastic only in the face of failures."""

    def __init__(self, host_slots):
        self._host_slots = dict(host_slots)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return dict(self._host_slots)

    def set(self, host_slots) -> None:
        self._host_slots = dict(host_slots)
