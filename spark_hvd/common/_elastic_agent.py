"""The worker's side of an elastic job: joining the driver's rounds, and hearing its notices.

A process started by an elastic launcher (``SPARK_HVD_ELASTIC=1``) has one :class:`WorkerAgent`,
made by its first ``init()``. The agent

- joins each round: it puts its listener line under ``join/<wid>/<seq>`` with why it joins
  (start, a failure, a hosts-updated interrupt) and its commit token, waits for the driver's
  ``assign/<wid>/<seq>``, reads ``plan/<R>``, and starts the core of round R with the plan's
  ranks and peers (the job id ``<job>.r<R>``). The rank comes from the plan, never from the
  environment; ``init()`` then mirrors it into ``SPARK_HVD_*`` and ``HOROVOD_*``;
- runs a listener thread holding one long-poll connection to the driver (its hello makes the
  connection the driver's liveness probe of this worker). An ``abort`` notice for the current
  round calls ``shvd_abort`` (the current or next collective fails at once with the reason);
  ``hosts_updated`` goes to every registered state's ``_host_messages`` and, on rank 0, into
  the core (``shvd_post_notice``), from where every rank sees it at the same step
  (``State.check_host_updates``);
- reports ``done`` when the process ends normally, and ``error`` (with the traceback) when user
  code raises, before the process exits: the driver tells a user error (the job ends, the host
  is not blamed) from a lost process.

A worker the driver no longer needs (its host was removed, or the job finished while it
waited) leaves with :class:`WorkerRemoved`, a ``SystemExit(0)``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import traceback

from . import _bootstrap
from . import _bootstrap_contract as contract
from . import _elastic_protocol as proto
from ._native import lib
from ._rendezvous import KVClient, RendezvousTimeoutError
from ._secret import secret_from_env
from .exceptions import HorovodInternalError

_log = logging.getLogger("spark_hvd")
# A long poll is re-issued this often, so no request lives forever on the server.
_POLL_SECONDS = 60.0

_agent: "WorkerAgent | None" = None
_agent_lock = threading.Lock()


class WorkerRemoved(SystemExit):
    """This worker is not part of the job any more (its host was removed, or the job finished
    while it waited): the process ends cleanly, with exit code 0."""

    def __init__(self, why):
        super().__init__(0)
        self.why = why

    def __str__(self):
        return self.why


def active() -> bool:
    """True in a worker of an elastic job."""
    return os.environ.get(contract.ELASTIC, "") not in ("", "0")


def get() -> "WorkerAgent":
    """The process's agent, made on first use (an elastic worker's first ``init()``)."""
    global _agent
    with _agent_lock:
        if _agent is None:
            _agent = WorkerAgent(dict(os.environ))
        return _agent


def get_or_none() -> "WorkerAgent | None":
    """The agent when this process already joined an elastic job, else None."""
    return _agent


def report_exit_error(exc: BaseException) -> None:
    """Tell the driver, before the process exits, that ``exc`` ends it (function ranks; also
    one whose function never called ``init()``)."""
    if _agent is not None:
        _agent.report_error(exc)
    elif active():
        env = os.environ
        try:
            with KVClient(env[contract.RENDEZVOUS_ADDR], secret_from_env(env[contract.SECRET]),
                          timeout=10) as client:
                client.put(contract.elastic_scope(env[contract.JOB_ID]),
                           proto.error_key(env[contract.ELASTIC_WORKER_ID]),
                           proto.encode(_error_report(exc, None)))
        except Exception:  # noqa: BLE001 - the driver is gone; the exit code still tells
            pass


def _error_report(exc: BaseException, rank) -> dict:
    internal = isinstance(exc, HorovodInternalError)
    return {"kind": "internal" if internal else "user", "type": type(exc).__name__,
            "message": str(exc),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            "rank": rank}


class Round:
    """The round this worker is a member of, as the driver planned it."""

    def __init__(self, plan: dict, rank: int):
        self.number = plan["round"]
        self.size = plan["size"]
        self.sync = bool(plan["sync"])
        self.notice = int(plan.get("notice", 0))
        self.rank = rank
        host, local_rank, local_size, cross_rank, cross_size = plan["slots"][rank]
        self.host = host
        self.placement = _bootstrap.Placement(rank, self.size, local_rank, local_size,
                                              cross_rank, cross_size)


class WorkerAgent:
    """This worker's membership in the elastic job (see the module's docstring)."""

    def __init__(self, env):
        missing = [k for k in (contract.ELASTIC_WORKER_ID, contract.RENDEZVOUS_ADDR,
                               contract.JOB_ID) if not env.get(k)]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not set: an elastic worker must be "
                               "started by spark-hvd-run or spark_hvd.run with elastic options")
        self.wid = env[contract.ELASTIC_WORKER_ID]
        self.job_id = env[contract.JOB_ID]
        self.scope = contract.elastic_scope(self.job_id)
        self.addr = env[contract.RENDEZVOUS_ADDR]
        self.secret = secret_from_env(env.get(contract.SECRET, ""))
        self.start_timeout = contract.start_timeout(env)
        self.spawn_rank = env.get(contract.RANK, "?")
        peer_timeout = contract.setting("PEER_TIMEOUT_SECONDS", env)
        self.peer_timeout = 25.0 if peer_timeout is None else float(peer_timeout)
        self._client = KVClient(self.addr, self.secret, timeout=self.start_timeout)
        self._lock = threading.Lock()
        self._seq = 0
        self.round: Round | None = None     # the round whose core runs in this process
        self.last_round = 0                 # the number of the last round it was a member of
        self.rounds_joined = 0
        self.entries_in_round = 0           # hvd.elastic.run entries that used round.sync
        self.sync_round = 0                 # commit token: round of the last sync ...
        self.commits = 0                    # ... and commits since
        self.in_run = False
        self.acted_notice = 0               # the newest notice check_host_updates acted on
        self._latest_notice = 0             # the newest hosts_updated notice heard
        self._next_reason = proto.REASON_START
        self._next_error = None
        self._states = []
        self._finished = False              # done or error reported, or removed
        self._listener_error = None
        self._listener = threading.Thread(target=self._listen, name="spark-hvd-elastic-listener",
                                          daemon=True)
        self._listener_ready = threading.Event()
        self._listener.start()
        self._listener_ready.wait(self.start_timeout + 5)
        if self._listener_error:
            raise RuntimeError(f"spark_hvd elastic worker {self.wid}: {self._listener_error}")
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self._at_exit)

    # -- rounds --------------------------------------------------------------------------

    def rejoin_because(self, reason: str, error: BaseException | None = None) -> None:
        """The reason the next ``init()`` gives the driver (set by ``hvd.elastic.run``)."""
        self._next_reason = reason
        self._next_error = None if error is None else f"{type(error).__name__}: {error}"

    def start_round(self, config, static_sets_for_size):
        """Joins the next round and starts its core (``basics.init``'s elastic path); returns
        the placement and the process sets registered in it."""
        reason, error = self._next_reason, self._next_error
        if reason == proto.REASON_START and self.rounds_joined:
            reason = proto.REASON_REINIT
        self._next_reason, self._next_error = proto.REASON_REINIT, None
        rendezvous_host = self.addr.rpartition(":")[0]
        while True:
            line = _bootstrap.listen(config, self.spawn_rank, rendezvous_host)
            assignment = self._join(line, reason, error)
            if "removed" in assignment or "finished" in assignment:
                self._finished = True
                why = assignment.get("removed") or "the job finished while this worker waited"
                _log.info("elastic worker %s leaves: %s", self.wid, why)
                raise WorkerRemoved(f"spark_hvd elastic worker {self.wid} leaves the job: {why}")
            if "error" in assignment:
                raise RuntimeError(f"spark_hvd: the elastic job failed: {assignment['error']}")
            plan = proto.decode(self._client.get(self.scope, proto.plan_key(assignment["round"]),
                                                 timeout=self.start_timeout))
            current = Round(plan, assignment["rank"])
            peers = "\n".join(plan["peers"]) + "\n" if current.size > 1 else ""
            sets = static_sets_for_size(current.size)
            try:
                _bootstrap.connect(config, current.placement, peers, self.secret,
                                   contract.round_job_id(self.job_id, current.number), sets)
            except HorovodInternalError as e:
                # A peer of the new round was lost while the mesh formed: join the next one.
                _log.warning("elastic worker %s: round %d did not form (%s); joining again",
                             self.wid, current.number, e)
                reason, error = proto.REASON_FAILURE, f"{type(e).__name__}: {e}"
                continue
            with self._lock:
                self.round = current
                self.last_round = current.number
                self.rounds_joined += 1
                self.entries_in_round = 0
                self.acted_notice = current.notice
                if current.rank == 0 and self._latest_notice > current.notice:
                    lib.shvd_post_notice(self._latest_notice)
            self._mirror_env(current)
            return current.placement, sets

    def ended_round(self) -> None:
        """``shutdown()`` stopped this round's core."""
        with self._lock:
            self.round = None

    def _join(self, line, reason, error):
        self._seq += 1
        seq = self._seq
        request = {"addr": line, "reason": reason, "error": error,
                   "commit": [self.sync_round, self.commits], "in_run": self.in_run,
                   "last_round": self.last_round}
        self._client.put(self.scope, proto.join_key(self.wid, seq), proto.encode(request))
        # The driver answers once the round forms (or the worker is removed); it is the only
        # one to bound how long that takes, so wait for as long as its connection lives.
        while True:
            if self._listener_error:
                raise RuntimeError(f"spark_hvd elastic worker {self.wid}: "
                                   f"{self._listener_error}")
            try:
                return proto.decode(self._client.get(self.scope, proto.assign_key(self.wid, seq),
                                                     timeout=min(_POLL_SECONDS, 5.0)))
            except RendezvousTimeoutError:
                continue

    def _mirror_env(self, current: Round) -> None:
        p = current.placement
        values = {contract.RANK: p.rank, contract.SIZE: p.size, contract.LOCAL_RANK: p.local_rank,
                  contract.LOCAL_SIZE: p.local_size, contract.CROSS_RANK: p.cross_rank,
                  contract.CROSS_SIZE: p.cross_size}
        for name, value in values.items():
            os.environ[name] = str(value)
            os.environ[contract.HOROVOD_MIRRORS[name]] = str(value)

    # -- hvd.elastic.run's bookkeeping ----------------------------------------------------

    def note_sync(self) -> None:
        self.sync_round = self.round.number if self.round else 0
        self.commits = 0

    def note_commit(self) -> None:
        self.commits += 1

    def register_listener(self, state) -> None:
        with self._lock:
            if state not in self._states:
                self._states.append(state)

    def remove_listener(self, state) -> None:
        with self._lock:
            if state in self._states:
                self._states.remove(state)

    # -- the listener thread ---------------------------------------------------------------

    def _listen(self):
        try:
            client = KVClient(self.addr, self.secret, timeout=self.start_timeout,
                              peer_timeout=self.peer_timeout)
            client.hello(self.wid)
        except Exception as e:  # noqa: BLE001 - reported to the thread that waits for us
            self._listener_error = f"cannot reach the elastic driver at {self.addr}: {e}"
            self._listener_ready.set()
            return
        self._listener_ready.set()
        k = 0
        while True:
            try:
                value = client.get(self.scope, proto.notice_key(self.wid, k),
                                   timeout=_POLL_SECONDS)
            except RendezvousTimeoutError:
                continue
            except Exception as e:  # noqa: BLE001 - the driver is gone
                if self._finished:
                    return
                why = f"lost the connection to the elastic driver at {self.addr}: {e}"
                self._listener_error = why
                lib.shvd_abort(why.encode())
                return
            k += 1
            self._on_notice(proto.decode(value))

    def _on_notice(self, notice: dict) -> None:
        kind = notice.get("kind")
        with self._lock:
            if kind == proto.NOTICE_ABORT:
                if self.round is not None and self.round.number == notice.get("round"):
                    lib.shvd_abort(str(notice.get("why", "aborted by the elastic driver")).encode())
            elif kind == proto.NOTICE_HOSTS_UPDATED:
                nid = int(notice["id"])
                self._latest_notice = max(self._latest_notice, nid)
                # The core first: a state that sees the message may commit at once, and its
                # next op must carry the notice.
                if self.round is not None and self.round.rank == 0 and nid > self.round.notice:
                    lib.shvd_post_notice(nid)
                update = proto.HostUpdateResult(int(notice.get("update", 0)))
                for state in self._states:
                    state.on_hosts_updated(float(notice.get("timestamp", time.time())), update)

    # -- reports ----------------------------------------------------------------------------

    def report_error(self, exc: BaseException) -> None:
        """An exception ends this worker: say which, and whether user code raised it."""
        if self._finished:
            return
        self._finished = True
        report = _error_report(exc, self.round.rank if self.round else None)
        try:
            self._client.put(self.scope, proto.error_key(self.wid), proto.encode(report))
        except Exception:  # noqa: BLE001 - the driver is gone; the exit code still tells
            pass

    def _excepthook(self, exc_type, exc, tb):
        if not issubclass(exc_type, (SystemExit, KeyboardInterrupt)):
            self.report_error(exc)
        self._previous_hook(exc_type, exc, tb)

    def _at_exit(self):
        if self._finished:
            return
        self._finished = True
        try:
            report = {"round": self.last_round,
                      "rank": self.round.rank if self.round else None}
            self._client.put(self.scope, proto.done_key(self.wid), proto.encode(report))
        except Exception:  # noqa: BLE001
            pass
