"""The elastic driver: one state machine, one event queue, one deciding thread.

    STARTING -> RUNNING(R) <-> RESETTING(R -> R+1) -> FINISHING -> FINISHED
    any of them -> ERRORED

Events (:meth:`ElasticDriver.post`): ``discovered`` / ``discovery_failed`` (the discovery
thread), ``exited`` (the spawner), ``hello`` / ``disconnected`` (the workers' listener
connections), ``joined`` / ``done`` / ``error`` (the workers' puts), ``signal``, ``fail`` (whoever runs the
driver gives up on the job). The driver is the
single authority: it forms each round once every expected worker joined (no barrier a lost
worker could break: a loss only shrinks what is expected), assigns ranks (``planner``), decides
on failures (``policy``), blacklists hosts (``hosts``), counts resets, and holds every timeout:

- a process that exits without a ``done`` or ``error`` report, or whose listener connection
  closes or times out (a silent host, after the peer timeout): lost at once, the other members
  get an ``abort`` notice (their core fails the current op with its cause);
- a member that has not rejoined ``join_grace`` after a reset began gets ``abort``; one that
  has not rejoined ``rejoin_timeout`` after it began (a live process fails its op at the abort
  and rejoins at once: this one is frozen, stopped with SIGSTOP, or hung in a call that never
  returns) is stopped and its host blacklisted, and the round forms without it;
- a new worker not joined within the start timeout: stopped, its host blacklisted;
- fewer than ``min_np`` processes available: wait for discovery until the elastic timeout;
- resets beyond ``reset_limit``, a user exception, all state lost: ERRORED, naming the cause.

Spawning is pluggable (:class:`Spawner`: processes, or Spark slot tasks in ``spark/_elastic``)
and so is the channel to the workers (:class:`Channel`: the rendezvous store). The clock is
injectable, and :meth:`handle` / :meth:`tick` can be driven directly, so tests run every path
without processes.
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import time

from spark_hvd.common import _elastic_protocol as proto
from spark_hvd.launch.elastic import planner, policy as _policy
from spark_hvd.launch.elastic.policy import Failure
from spark_hvd.launch.hosts import SlotInfo
from spark_hvd.launch.supervise import describe_exit

STARTING, RUNNING, RESETTING, FINISHING, FINISHED, ERRORED = (
    "STARTING", "RUNNING", "RESETTING", "FINISHING", "FINISHED", "ERRORED")
TRANSITIONS = {
    STARTING: {RUNNING, FINISHED, ERRORED},
    RUNNING: {RESETTING, FINISHING, ERRORED},
    RESETTING: {RUNNING, FINISHING, ERRORED},
    FINISHING: {FINISHED, ERRORED},
    FINISHED: set(),
    ERRORED: set(),
}
DEFAULT_JOIN_GRACE_SECONDS = 10.0
# A member that has not rejoined this long after a reset began is frozen (see above).
DEFAULT_REJOIN_TIMEOUT_SECONDS = 60.0
# A listener connection that closed while its process lives on is a loss after this long.
_CLOSED_GRACE_SECONDS = 2.0


@dataclasses.dataclass
class WorkerSpec:
    """What a spawner needs to start one worker."""
    wid: str
    host: str
    slot: int
    seq: int
    planned: SlotInfo   # its place in the round it is spawned for (SPARK_HVD_RANK, ...)


class Spawner:
    """Starts and stops workers; reports each exit as ``driver.post(("exited", wid, code,
    how))`` (``how``: "exit", "signal", "ssh" for a remote connection failure, or the
    spawner's own words for a lost host, such as a Spark executor that went away)."""

    def spawn(self, spec: WorkerSpec) -> None:
        raise NotImplementedError()

    def stop(self, wid: str) -> None:
        """Terminate the worker (it is not needed, or it is lost)."""
        raise NotImplementedError()


class Channel:
    """How the driver answers the workers (the rendezvous store's elastic scope)."""

    def put(self, key: str, value: dict) -> None:
        raise NotImplementedError()


class StoreChannel(Channel):
    """The channel as the rendezvous store's ``scope`` (``server``: the store, in this
    process), values as JSON."""

    def __init__(self, server, scope):
        self.server, self.scope = server, scope

    def put(self, key, value):
        self.server.put(self.scope, key, proto.encode(value))


def worker_event(key: str, value: bytes) -> tuple | None:
    """The driver's event for a worker's put under ``key`` in the elastic scope (``joined``,
    ``done``, ``error``); None for any other key or a value that is not JSON."""
    parsed = proto.parse_key(key)
    if parsed is None:
        return None
    kind, wid, seq = parsed
    try:
        payload = proto.decode(value)
    except ValueError:
        return None
    return ("joined", wid, seq, payload) if kind == "join" else (kind, wid, payload)


class Worker:
    """The driver's record of one spawned worker."""

    def __init__(self, spec: WorkerSpec, now: float):
        self.spec = spec
        self.wid, self.host, self.seq = spec.wid, spec.host, spec.seq
        self.spawned_at = now
        self.registered = False
        self.join = None            # (seq, payload) waiting for an answer
        self.member_round = 0       # the last round it is a member of
        self.rank = None            # its rank in that round
        self.in_run = False
        self.done = False
        self.error = None           # the error report it sent
        self.exit_code = None
        self.exited = False
        self.removed = None         # why it is not wanted any more
        self.lost = False
        self.stopping = False
        self.kill_at = None         # stop it at this time unless it exited
        self.disconnected_at = None
        self.aborted_round = 0      # the round whose abort it was sent
        self.notices = 0            # notices sent to it

    @property
    def live(self) -> bool:
        return not self.exited and not self.lost

    def describe(self) -> str:
        if self.rank is not None:
            return f"rank {self.rank} on {self.host}"
        return f"worker {self.wid}"


@dataclasses.dataclass
class Outcome:
    ok: bool
    error: str | None
    exit_code: int
    members: list[str]              # the final round's workers, by rank ([] if none formed)
    spawn_ranks: dict[str, int]     # every worker's planned rank at spawn
    rounds: int
    resets: int


class ElasticDriver:
    """See the module's docstring."""

    def __init__(self, host_manager, spawner: Spawner, channel: Channel, *, num_proc: int,
                 min_np: int, max_np: int | None, policy: _policy.FailurePolicy,
                 elastic_timeout: float, start_timeout: float,
                 join_grace: float = DEFAULT_JOIN_GRACE_SECONDS,
                 rejoin_timeout: float = DEFAULT_REJOIN_TIMEOUT_SECONDS, clock=time.monotonic,
                 wall=time.time, log=None, on_reset=None):
        self.hosts = host_manager
        self.spawner = spawner
        self.channel = channel
        self.num_proc = max(1, int(num_proc))
        self.min_np = max(1, int(min_np))
        self.max_np = max_np
        self.policy = policy
        self.elastic_timeout = float(elastic_timeout)
        self.start_timeout = float(start_timeout)
        # The abort goes out before a member can be declared frozen.
        self.rejoin_timeout = min(float(rejoin_timeout), float(elastic_timeout))
        self.join_grace = min(float(join_grace), self.rejoin_timeout / 2)
        self.clock = clock
        self.wall = wall
        self._log = log or (lambda message, level="INFO": None)
        # Called as on_reset(resets, cause, size, seconds) when a reset's round has formed.
        self._on_reset = on_reset
        self.events: queue.Queue = queue.Queue()
        self.state = STARTING
        self.workers: dict[str, Worker] = {}
        self.round = 0
        self.members: list[str] = []        # wids of the current round, by rank
        self.resets = 0
        self.notice_id = 0
        self.error = None
        self.exit_code = 0
        self._seq = 0
        self._started_at = clock()
        self._discovered = False
        self._discovery_failing_since = None
        self._reset_started_at = None
        self._reset_cause = ""
        self._reset_losses: list[str] = []  # losses found while re-forming (the real cause)
        self._update_why = ""               # the last change of hosts members were told of
        self._short_since = None
        self._ever_joined = False
        self._losses: list[str] = []        # what was lost, for the final error

    # -- events ------------------------------------------------------------------------

    def post(self, event: tuple) -> None:
        """Queue an event (any thread)."""
        self.events.put(event)

    def run(self, poll: float = 0.1, wind_down: float = 10.0) -> Outcome:
        """Runs until FINISHED or ERRORED, then stops what is left and waits (up to
        ``wind_down`` s) for every worker's exit."""
        while self.state not in (FINISHED, ERRORED):
            try:
                event = self.events.get(timeout=poll)
            except queue.Empty:
                event = None
            if event is not None:
                self.handle(event)
            self.tick()
        deadline = self.clock() + wind_down
        for w in self.workers.values():
            if w.live and not w.exited:
                self._stop(w)
        while any(not w.exited for w in self.workers.values()) and self.clock() < deadline:
            try:
                event = self.events.get(timeout=poll)
            except queue.Empty:
                continue
            if event[0] == "exited":
                self.handle(event)
        return self.outcome()

    def outcome(self) -> Outcome:
        return Outcome(self.state == FINISHED, self.error, self.exit_code,
                       list(self.members) if self.state == FINISHED else [],
                       {w.wid: w.spec.planned.rank for w in self.workers.values()},
                       self.round, self.resets)

    def handle(self, event: tuple) -> None:
        kind = event[0]
        handler = getattr(self, "_on_" + kind, None)
        if handler is None:
            raise ValueError(f"unknown elastic driver event {event!r}")
        if self.state in (FINISHED, ERRORED) and kind not in ("exited",):
            if kind == "joined":
                self._answer_late(event[1], event[2])
            return
        handler(*event[1:])

    def _on_fail(self, why):
        """Whoever runs the driver ends the job (a Spark run whose tasks never started)."""
        self._fail(why)

    def _on_signal(self, signum):
        name = signal.Signals(signum).name
        self._fail(f"received {name}: stopping every worker", exit_code=128 + signum)

    def _on_discovered(self, host_slots):
        self._discovery_failing_since = None
        first = not self._discovered
        self._discovered = True
        update = self.hosts.update(host_slots)
        if first:
            self._log(f"discovered hosts: {self.hosts.current_hosts}", "INFO")
        elif update:
            self._log(f"discovery: {update.name}: hosts now {self.hosts.current_hosts}", "INFO")
        if self.state == STARTING:
            self._maybe_start()
        elif self.state == RUNNING and (update or self._surplus()):
            self._scale(update)
        elif self.state == RESETTING:
            self._refill()
            self._maybe_form()

    def _on_discovery_failed(self, why):
        if not self._discovered:
            self._fail(f"host discovery failed: {why}")
            return
        now = self.clock()
        if self._discovery_failing_since is None:
            self._discovery_failing_since = now
            self._log(f"host discovery failed (keeping the last hosts): {why}", "WARNING")
        elif now - self._discovery_failing_since >= self.elastic_timeout:
            self._fail(f"host discovery kept failing for {self.elastic_timeout:g} s: {why}")

    def _on_hello(self, wid):
        w = self.workers.get(wid)
        if w is not None:
            w.registered = True

    def _on_disconnected(self, wid, how):
        w = self.workers.get(wid)
        if w is None or not w.live or w.done or w.removed or w.error or how == "server stopped":
            return
        if how == "closed":
            w.disconnected_at = self.clock()  # the process is probably exiting: wait for it
            return
        self._stop(w)
        why = ("its host stopped answering (silent for the peer timeout, "
               "SPARK_HVD_PEER_TIMEOUT_SECONDS)" if how == "timeout"
               else f"its connection to the driver failed ({how})")
        self._lose(w, Failure(_policy.HOST_LOST, w.host, f"{w.describe()}: {why}"))

    def _on_joined(self, wid, seq, payload):
        w = self.workers.get(wid)
        if w is None:
            return
        w.registered = True
        self._ever_joined = True
        w.in_run = bool(payload.get("in_run"))
        if not w.live:
            return
        if w.removed:
            self._answer(w, seq, {"removed": w.removed})
            if self.state == RUNNING and w.member_round == self.round:
                # A member leaves (its host was removed): the round is over for all.
                self._begin_reset(f"{w.describe()} left round {self.round}: {w.removed}",
                                  abort=payload.get("reason") != proto.REASON_INTERRUPT)
            return
        if self.state == FINISHING:
            self._answer(w, seq, {"finished": True})
            return
        w.join = (seq, payload)
        if self.state == RUNNING and w.member_round == self.round:
            reason = payload.get("reason", "?")
            if reason == proto.REASON_INTERRUPT and self._update_why:
                cause = self._update_why
            else:
                cause = f"{w.describe()} left round {self.round} ({reason}"
                cause += f": {payload['error']})" if payload.get("error") else ")"
            # A failure ends the round for everybody (the core already aborted); an interrupt
            # reaches every member at the same commit, so they come by themselves.
            self._begin_reset(cause, abort=reason != proto.REASON_INTERRUPT)
        if self.state in (STARTING, RESETTING):
            self._maybe_form()

    def _on_done(self, wid, payload):
        w = self.workers.get(wid)
        if w is None:
            return
        w.done = True
        if w.member_round and w.member_round == self.round and self.state in (RUNNING,
                                                                               RESETTING):
            self._transition(FINISHING)
            self._log(f"{w.describe()} finished: waiting for the other members of round "
                      f"{self.round}", "INFO")
            for other in self.workers.values():
                if other.live and other.member_round != self.round:
                    if other.join is not None:
                        self._answer(other, other.join[0], {"finished": True})
                    else:
                        other.removed = "the job finished"
                        other.kill_at = self.clock() + self.join_grace
        self._check_finished()

    def _on_error(self, wid, report):
        w = self.workers.get(wid)
        if w is None:
            return
        w.error = report
        if report.get("kind") == "user":
            if w.rank is None and report.get("rank") is not None:
                w.rank = report["rank"]
            why = (f"{w.describe()} raised {report.get('type')}: {report.get('message')}\n"
                   f"{report.get('traceback', '')}".rstrip())
            self._lose(w, Failure(_policy.USER_ERROR, w.host, why))

    def _on_exited(self, wid, code, how="exit"):
        w = self.workers.get(wid)
        if w is None or w.exited:
            return
        w.exited = True
        w.exit_code = code
        if self.state in (FINISHED, ERRORED) or w.lost:
            return
        if w.removed and not (self.state == FINISHING and w.member_round == self.round):
            self._maybe_form()
            self._check_finished()
            return
        exit_text = _describe_exit(code)
        if w.done:
            if code == 0:
                self._check_finished()
            else:
                self._lose(w, Failure(_policy.USER_ERROR, w.host,
                                      f"{w.describe()} {exit_text} after it finished"))
            return
        if w.error is not None:
            kind = w.error.get("kind")
            if kind == "user":
                return  # decided when the report came
            why = (f"{w.describe()} {exit_text} on {w.error.get('type')}: "
                   f"{w.error.get('message')} (outside hvd.elastic.run)")
            self._lose(w, Failure(_policy.INTERNAL, w.host, why))
            return
        if code == 0 and not w.registered:
            # A worker that never called init(): its process simply ran (function mode).
            self._log(f"worker {w.wid} on {w.host} exited without joining the job", "DEBUG")
            if self.state == STARTING:
                self._maybe_form()
                self._check_finished()
            return
        if how == "ssh":
            failure = Failure(_policy.HOST_LOST, w.host, f"{w.describe()}: ssh to {w.host} "
                              f"failed ({exit_text})")
        elif how not in ("exit", "signal"):   # the spawner's words for a lost host
            failure = Failure(_policy.HOST_LOST, w.host, f"{w.describe()}: {how}")
        elif code == 0:
            failure = Failure(_policy.PROCESS_LOST, w.host, f"{w.describe()} exited with code 0 "
                              "without finishing (no done report)")
        else:
            failure = Failure(_policy.PROCESS_LOST, w.host, f"{w.describe()} {exit_text}")
        self._lose(w, failure)

    # -- decisions ---------------------------------------------------------------------

    def _lose(self, w: Worker, failure: Failure) -> None:
        """A worker is gone (or its user code raised): decide, and act."""
        if w.lost and failure.kind != _policy.USER_ERROR:
            return
        w.lost = True
        w.join = None
        was_member = w.member_round == self.round and self.round > 0
        self._losses.append(failure.why.splitlines()[0])
        if self.state == FINISHING and was_member:
            finished = [x.describe() for x in self._current() if x.done]
            self._fail(f"{_policy.FAILED_MESSAGE}: {failure.why.splitlines()[0]} after "
                       f"{', '.join(finished) or 'others'} had finished; its result is missing")
            return
        decision = self.policy.decide(failure)
        if decision.action == _policy.RAISE:
            self._fail(decision.why)
            return
        self._log(f"lost {failure.why.splitlines()[0]}", "WARNING")
        if self.state == RESETTING:
            self._reset_losses.append(failure.why.splitlines()[0])
        for host in decision.blacklist:
            self._blacklist(host, failure.why.splitlines()[0])
        if self.state == RUNNING and was_member:
            self._begin_reset("lost " + failure.why.splitlines()[0], abort=True)
        elif self.state in (STARTING, RESETTING):
            self._refill()
            self._maybe_form()
        elif self.state == RUNNING:
            self._refill()
        self._check_state_left()

    def _check_state_left(self):
        """Fails at once when nothing can carry the job on: every process of the last round
        is gone (the training state with them), or, before any process joined, every host
        failed."""
        if self.state == RESETTING and self.round > 0 and not any(
                w.live and not w.removed and w.member_round == self.round
                for w in self.workers.values()):
            self._fail(f"{_policy.FAILED_MESSAGE}: no process of round {self.round} is left "
                       "(lost, or on hosts removed), and with them the training state ("
                       + ("; ".join(self._losses[-4:]) or "hosts removed by discovery")
                       + "); restart the job from a checkpoint")
        elif (self.state == STARTING and not self._ever_joined and not self._expected()
              and self._losses):
            self._fail(f"{_policy.FAILED_MESSAGE}: every process failed before the job "
                       "started: " + "; ".join(self._losses[-4:]))

    def _blacklist(self, host, why):
        self.hosts.blacklist(host)
        left = self.hosts.cooldown_left(host)
        self._log(f"blacklisted host {host} for {left:.0f} s: {why}", "WARNING")
        for w in self.workers.values():
            if w.host == host and w.live and not w.removed:
                w.removed = f"host {host} is blacklisted ({why})"
                w.kill_at = self.clock() + self.join_grace
                if w.join is not None:
                    self._answer(w, w.join[0], {"removed": w.removed})

    def _begin_reset(self, cause, abort):
        self.resets += 1
        limit = self.policy.check_reset(self.resets)
        if limit is not None:
            self._fail(f"{limit.why} (reset {self.resets}: {cause})")
            return
        self._transition(RESETTING)
        self._reset_started_at = self.clock()
        self._reset_cause = cause
        self._reset_losses = []
        self._log(f"reset {self.resets} (round {self.round} -> {self.round + 1}): {cause}",
                  "INFO")
        if abort:
            self._abort_members(f"spark_hvd elastic reset: {cause}")
        self._refill()
        self._maybe_form()

    def _abort_members(self, why):
        for w in self._current():
            if w.live and w.join is None and w.aborted_round != self.round:
                w.aborted_round = self.round
                self._notify(w, {"kind": proto.NOTICE_ABORT, "round": self.round, "why": why})

    def _scale(self, update):
        """RUNNING and the hosts changed: start the workers the new hosts call for, and tell
        every member (they leave at their next commit)."""
        new, removed = self._refill()
        if not new and not removed:
            return
        self.notice_id += 1
        notice = {"kind": proto.NOTICE_HOSTS_UPDATED, "id": self.notice_id,
                  "timestamp": self.wall(), "update": int(update)}
        for w in self._current():
            if w.live:
                self._notify(w, notice)
        what = []
        if new:
            what.append(f"starting {len(new)} worker(s) on " + ", ".join(
                dict.fromkeys(w.host for w in new)))
        if removed:
            what.append(f"removing {len(removed)} worker(s) of " + ", ".join(
                dict.fromkeys(w.host for w in removed)))
        self._update_why = f"hosts changed ({update.name}): {'; '.join(what)}"
        self._log(f"{self._update_why}; members notified (notice {self.notice_id})", "INFO")

    def _refill(self):
        """Brings the live workers in line with the hosts: workers beyond a host's slots (or
        on a host no longer listed) are removed, youngest first; missing ones are spawned.
        Returns (new workers, removed workers)."""
        current = self.hosts.current_hosts
        want = dict(planner.desired_slots(current.host_assignment_order, current.host_slots,
                                          self.max_np))
        by_host: dict[str, list[Worker]] = {}
        for w in self.workers.values():
            if w.live and not w.removed and not w.done:
                by_host.setdefault(w.host, []).append(w)
        removed = []
        for host, ws in by_host.items():
            ws.sort(key=lambda w: w.seq)
            keep = want.get(host, 0)
            for w in ws[keep:]:
                w.removed = (f"host {host} was removed by discovery" if keep == 0
                             else f"host {host} has {keep} slot(s) now")
                w.kill_at = None if w.member_round == self.round and self.state == RUNNING \
                    else self.clock() + self.join_grace
                if w.join is not None:
                    self._answer(w, w.join[0], {"removed": w.removed})
                removed.append(w)
            by_host[host] = ws[:keep]
        specs = []
        for host, n in want.items():
            used = {w.spec.slot for w in by_host.get(host, [])}
            free = (s for s in range(n + len(used)) if s not in used)
            for _ in range(n - len(by_host.get(host, []))):
                self._seq += 1
                specs.append((host, next(free), self._seq))
        if not specs:
            return [], removed
        # Their planned places: the round they are spawned for, as far as known now.
        keep = [planner.Candidate(w.wid, w.host, w.seq, in_run=w.member_round > 0)
                for ws in by_host.values() for w in ws]
        fresh = [planner.Candidate(proto.worker_id(h, s, q), h, q) for h, s, q in specs]
        ranked = planner.order_members(keep + fresh, current.host_assignment_order)
        places = dict(zip((c.wid for c in ranked), planner.slots_of(ranked)))
        new, failed = [], []
        now = self.clock()
        for (host, slot, seq), cand in zip(specs, fresh):
            spec = WorkerSpec(cand.wid, host, slot, seq, places[cand.wid])
            w = Worker(spec, now)
            self.workers[w.wid] = w
            new.append(w)
            self._log(f"starting worker {w.wid} (planned rank {spec.planned.rank} of "
                      f"{spec.planned.size})", "INFO")
            try:
                self.spawner.spawn(spec)
            except OSError as e:
                failed.append((w, e))
        for w, e in failed:  # after every spawn of this pass, so a refill does not repeat it
            w.exited = True
            self._lose(w, Failure(_policy.START_FAILED, w.host, f"worker {w.wid} could not be "
                                  f"started on {w.host}: {e}"))
        return new, removed

    def _surplus(self) -> bool:
        current = self.hosts.current_hosts
        want = dict(planner.desired_slots(current.host_assignment_order, current.host_slots,
                                          self.max_np))
        count: dict[str, int] = {}
        for w in self.workers.values():
            if w.live and not w.removed and not w.done:
                count[w.host] = count.get(w.host, 0) + 1
        return count != want

    def _maybe_start(self):
        available = self.hosts.current_hosts.count_available_slots()
        if available < self.num_proc:
            self._log(f"waiting for {self.num_proc} slots: {available} available "
                      f"({self.hosts.current_hosts})", "INFO")
            return
        self._refill()
        self._maybe_form()

    def _expected(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.live and not w.removed and not w.done]

    def _current(self) -> list[Worker]:
        return [self.workers[wid] for wid in self.members]

    def _maybe_form(self):
        if self.state not in (STARTING, RESETTING):
            return
        expected = self._expected()
        if not expected or any(w.join is None for w in expected):
            return
        if len(expected) < self.min_np:
            return
        self._check_state_left()
        if self.state in (FINISHED, ERRORED):
            return
        candidates = []
        for w in expected:
            payload = w.join[1]
            candidates.append(planner.Candidate(
                w.wid, w.host, w.seq, in_run=bool(payload.get("in_run")),
                reason=payload.get("reason", proto.REASON_START),
                commit=tuple(payload.get("commit", (0, 0))),
                new=w.member_round == 0 or w.member_round != self.round,
                addr=payload.get("addr", "")))
        plan = planner.plan_round(self.round + 1, candidates,
                                  self.hosts.current_hosts.host_assignment_order)
        self.round = plan.round
        self.members = [c.wid for c in plan.members]
        self.channel.put(proto.plan_key(plan.round), {
            "round": plan.round, "size": plan.size, "sync": plan.sync, "notice": self.notice_id,
            "peers": [c.addr for c in plan.members],
            "slots": [[s.hostname, s.local_rank, s.local_size, s.cross_rank, s.cross_size]
                      for s in plan.slots]})
        for rank, c in enumerate(plan.members):
            w = self.workers[c.wid]
            w.member_round, w.rank = plan.round, rank
            self._answer(w, w.join[0], {"round": plan.round, "rank": rank, "sync": plan.sync})
        self._short_since = None
        layout = ", ".join(f"{h}:{n}" for h, n in plan.hosts())
        if self._reset_started_at is not None:
            took = self.clock() - self._reset_started_at
            cause = "; ".join(["lost " + x for x in self._reset_losses] or [self._reset_cause])
            self._log(f"reset {self.resets} (round {plan.round}): {cause}; "
                      f"{plan.size} rank(s) now: {layout}; re-formed in {took:.1f} s"
                      f"{'' if plan.sync else ' (no sync: same commit everywhere)'}", "WARNING")
            if self._on_reset is not None:
                self._on_reset(self.resets, cause, plan.size, took)
        else:
            self._log(f"round {plan.round}: {plan.size} rank(s): {layout}", "INFO")
        self._reset_started_at = None
        self._update_why = ""
        self._transition(RUNNING)

    def _check_finished(self):
        if self.state == FINISHING:
            if all(w.done and w.exited for w in self._current()):
                self._transition(FINISHED)
        elif self.state == STARTING and not self._ever_joined and self.workers and all(
                w.exited and w.exit_code == 0 for w in self.workers.values()):
            self._transition(FINISHED)  # every worker ran without joining (never called init)

    # -- time ----------------------------------------------------------------------------

    def tick(self) -> None:
        """Acts on whatever timed out (called after every event and at least every poll)."""
        if self.state in (FINISHED, ERRORED):
            return
        now = self.clock()
        for w in list(self.workers.values()):
            if w.exited:
                continue
            if w.kill_at is not None and now >= w.kill_at and not w.stopping:
                self._stop(w)
            if (w.disconnected_at is not None and not w.lost and not w.done and not w.removed
                    and now - w.disconnected_at >= _CLOSED_GRACE_SECONDS):
                self._stop(w)
                self._lose(w, Failure(_policy.PROCESS_LOST, w.host, f"{w.describe()}: its "
                                      "connection to the driver closed but it did not exit"))
        if self.state in (FINISHED, ERRORED):
            return
        if self.state == STARTING:
            self._tick_starting(now)
        elif self.state == RESETTING:
            self._tick_resetting(now)
        elif self.state == RUNNING:
            self._tick_newcomers(now)

    def _tick_starting(self, now):
        if not self.workers:
            if now - self._started_at >= self.elastic_timeout:
                got = self.hosts.current_hosts.count_available_slots() if self._discovered else 0
                self._fail(f"only {got} slot(s) were available, fewer than the {self.num_proc} "
                           f"requested (-np), for {self.elastic_timeout:g} s "
                           "(--elastic-timeout): "
                           + (f"hosts {self.hosts.current_hosts}" if self._discovered
                              else "discovery never answered"))
            return
        if self._ever_joined:
            self._tick_newcomers(now)
        self._check_capacity(now)

    def _tick_resetting(self, now):
        started = self._reset_started_at or now
        for w in self._expected():
            if w.join is not None:
                continue
            if w.member_round == self.round and self.round > 0:
                if now - started >= self.join_grace and w.aborted_round != self.round:
                    w.aborted_round = self.round
                    self._notify(w, {"kind": proto.NOTICE_ABORT, "round": self.round,
                                     "why": f"spark_hvd elastic reset: {self._reset_cause}"})
                if now - started >= self.rejoin_timeout:
                    self._stop(w)
                    self._lose(w, Failure(_policy.HOST_FROZEN, w.host, f"{w.describe()} did "
                                          f"not rejoin within {self.rejoin_timeout:g} s of the "
                                          "reset (SPARK_HVD_ELASTIC_REJOIN_SECONDS), its abort "
                                          "unanswered: frozen or hung"))
                    if self.state != RESETTING:
                        return
        self._tick_newcomers(now)
        if self.state == RESETTING:
            self._check_capacity(now)

    def _tick_newcomers(self, now):
        for w in list(self.workers.values()):
            if (w.live and not w.removed and w.member_round == 0 and w.join is None
                    and not w.done and now - w.spawned_at >= self.start_timeout):
                self._stop(w)
                self._lose(w, Failure(_policy.START_FAILED, w.host, f"worker {w.wid} did not "
                                      f"join within {self.start_timeout:g} s (--start-timeout)"))
                if self.state in (FINISHED, ERRORED):
                    return

    def _check_capacity(self, now):
        available = len(self._expected())
        if self.state == STARTING and not self._ever_joined:
            return
        why = "; ".join(self._losses[-4:]) or f"hosts {self.hosts.current_hosts}"
        decision = self.policy.check_capacity(available, self._short_since, now, why)
        if decision is None:
            self._short_since = None
        elif decision.action == _policy.RAISE:
            self._fail(decision.why)
        elif self._short_since is None:
            self._short_since = now
            self._log(f"{available} process(es) left, fewer than --min-np {self.min_np}: "
                      f"waiting up to {self.elastic_timeout:g} s for hosts", "WARNING")

    # -- acting ------------------------------------------------------------------------

    def _answer(self, w: Worker, seq: int, value: dict) -> None:
        self.channel.put(proto.assign_key(w.wid, seq), value)
        w.join = None
        if "removed" in value or "finished" in value:
            if not w.removed:
                w.removed = value.get("removed") or "the job finished"
            if w.kill_at is None:
                w.kill_at = self.clock() + self.join_grace

    def _answer_late(self, wid, seq):
        w = self.workers.get(wid)
        if w is None:
            return
        if self.state == FINISHED:
            self.channel.put(proto.assign_key(wid, seq), {"finished": True})
        else:
            self.channel.put(proto.assign_key(wid, seq), {"error": self.error or "stopped"})

    def _notify(self, w: Worker, notice: dict) -> None:
        self.channel.put(proto.notice_key(w.wid, w.notices), notice)
        w.notices += 1

    def _stop(self, w: Worker) -> None:
        if w.stopping or w.exited:
            return
        w.stopping = True
        self.spawner.stop(w.wid)

    def _fail(self, why, exit_code=1):
        if self.state in (FINISHED, ERRORED):
            return
        self.error = why
        self.exit_code = exit_code
        self._transition(ERRORED)
        self._log(why, "ERROR")
        for w in self.workers.values():
            if w.join is not None:
                self._answer_late(w.wid, w.join[0])
                w.join = None

    def _transition(self, state):
        if state == self.state:
            return
        if state not in TRANSITIONS[self.state]:
            raise RuntimeError(f"elastic driver: no transition {self.state} -> {state}")
        self._log(f"driver: {self.state} -> {state}", "DEBUG")
        self.state = state


def _describe_exit(code) -> str:
    return "ended" if code is None else describe_exit(code)
