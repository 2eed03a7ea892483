"""The driver side of ``spark_hvd.spark.run``: a controller driven by its state.

    STARTING ──> RUNNING ──────────> FINISHED
        │         │    ▲
        │         ▼    │
        │       RESTARTING            (no policy enters it: see below)
        │         │
        └─────────┴──────────────> ERRORED   (from STARTING, RUNNING or RESTARTING)

As in Ray Train v2's controller, :meth:`RunController.run` is one loop: the step of the current
state does its work and returns the next state, until a terminal one. Every transition is checked
against :data:`TRANSITIONS` (an illegal one is a bug in this module and raises
:class:`IllegalTransition`) and logged at ``verbose=2`` with the time spent in the state left; a
:class:`RunError` says in which state the run failed (``RunError.state``).

STARTING   the session is usable (not TLS unless allowed), enough task slots exist (waiting up
           to ``start_timeout`` on clusters whose executors may still be registering); job
           secret and id, the channel for output and status, the pickled function.
RUNNING    one barrier stage of ``num_proc`` tasks through ``mapInArrow(..., barrier=True)``
           (the same call for classic and Spark Connect sessions); a watchdog cancels it if the
           tasks do not all start within ``start_timeout``, another one if a task's heartbeats
           stop for ``heartbeat_timeout`` (its executor or machine is lost: Spark alone would
           wait for the lost task slots, resubmitting the barrier stage). Then each rank's
           pickled result, in rank order, and the ranks' last output lines.
RESTARTING the failed attempt's ranks are stopped and a new attempt is prepared, then RUNNING
           again. :meth:`RunController._after_failure` is where a retry policy would choose
           it over ERRORED; every failure is final here: a fit's retries
           (``estimators/_fit_retry.py``) call ``run`` again on the task slots free then, and
           ``run_elastic`` (``_elastic``) survives lost ranks without a restart.
FINISHED   the ranks' results (terminal).
ERRORED    the failing rank's report (its traceback) is the :class:`RunError`; the other tasks
           were told to stop their ranks, and the driver waited (bounded) until they did
           (terminal).
"""

from __future__ import annotations

import enum
import json
import os
import re
import secrets
import sys
import threading
import time

from spark_hvd.common import _bootstrap_contract as contract
from spark_hvd.common._secret import make_secret
from spark_hvd.launch.output import LineSink
from spark_hvd.spark import _session, _task
from spark_hvd.spark._channel import STDERR, STDOUT, DriverChannel
from spark_hvd.spark._errors import RunError

DEFAULT_START_TIMEOUT = 600.0
ALLOW_UNENCRYPTED_ENV = "SPARK_HVD_ALLOW_UNENCRYPTED"
ALLOW_UNENCRYPTED_CONF = "spark_hvd.allowUnencrypted"
# A task whose heartbeats stop this long is lost (its executor or machine went away); with the
# stop of the other ranks, a lost host fails the run within about this plus 5 s.
DEFAULT_HEARTBEAT_TIMEOUT = 10.0
HEARTBEAT_TIMEOUT_CONF = "spark_hvd.heartbeatTimeout"
# The interface the ranks' connections use, on every executor (the Spark configuration's
# counterpart of spark-hvd-run --network-interface).
NETWORK_INTERFACE_CONF = "spark_hvd.networkInterface"
RESULT_SCHEMA = "rank int, seq int, chunk binary"
# The driver's SPARK_HVD_* and HOROVOD_* variables reach the ranks (tuning such as
# SPARK_HVD_FUSION_THRESHOLD or HOROVOD_CYCLE_TIME), so a job configured on the driver behaves as
# under spark-hvd-run; these, the bootstrap variables and SPARK_HVD_SPARK_* stay on the driver.
_NOT_FORWARDED = {"SPARK_HVD_SPARK_DRIVER_ADDR", ALLOW_UNENCRYPTED_ENV}
# How long a failed run waits for the other ranks to be stopped before raising.
_STOP_WAIT_SECONDS = 10.0
# Failure kinds, most telling first: the root cause of a failed job is rarely the rank that
# lost its peer.
_KIND_ORDER = {"user": 0, "crash": 1, "internal": 2}


class State(enum.Enum):
    """Where one run is (see the module's diagram)."""
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    FINISHED = "finished"
    ERRORED = "errored"

    @property
    def terminal(self) -> bool:
        """True for the states a run ends in."""
        return self in (State.FINISHED, State.ERRORED)


# The states each state may be followed by (None: before the run starts).
TRANSITIONS: dict[State | None, frozenset[State]] = {
    None: frozenset({State.STARTING}),
    State.STARTING: frozenset({State.RUNNING, State.ERRORED}),
    State.RUNNING: frozenset({State.FINISHED, State.RESTARTING, State.ERRORED}),
    State.RESTARTING: frozenset({State.RUNNING, State.ERRORED}),
    State.FINISHED: frozenset(),
    State.ERRORED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """The controller tried a transition :data:`TRANSITIONS` does not have: a bug."""


def _name(state: State | None) -> str:
    return "not started" if state is None else state.value


def _start_timeout(value) -> float:
    if value is not None:
        return float(value)
    value = contract.setting("SPARK_START_TIMEOUT")
    return DEFAULT_START_TIMEOUT if value is None else float(value)


def _heartbeat_timeout(spark) -> float:
    """``$SPARK_HVD_SPARK_HEARTBEAT_TIMEOUT``, else the Spark configuration
    ``spark.spark_hvd.heartbeatTimeout``, else :data:`DEFAULT_HEARTBEAT_TIMEOUT` (seconds)."""
    value = contract.setting("SPARK_HEARTBEAT_TIMEOUT") or \
        _session.own_conf(spark, HEARTBEAT_TIMEOUT_CONF)
    seconds = DEFAULT_HEARTBEAT_TIMEOUT if value is None else float(value)
    if seconds <= 0:
        raise ValueError(f"the heartbeat timeout must be positive, got {value!r}")
    return seconds


def network_interface(spark, nics) -> str | None:
    """The ranks' ``SPARK_HVD_NETWORK_INTERFACE``: ``run``'s ``nics`` (Horovod's), else the
    Spark configuration ``spark.spark_hvd.networkInterface``; None leaves the variables the
    ranks get from the driver or ``env=`` as they are. Each rank resolves the name(s) on its
    own machine (the bootstrap: a comma list takes the first interface the machine has) and
    binds to, and advertises, that address."""
    if nics:
        names = sorted(nics) if isinstance(nics, (set, frozenset)) else list(nics)
        return ",".join(str(n).strip() for n in names)
    iface = _session.own_conf(spark, NETWORK_INTERFACE_CONF)
    return iface.strip() if iface and iface.strip() else None


def lost_ranks_message(lost: dict[int, dict], timeout: float) -> str:
    """``ranks [2, 3] on host 10.0.0.2 (node-2) were lost ...`` for ``{rank: heartbeat}``."""
    by_host: dict[str, list[int]] = {}
    for rank, beat in sorted(lost.items()):
        name = beat.get("host", "?")
        if beat.get("hostname") and beat["hostname"] != name:
            name += f" ({beat['hostname']})"
        by_host.setdefault(name, []).append(rank)
    where = "; ".join(f"rank{'s' if len(r) > 1 else ''} {r if len(r) > 1 else r[0]} on host "
                      f"{h}" for h, r in by_host.items())
    silent = max(beat.get("silent", 0.0) for beat in lost.values())
    tasks = "their Spark tasks" if len(lost) > 1 else "its Spark task"
    return (f"{where} {'were' if len(lost) > 1 else 'was'} lost: {tasks} sent no "
            f"heartbeat for {silent:.0f} s (heartbeat timeout {timeout:g} s, "
            f"spark.{HEARTBEAT_TIMEOUT_CONF}); the executor, or its machine, went away")


def forwarded_env(env: dict | None) -> dict[str, str]:
    """The variables the ranks get from the driver: its spark_hvd/Horovod tuning, then
    ``env`` (which wins). Bootstrap variables are the task's business and never forwarded."""
    out = {k: v for k, v in os.environ.items()
           if k.startswith(contract.ENV_PREFIXES) and k not in contract.BOOTSTRAP_VARS
           and k not in _NOT_FORWARDED and not k.startswith("SPARK_HVD_SPARK_")}
    for k, v in (env or {}).items():
        if not isinstance(k, str) or v is None:
            raise ValueError(f"env must map names to strings, got {k!r}: {v!r}")
        out[k] = str(v)
    return out


def check_ssl(spark) -> None:
    """Refuse a TLS-enabled cluster: the core's data plane is authenticated, not encrypted."""
    if not _session.ssl_enabled(spark):
        return
    allowed = (os.environ.get(ALLOW_UNENCRYPTED_ENV, "").strip().lower() in _session.TRUE
               or _session.own_flag(spark, ALLOW_UNENCRYPTED_CONF))
    if not allowed:
        raise RunError(
            "This Spark cluster has TLS enabled (spark.ssl.enabled=true), but spark_hvd's "
            "collectives are authenticated with the job secret, not encrypted: gradients and "
            "model state would cross the network in the clear. To run anyway, set the Spark "
            f"configuration spark.{ALLOW_UNENCRYPTED_CONF}=true or the environment variable "
            f"{ALLOW_UNENCRYPTED_ENV}=1 on the driver.")


def pick_failure(errors: dict[int, dict]) -> dict | None:
    """The report that explains a failed job: a rank whose ``fn`` raised, else one that died,
    else one that lost a peer; the earliest of a kind."""
    if not errors:
        return None
    return min(errors.values(),
               key=lambda e: (_KIND_ORDER.get(e.get("kind"), 9), e.get("time", 0), e["rank"]))


def failure_from_spark_error(text: str) -> tuple[int | None, str]:
    """(rank, message) of our marker in a Spark exception's text, when a task put it there."""
    m = re.search(re.escape(_task.FAILURE_MARKER) + r" (\d+)\] (.*)", text, re.S)
    if not m:
        return None, ""
    message = m.group(2)
    # Spark appends its own Java/Python frames after the Python exception; keep ours.
    message = re.split(r"\n\s*(?:SQLSTATE:|at org\.apache|\tat |JVM stacktrace:)", message)[0]
    return int(m.group(1)), message.strip()


def assemble_results(rows, num_proc: int) -> list:
    """Rank-ordered return values from the (rank, seq, chunk) rows."""
    import cloudpickle
    chunks: dict[int, list] = {}
    for row in rows:
        chunks.setdefault(row["rank"], []).append((row["seq"], row["chunk"]))
    missing = [r for r in range(num_proc) if r not in chunks]
    if missing:
        raise RunError(f"ranks {missing} returned no result")
    return [cloudpickle.loads(b"".join(bytes(c) for _, c in sorted(chunks[r])))
            for r in range(num_proc)]


def take_run_arguments(run, fn, args, kwargs, start_timeout, env, stdout, stderr, verbose, nics,
                       prefix_output_with_timestamp, executable, spark) -> None:
    """Keeps on ``run`` (a controller) the arguments ``run`` and ``run_elastic`` share."""
    run.fn, run.args, run.kwargs = fn, tuple(args), dict(kwargs or {})
    run.start_timeout = _start_timeout(start_timeout)
    run.env = forwarded_env(env)
    run.stdout = LineSink(stdout if stdout is not None else sys.stdout)
    run.stderr = LineSink(stderr if stderr is not None else sys.stderr)
    run.verbose = verbose
    run.nics = nics
    run.timestamp = prefix_output_with_timestamp
    run.executable = executable
    run.spark = spark


class RunController:
    """One call of ``spark_hvd.spark.run``."""

    def __init__(self, fn, args=(), kwargs=None, num_proc=None, start_timeout=None, env=None,
                 stdout=None, stderr=None, verbose=1, nics=None,
                 prefix_output_with_timestamp=False, executable=None, spark=None):
        take_run_arguments(self, fn, args, kwargs, start_timeout, env, stdout, stderr, verbose,
                           nics, prefix_output_with_timestamp, executable, spark)
        self.num_proc = num_proc
        self.state: State | None = None
        # The states left so far and the seconds spent in each, in order.
        self.history: list[tuple[State, float]] = []
        self.results: list | None = None   # FINISHED: the ranks' return values
        self.error: BaseException | None = None   # ERRORED: what run() raises
        self.channel = None
        # Drawn now, so that every line logged about this run names it.
        self.job_id = secrets.token_hex(4)
        self.spec: _task.TaskSpec | None = None
        self._entered_at = time.monotonic()
        self._done = threading.Event()
        self._start_timed_out = False
        self._start_missing: list[int] = []
        self.heartbeat_timeout = DEFAULT_HEARTBEAT_TIMEOUT
        # rank -> (its last heartbeat, when it changed on this clock); updated by the liveness
        # watch's thread and, after a failure, by the driver's (_lost_hosts_ranks): the lock
        # keeps one from iterating while the other adds a rank.
        self._beats: dict[int, tuple[bytes, float]] = {}
        self._beats_lock = threading.Lock()
        self._lost: dict[int, dict] = {}   # ranks found lost: rank -> its last heartbeat
        self._failing = False

    def log(self, message: str, level: int = 1) -> None:
        if self.verbose >= level:
            self.stderr.write_line(f"spark_hvd.spark: {message}\n".encode())

    def _enter(self, state: State) -> None:
        """Moves to ``state``; :class:`IllegalTransition` when the current state cannot be
        followed by it."""
        if state not in TRANSITIONS[self.state]:
            allowed = ", ".join(sorted(s.value for s in TRANSITIONS[self.state])) or "none"
            raise IllegalTransition(
                f"spark_hvd.spark.run controller (job {self.job_id}): {_name(self.state)} -> "
                f"{state.value} is not a transition (from {_name(self.state)}: {allowed})")
        now = time.monotonic()
        if self.state is not None:
            self.history.append((self.state, now - self._entered_at))
        self.log(f"job {self.job_id}: {_name(self.state)} -> {state.value}"
                 + (f" after {now - self._entered_at:.1f} s" if self.state else ""), level=2)
        self.state, self._entered_at = state, now

    # -- the loop and its steps -----------------------------------------------------------------

    def run(self) -> list:
        """Drives the run from STARTING to FINISHED (returns the ranks' results in rank order)
        or ERRORED (raises the run's error)."""
        steps = {State.STARTING: self._start, State.RUNNING: self._run_attempt}
        self._enter(State.STARTING)
        try:
            while not self.state.terminal:
                try:
                    following = steps[self.state]()
                except BaseException as e:  # noqa: BLE001 - raised again from ERRORED below
                    following = self._after_failure(e)
                self._enter(following)
        finally:
            self._done.set()
            if self.channel is not None:
                self.channel.close()
        if self.state is State.ERRORED:
            raise self.error
        spent = ", ".join(f"{state.value} {seconds:.1f} s" for state, seconds in self.history)
        self.log(f"{self.num_proc} ranks finished ({spent})", 2)
        return self.results

    def _start(self) -> State:
        self._check()
        self.spec = self._prepare()
        return State.RUNNING

    def _run_attempt(self) -> State:
        rows = self._run_stage(self.spec)
        self.results = assemble_results(rows, self.num_proc)
        if not self.channel.wait_output(timeout=5.0):
            self.log("some ranks' last output lines did not arrive")
        return State.FINISHED

    def _after_failure(self, error: BaseException) -> State:
        """The state after a step failed with ``error``. Every failure ends the run today;
        a fit's retries run a new ``run`` instead (``estimators/_fit_retry.py``), on the task
        slots free then."""
        self.error = error
        if isinstance(error, RunError):
            error.state = self.state.value
        self.log(f"job {self.job_id}: {type(error).__name__} while {self.state.value}", level=2)
        return State.ERRORED

    def _check(self) -> None:
        self.spark = spark = _session.active_session(self.spark)
        check_ssl(spark)
        if self.num_proc is None:
            self.num_proc = _session.default_num_proc(spark)
        self.num_proc = int(self.num_proc)
        if self.num_proc < 1:
            raise ValueError(f"num_proc must be at least 1, got {self.num_proc}")
        self.heartbeat_timeout = _heartbeat_timeout(spark)
        # How often each task reports: several times within the timeout, at most once a second.
        self.heartbeat_seconds = min(1.0, self.heartbeat_timeout / 5)
        iface = network_interface(spark, self.nics)
        if iface:
            self.env[contract.NETWORK_INTERFACE] = iface
        self._check_slots(spark)

    def _check_slots(self, spark) -> None:
        slots = _session.total_slots(spark)
        if slots is None or slots >= self.num_proc:
            return
        deadline = time.monotonic() + self.start_timeout
        next_note = time.monotonic() + 10
        while not _session.is_local_master(spark) and time.monotonic() < deadline:
            time.sleep(0.5)
            slots = _session.total_slots(spark)
            if slots is None or slots >= self.num_proc:
                return
            if time.monotonic() >= next_note:
                self.log(f"waiting for task slots: {slots} of {self.num_proc} available")
                next_note += 10
        master = _session.master(spark)
        waited = "" if _session.is_local_master(spark) else \
            f" after waiting {self.start_timeout:g} s (start_timeout)"
        gpus = _session.conf(spark, "spark.task.resource.gpu.amount")
        per_task = f", spark.task.resource.gpu.amount={gpus}" if gpus else ""
        raise RunError(
            f"spark_hvd.spark.run(num_proc={self.num_proc}) runs {self.num_proc} Spark tasks at "
            f"once (barrier mode), but the cluster offers {slots} task slot(s){waited} "
            f"(master {master}, spark.task.cpus={_session.task_cpus(spark)}{per_task}). Lower "
            "num_proc, or give the application more executors or cores"
            + (" or GPUs (a fractional spark.task.resource.gpu.amount, e.g. 0.5, lets tasks "
               "share one)" if gpus else "")
            + ("." if _session.is_local_master(spark)
               else ", or raise start_timeout if executors are still starting."))

    def _prepare(self) -> _task.TaskSpec:
        import cloudpickle
        secret = make_secret()
        bind, advertise = _session.channel_hosts(self.spark)
        self.channel = DriverChannel(self.job_id, secret, self.num_proc, bind, advertise,
                                     {STDOUT: self.stdout, STDERR: self.stderr})
        try:
            payload = cloudpickle.dumps((self.fn, self.args, self.kwargs))
        except Exception as e:
            raise RunError(f"cannot pickle fn and its arguments for the Spark tasks: {e}") from e
        return _task.TaskSpec(
            job_id=self.job_id, secret=secret, num_proc=self.num_proc, payload=payload,
            channel_addr=self.channel.addr, start_timeout=self.start_timeout, env=self.env,
            timestamp=self.timestamp, executable=self.executable, verbose=self.verbose,
            heartbeat_seconds=self.heartbeat_seconds)

    def _run_stage(self, spec: _task.TaskSpec):
        spark = self.spark
        n = self.num_proc
        tag = f"spark_hvd_{self.job_id}"
        df = spark.range(0, n, 1, n).mapInArrow(_task.mapper(spec), RESULT_SCHEMA,
                                                 barrier=True)
        threading.Thread(target=self._watch_start, args=(tag,), daemon=True,
                         name="spark-hvd-start-watch").start()
        threading.Thread(target=self._watch_liveness, args=(tag,), daemon=True,
                         name="spark-hvd-liveness-watch").start()
        try:
            with _session.tagged_jobs(spark, tag):
                return df.collect()
        except KeyboardInterrupt:
            self.channel.abort("the driver was interrupted")
            self._interrupt(tag)
            raise
        except Exception as e:  # noqa: BLE001 - Py4J, Connect and Spark errors alike
            raise self._failure(e) from e

    def _interrupt(self, tag: str) -> None:
        _session.cancel_tagged(self.spark, tag)

    def _watch_start(self, tag: str) -> None:
        """Cancel the stage when the tasks do not all start within ``start_timeout``."""
        try:
            started = self.channel.wait_all("started", self.start_timeout, stop=self._done)
        except RuntimeError:
            return  # the run ended (the channel is closed)
        if self._done.is_set():
            return
        if len(started) == self.num_proc:
            self.log(f"all {self.num_proc} tasks started", level=2)
            return
        if not started and _session.is_connect(self.spark):
            # A Connect client may be unreachable from the executors: then no task can say it
            # started, and cancelling would break a run that works.
            self.log(f"no task has reported after {self.start_timeout:g} s (start_timeout): "
                     "either the cluster has too few free task slots or the executors cannot "
                     f"reach this client at {self.channel.addr}")
            return
        self._start_timed_out = True
        self._start_missing = sorted(set(range(self.num_proc)) - started)
        self.channel.abort("the job did not start in time")
        self._interrupt(tag)

    def _watch_liveness(self, tag: str) -> None:
        """Cancel the stage when a running task's heartbeats stop for ``heartbeat_timeout``
        (its rank can report nothing: the executor or its machine is gone). Bounded on its own,
        whatever the surviving ranks' collectives and Spark's scheduler do."""
        try:
            client = self.channel.client()
        except RuntimeError:
            return
        with client:
            # Once the stage is failing Spark kills tasks itself: silence means nothing more.
            while not (self._done.wait(0.25) or self._failing):
                try:
                    lost = self._silent_ranks(client, self.heartbeat_timeout)
                    if lost:
                        lost = self._with_host_mates(client, lost)
                except RuntimeError:
                    return  # the run ended (the channel is closed)
                if lost and not (self._done.is_set() or self._failing):
                    self._lost = lost
                    self.log(lost_ranks_message(lost, self.heartbeat_timeout))
                    self.channel.abort("ranks were lost")
                    self._interrupt(tag)
                    return

    def _silent_ranks(self, client, seconds: float) -> dict[int, dict]:
        """Ranks whose task neither ended nor reported, with no new heartbeat for ``seconds``
        (this clock): rank -> its last heartbeat and ``silent`` seconds. Updates the record of
        heartbeats."""
        beats = self.channel.ranks_with("alive", client=client)
        now = time.monotonic()
        with self._beats_lock:
            for rank, value in beats.items():
                if self._beats.get(rank, (None,))[0] != value:
                    self._beats[rank] = (value, now)
            quiet = {rank: (value, since) for rank, (value, since) in self._beats.items()
                     if now - since > seconds}
        if not quiet:
            return {}
        # Only the quiet ranks' ends are read: one store round trip per rank per poll otherwise.
        over = set(self.channel.ranks_with("stopped", quiet, client=client))
        over |= set(self.channel.ranks_with("error", quiet, client=client))
        return {rank: {**json.loads(value), "silent": now - since}
                for rank, (value, since) in quiet.items() if rank not in over}

    def _with_host_mates(self, client, lost: dict[int, dict]) -> dict[int, dict]:
        """``lost`` and the silent ranks of the same hosts: a host's ranks go silent together,
        but their last heartbeats are up to an interval apart, so the timeout catches the
        first alone (the stage then ends at once, and the others would go unnamed)."""
        hosts = {beat.get("host") for beat in lost.values()}
        mates = self._silent_ranks(client, 3 * self.heartbeat_seconds)
        return {**{r: b for r, b in mates.items() if b.get("host") in hosts}, **lost}

    def _failure(self, error: Exception) -> RunError:
        """The RunError for a failed stage, once the other ranks were told to stop."""
        # From now on Spark may kill tasks itself (their heartbeats stop too): the liveness
        # watch no longer takes silence for a lost host.
        self._failing = True
        if self._start_timed_out:
            missing = self._start_missing
            return RunError(
                f"only {self.num_proc - len(missing)} of {self.num_proc} Spark tasks started "
                f"within start_timeout={self.start_timeout:g} s (ranks {missing} did not): the "
                "cluster has fewer free task slots than num_proc, or the executors are busy. "
                "Lower num_proc, free or add executors, or raise start_timeout.")
        report = pick_failure(self.channel.errors())
        self.channel.abort(f"rank {report['rank']} failed" if report else "the Spark job failed")
        # Return once the other ranks are gone (their tasks kill them at the abort), so that
        # the caller can rely on a clean slate; bounded, since Spark kills the rest anyway.
        # Lost ranks cannot stop: they are not waited for.
        started = set(self.channel.ranks_with("started")) - set(self._lost)
        self.channel.wait_all("stopped", _STOP_WAIT_SECONDS, ranks=started)
        self.channel.wait_output(timeout=2.0)  # their last lines (tracebacks) before ours
        # Reports that came in meanwhile may tell more (the rank that raised, where the first
        # one to fail only lost its peer).
        errors = self.channel.errors()
        report = pick_failure(errors)
        # Watching silent ranks for the heartbeat timeout only pays where the survivors merely
        # lost their peers: a rank that raised is the cause whatever else was lost.
        lost = self._lost or self._lost_hosts_ranks(
            wait=report is None or report["kind"] == "internal")
        if lost and (report is None or report["kind"] == "internal"):
            # The lost host is the cause; the survivors only lost their peers.
            message = lost_ranks_message(lost, self.heartbeat_timeout)
            if report is not None:
                message += (f"; then rank {report['rank']} (host {report['host']}) failed: "
                            f"{report['summary']}\n\n{report['detail']}")
            first = min(lost)
            return RunError(message, rank=first, host=lost[first].get("host"), kind="lost",
                            detail=message, lost_ranks=sorted(lost))
        if report is not None:
            others = sorted(r for r in errors if r != report["rank"])
            also = f" (ranks {others} failed after it)" if others else ""
            message = (f"rank {report['rank']} (host {report['host']}) failed{also}: "
                       f"{report['summary']}\n\n{report['detail']}")
            self.log(f"rank {report['rank']} failed: {report['summary']}")
            return RunError(message, rank=report["rank"], host=report["host"],
                            kind=report["kind"], detail=report["detail"],
                            lost_ranks=sorted(lost) or None)
        rank, message = failure_from_spark_error(str(error))
        if rank is not None:
            return RunError(f"rank {rank} failed: {message}", rank=rank, detail=message)
        first = str(error).strip().splitlines()
        return RunError("the Spark job of spark_hvd.spark.run failed: "
                        + (first[0] if first else type(error).__name__))

    def _unaccounted_ranks(self, client) -> set[int]:
        """Ranks that started but neither stopped nor reported an error."""
        started = set(self.channel.ranks_with("started", client=client))
        stopped = set(self.channel.ranks_with("stopped", client=client))
        return started - stopped - set(self.channel.errors())

    def _lost_hosts_ranks(self, wait: bool) -> dict[int, dict]:
        """When the stage failed before the liveness watch's timeout: the ranks that, after
        the others were given time to stop, neither ended nor reported and whose heartbeats
        stopped, either for three intervals with no live executor left on their host, or for
        the whole heartbeat timeout (Spark may not have noticed the lost executor yet: the
        verdict the liveness watch would have given). With ``wait``, silent ranks are watched
        until one of the two holds or they speak again, bounded by the heartbeat timeout;
        without, only the first counts. Under Spark Connect, whose client cannot list
        executors, three intervals of silence alone."""
        deadline = time.monotonic() + self.heartbeat_timeout
        try:
            with self.channel.client() as client:
                while True:
                    silent = self._silent_ranks(client, 3 * self.heartbeat_seconds)
                    if not silent:
                        # Spark can fail the stage (a dead executor's tasks) sooner than a
                        # rank's heartbeats are three intervals old: ranks that started and
                        # neither stopped nor reported are watched until they are.
                        if wait and self._unaccounted_ranks(client) \
                                and time.monotonic() < deadline:
                            time.sleep(0.25)
                            continue
                        return {}
                    hosts = _session.executor_hosts(self.spark)
                    if hosts is None:
                        return silent
                    lost = {r: beat for r, beat in silent.items()
                            if beat.get("host") not in hosts
                            or beat["silent"] >= self.heartbeat_timeout}
                    if not wait or len(lost) == len(silent) or time.monotonic() >= deadline:
                        return lost
                    time.sleep(0.25)
        except RuntimeError:
            return {}
