"""The driver side of ``spark_hvd.spark.run_elastic``: the elastic driver of ``spark-hvd-run``
(``launch/elastic``), with Spark slot tasks for processes.

A barrier stage cannot lose a task and go on, so an elastic run has none. Instead:

- ``max_num_proc`` *slot jobs*, each a one-task, non-barrier Spark job submitted from a driver
  thread of its own (:class:`SlotJobs`). Each task registers with the driver as a place a
  worker can run (``_slot_task``); a job whose task is still pending is what makes dynamic
  allocation ask for executors. Spark runs the task of a lost executor again (a new attempt,
  wherever it has room, is a new slot), and a slot job that ended is submitted again while the
  run goes on.
- Discovery (:class:`SparkSlots`) lists the registered slot tasks by executor ("hosts", as
  ``spark.run`` counts them); the elastic driver plans rounds over them as over
  ``spark-hvd-run``'s hosts, and :class:`SparkSlotSpawner` starts each worker it asks for in an
  idle slot task on that executor.
- The driver's store is ``spark.run``'s channel (``_channel.DriverChannel``) with the elastic
  hooks: the workers' joins, notices, reports and liveness connections, the slot tasks'
  registrations, exits, results and liveness connections, and their output lines, which get
  the worker's current rank in front here.

A lost executor takes its slot tasks and workers with it: their liveness connections close (or
time out after the peer timeout, for a silent machine), the survivors' collective fails, and the
driver re-forms the job without them (a reset); the task Spark runs again joins at the next
reset, up to ``max_num_proc``.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading
import time

from spark_hvd.common import _bootstrap_contract as contract
from spark_hvd.common._secret import make_secret
from spark_hvd.launch.elastic.driver import ElasticDriver, Spawner, StoreChannel, worker_event
from spark_hvd.launch.elastic.hosts import HostDiscovery, HostManager
from spark_hvd.launch.elastic.policy import FailurePolicy
from spark_hvd.launch.output import LineSink, line_prefix
from spark_hvd.spark import _session, _slot_task
from spark_hvd.spark._channel import STDERR, STDOUT, DriverChannel
from spark_hvd.spark._controller import check_ssl, network_interface, take_run_arguments
from spark_hvd.spark._errors import RunError

# The core's default (docs/multi-host.md, "the failure bounds"): a silent slot task or worker is lost after it.
DEFAULT_PEER_TIMEOUT_SECONDS = 25.0
# How often discovery is asked again (a blacklisted executor comes back after its cooldown).
DISCOVER_SECONDS = 1.0
# A slot job that ended is submitted again after this long, while the run goes on.
RESUBMIT_SECONDS = 1.0
# At the end, idle slot tasks are told to stop, and the slot jobs still there (pending ones:
# Spark had no room for them) cancelled after this long. Every result is in by then.
_END_WAIT_SECONDS = 2.0
_TASK_LINE = b"spark_hvd.spark: "


@dataclasses.dataclass
class Sizes:
    """How many processes an elastic run starts with, needs at least and uses at most, and
    where the numbers came from (for the log)."""
    num_proc: int
    min_np: int
    max_np: int
    source: str


def _int(conf: dict, key: str, default: int | None = None) -> int | None:
    value = conf.get(key)
    if value is None or str(value).strip() == "":
        return default
    return int(str(value).strip())


def elastic_sizes(num_proc, min_np, max_np, conf: dict, default_parallelism) -> Sizes:
    """``run_elastic``'s sizes: the arguments given, else from Spark's dynamic allocation
    (Horovod #2023), else Horovod's defaults.

    With ``spark.dynamicAllocation.enabled``, each executor holds ``spark.executor.cores //
    spark.task.cpus`` slots (``spark.executor.cores`` unset: 1, YARN's and Kubernetes' default):
    ``num_proc`` = the executors Spark starts with (the largest of ``initialExecutors``,
    ``minExecutors`` and ``spark.executor.instances``, as Spark itself counts) times that, at
    least 1; ``min`` = ``minExecutors`` times that, at least 1; ``max`` = ``maxExecutors``
    times that when it is set. Otherwise (Horovod's): ``num_proc`` =
    ``default_parallelism()`` (``spark.default.parallelism``), ``min`` = ``max`` = ``num_proc``.
    A ``max`` left unset is ``max(num_proc, min)``: every slot is a Spark job of its own, so
    the number must be finite. ``conf`` maps Spark configuration keys to their values (the
    ones set)."""
    dynamic = str(conf.get("spark.dynamicAllocation.enabled", "false")).strip().lower() in \
        _session.TRUE
    derived = {}
    source = "given"
    if dynamic:
        cores = _int(conf, "spark.executor.cores", 1)
        cpus = _int(conf, "spark.task.cpus", 1)
        slots = max(1, cores // max(1, cpus))
        lowest = _int(conf, "spark.dynamicAllocation.minExecutors", 0)
        first = max(lowest, _int(conf, "spark.dynamicAllocation.initialExecutors", 0),
                    _int(conf, "spark.executor.instances", 0))
        derived["num_proc"] = max(1, first * slots)
        derived["min_np"] = max(1, lowest * slots)
        highest = _int(conf, "spark.dynamicAllocation.maxExecutors")
        if highest is not None and highest < 2 ** 31 - 1:
            derived["max_np"] = max(1, highest * slots)
        source = (f"spark.dynamicAllocation (executors: min {lowest}, initial {first}, max "
                  f"{highest if 'max_np' in derived else 'unbounded'}; {slots} slot(s) each)")
    given = {"num_proc": num_proc, "min_np": min_np, "max_np": max_np}
    if num_proc is None and "num_proc" not in derived:
        derived["num_proc"] = int(default_parallelism())
        source = "spark.default.parallelism"
    n = int(num_proc if num_proc is not None else derived["num_proc"])
    if min_np is None:
        low = derived.get("min_np", n)
        if dynamic and num_proc is not None:
            low = min(low, n)
    else:
        low = int(min_np)
    if max_np is None:
        high = derived.get("max_np", max(n, low))
        if dynamic and num_proc is not None:
            high = max(high, n)
    else:
        high = int(max_np)
    if all(v is not None for v in given.values()):
        source = "given"
    if low < 1:
        raise ValueError(f"run_elastic: min_num_proc must be at least 1, got {low}")
    if n < low:
        raise ValueError(f"run_elastic: num_proc={n} is below min_num_proc={low}")
    if high < n:
        raise ValueError(f"run_elastic: max_num_proc={high} is below num_proc={n}")
    return Sizes(n, low, high, source)


class SparkSlots(HostDiscovery):
    """Discovery: the slot tasks that registered and still hold their connection, counted by
    executor (``{executor key: tasks}``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.tasks: dict[str, dict] = {}

    def add(self, key: str, info: dict) -> None:
        with self._lock:
            self.tasks[key] = info

    def remove(self, key: str) -> dict | None:
        with self._lock:
            return self.tasks.pop(key, None)

    def host_of(self, key: str) -> str | None:
        with self._lock:
            info = self.tasks.get(key)
            return info["host"] if info else None

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = {}
            for info in self.tasks.values():
                out[info["host"]] = out.get(info["host"], 0) + 1
            return out


class SparkSlotSpawner(Spawner):
    """Starts each worker the driver asks for in an idle slot task of its executor (or the next
    one that registers there), and tells the driver when a worker's task reports its exit or
    is lost."""

    def __init__(self, server, scope: str, slots: SparkSlots, post):
        self.server, self.scope, self.slots, self.post = server, scope, slots, post
        self._lock = threading.Lock()
        self.worker_of: dict[str, str] = {}     # slot task key -> worker id
        self.task_of: dict[str, str] = {}       # worker id -> slot task key
        self.pending: dict[str, list] = {}      # executor -> specs waiting for a slot task
        self._ended: set[str] = set()           # workers whose exit was told to the driver
        self._gone: set[str] = set()            # slot tasks that ended or were lost

    def _give(self, key: str, spec) -> None:
        self.worker_of[key], self.task_of[spec.wid] = spec.wid, key
        work = {"wid": spec.wid, "host": spec.host, "slot": spec.slot, "seq": spec.seq,
                "planned": dataclasses.asdict(spec.planned)}
        self.server.put(self.scope, f"work/{key}", json.dumps(work).encode())

    def _idle(self, host: str) -> str | None:
        for key, info in list(self.slots.tasks.items()):
            if info["host"] == host and key not in self.worker_of and key not in self._gone:
                return key
        return None

    def spawn(self, spec) -> None:
        with self._lock:
            key = self._idle(spec.host)
            if key is None:
                self.pending.setdefault(spec.host, []).append(spec)
            else:
                self._give(key, spec)

    def registered(self, key: str, host: str) -> None:
        with self._lock:
            waiting = self.pending.get(host)
            if waiting and key not in self.worker_of:
                self._give(key, waiting.pop(0))

    def stop(self, wid: str) -> None:
        with self._lock:
            key = self.task_of.get(wid)
            if key is None:
                for specs in self.pending.values():
                    for spec in list(specs):
                        if spec.wid == wid:
                            specs.remove(spec)
                            self._ended.add(wid)
                            self.post(("exited", wid, 0, "exit"))  # it never started
                return
        self.server.put(self.scope, f"stop/{key}", b"stop")

    def task_exited(self, key: str, code) -> None:
        """The slot task ``key`` reports its worker's exit code."""
        with self._lock:
            wid = self.worker_of.get(key)
            if wid is None or wid in self._ended:
                return
            self._ended.add(wid)
        code = None if code is None else int(code)
        self.post(("exited", wid, code, "signal" if code is not None and code < 0 else "exit"))

    def task_gone(self, key: str, how: str) -> None:
        """The slot task's connection closed or timed out: if its worker's exit was not
        reported, the worker went with it (its executor, or the machine, is lost)."""
        with self._lock:
            self._gone.add(key)
            wid = self.worker_of.get(key)
            if wid is None or wid in self._ended:
                return
            self._ended.add(wid)
        why = ("silent for the peer timeout, SPARK_HVD_PEER_TIMEOUT_SECONDS" if how == "timeout"
               else how)
        self.post(("exited", wid, None,
                   f"its Spark task was lost with its executor or machine ({why})"))

    def idle_tasks(self) -> list[str]:
        with self._lock:
            return [k for k in self.slots.tasks if k not in self.worker_of
                    and k not in self._gone]


class _RankLines:
    """A worker's output stream on the driver: each line with the worker's current rank in
    front (the slot task's own lines as they are)."""

    def __init__(self, sink: LineSink, rank_of, stream_name: str, timestamp: bool):
        self.sink, self.rank_of, self.stream_name, self.timestamp = (sink, rank_of, stream_name,
                                                                     timestamp)

    def write_line(self, line: bytes) -> None:
        if not line.startswith(_TASK_LINE):
            line = line_prefix(self.rank_of(), self.stream_name, self.timestamp) + line
        self.sink.write_line(line)


class SlotJobs:
    """``count`` slot jobs, each submitted from a thread of its own and submitted again when it
    ends, while ``running()``; all under one job tag, so :meth:`cancel` ends them."""

    def __init__(self, spark, mapper, count: int, tag: str, running, log):
        self.spark, self.mapper, self.count, self.tag = spark, mapper, count, tag
        self.running, self.log = running, log
        self.threads: list[threading.Thread] = []
        self.submitted = 0

    def start(self) -> None:
        for k in range(self.count):
            t = threading.Thread(target=self._loop, args=(k,), daemon=True,
                                 name=f"spark-hvd-slot-job-{k}")
            self.threads.append(t)
            t.start()

    def _loop(self, k: int) -> None:
        while self.running():
            self.submitted += 1
            try:
                with _session.tagged_jobs(self.spark, self.tag):
                    self.spark.range(0, 1, 1, 1).mapInArrow(self.mapper, "x int").collect()
            except Exception as e:  # noqa: BLE001 - Py4J, Connect and Spark errors alike
                if self.running():
                    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                    self.log(f"slot job {k} failed ({first[:300]}); submitting it again",
                             "WARNING")
            deadline = time.monotonic() + RESUBMIT_SECONDS
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.1)

    def cancel(self) -> None:
        _session.cancel_tagged(self.spark, self.tag)

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)


class ElasticRunController:
    """One call of ``spark_hvd.spark.run_elastic`` (see the module's docstring).

    ``on_reset(number, cause, size, seconds)`` is called after each reset's round formed
    (estimators report their resets with it); :attr:`resets` lists them too.
    """

    def __init__(self, fn, args=(), kwargs=None, num_proc=None, min_np=None, max_np=None,
                 start_timeout=None, elastic_timeout=None, reset_limit=None, env=None,
                 stdout=None, stderr=None, verbose=1, nics=None,
                 prefix_output_with_timestamp=False, cooldown_range=None, executable=None,
                 spark=None, on_reset=None):
        take_run_arguments(self, fn, args, kwargs, start_timeout, env, stdout, stderr, verbose,
                           nics, prefix_output_with_timestamp, executable, spark)
        self.requested = (num_proc, min_np, max_np)
        self.elastic_timeout = (float(elastic_timeout) if elastic_timeout is not None
                                else contract.elastic_timeout())
        self.reset_limit = reset_limit
        self.cooldown_range = cooldown_range
        self.on_reset = on_reset
        self.job_id = secrets.token_hex(4)
        self.sizes: Sizes | None = None
        self.resets: list[dict] = []
        self.driver: ElasticDriver | None = None
        self.slot_jobs: SlotJobs | None = None
        self.channel_addr = None
        self._last_line = None
        self._done = threading.Event()

    def log(self, message: str, level: str = "INFO") -> None:
        wanted = {"ERROR": 0, "WARNING": 1, "INFO": 1, "DEBUG": 2}.get(level, 1)
        # The driver says "waiting for slots" at every discovery until they come: once will do.
        if self.verbose >= wanted and message != self._last_line:
            self._last_line = message
            self.stderr.write_line(f"spark_hvd.spark: {message}\n".encode())

    def _reset_happened(self, number, cause, size, seconds) -> None:
        self.resets.append({"reset": number, "cause": cause, "size": size, "seconds": seconds})
        if self.on_reset is not None:
            self.on_reset(number, cause, size, seconds)

    def _running(self) -> bool:
        d = self.driver
        return not self._done.is_set() and (d is None or d.state in ("STARTING", "RUNNING",
                                                                     "RESETTING"))

    def run(self) -> list:
        spark = self.spark = _session.active_session(self.spark)
        check_ssl(spark)
        conf = _session.dynamic_allocation_conf(spark)
        self.sizes = sizes = elastic_sizes(*self.requested, conf,
                                           lambda: _session.default_num_proc(spark))
        slots = _session.total_slots(spark)
        if _session.is_local_master(spark) and slots is not None and slots < sizes.num_proc:
            # A local master never gains executors: say so now, not after start_timeout.
            raise RunError(f"spark_hvd.spark.run_elastic(num_proc={sizes.num_proc}) starts "
                           f"{sizes.num_proc} Spark tasks at once, but this local master "
                           f"({_session.master(spark)}) offers {slots} task slot(s). Lower "
                           "num_proc.", state="starting")
        self.log(f"elastic job {self.job_id}: {sizes.num_proc} process(es) to start, min "
                 f"{sizes.min_np}, max {sizes.max_np} ({sizes.source})")
        iface = network_interface(spark, self.nics)
        if iface:
            self.env[contract.NETWORK_INTERFACE] = iface
        try:
            import cloudpickle
            payload = cloudpickle.dumps((self.fn, self.args, self.kwargs))
        except Exception as e:
            raise RunError(f"cannot pickle fn and its arguments for the Spark tasks: {e}") from e
        peer_timeout = float(contract.setting("PEER_TIMEOUT_SECONDS", self.env)
                             or DEFAULT_PEER_TIMEOUT_SECONDS)
        secret = make_secret()
        elastic_scope = contract.elastic_scope(self.job_id)
        slots_scope = _slot_task.slots_scope(self.job_id)
        slots = SparkSlots()
        box: dict = {}

        def post(event):
            box["driver"].post(event)

        def on_put(scope, key, value):
            if scope == elastic_scope:
                event = worker_event(key, value)
                if event is not None:
                    post(event)
            elif scope == slots_scope:
                kind, _, task = key.partition("/")
                if kind == "task":
                    info = json.loads(value)
                    slots.add(task, info)
                    box["channel"].follow(task, self._sinks(task, box))
                    box["spawner"].registered(task, info["host"])
                    if info["attempt"] > 0:
                        self.log(f"Spark runs a lost slot task again (attempt "
                                 f"{info['attempt'] + 1}) on {info['host']}: its worker joins "
                                 "at the next reset")
                    else:
                        self.log(f"slot task {task} registered on {info['host']}", "DEBUG")
                    post(("discovered", slots.find_available_hosts_and_slots()))
                elif kind == "exited":
                    box["spawner"].task_exited(task, json.loads(value).get("code"))

        def on_hello(ident):
            if not ident.startswith("slot:"):
                post(("hello", ident))

        def on_disconnect(ident, how):
            if ident.startswith("slot:"):
                key = ident[len("slot:"):]
                box["spawner"].task_gone(key, how)
                if slots.remove(key) is not None and how != "server stopped":
                    post(("discovered", slots.find_available_hosts_and_slots()))
            else:
                post(("disconnected", ident, how))

        bind, advertise = _session.channel_hosts(spark)
        channel = box["channel"] = DriverChannel(
            self.job_id, secret, 0, bind, advertise, {STDOUT: self.stdout, STDERR: self.stderr},
            on_put=on_put, on_hello=on_hello, on_disconnect=on_disconnect,
            peer_timeout=peer_timeout)
        self.channel_addr = channel.addr
        spawner = box["spawner"] = SparkSlotSpawner(channel.server, slots_scope, slots, post)
        # A worker killed on a live executor does not make the executor a bad place: its
        # slot job is submitted again and runs the next worker there (a lost executor is
        # never back: its id is not reused).
        policy = FailurePolicy(reset_limit=self.reset_limit, min_np=sizes.min_np,
                               elastic_timeout=self.elastic_timeout,
                               process_lost_blacklists=False)
        hosts = HostManager(slots, cooldown_range=self.cooldown_range)
        driver = self.driver = box["driver"] = ElasticDriver(
            hosts, spawner, StoreChannel(channel.server, elastic_scope),
            num_proc=sizes.num_proc, min_np=sizes.min_np, max_np=sizes.max_np, policy=policy,
            elastic_timeout=self.elastic_timeout, start_timeout=self.start_timeout,
            log=self.log, on_reset=self._reset_happened)
        spec = _slot_task.SlotSpec(
            job_id=self.job_id, secret=secret, channel_addr=channel.addr, payload=payload,
            start_timeout=self.start_timeout, elastic_timeout=self.elastic_timeout,
            env=self.env, executable=self.executable, verbose=self.verbose,
            peer_timeout=peer_timeout)
        self.slot_jobs = SlotJobs(spark, _slot_task.mapper(spec), sizes.max_np,
                                  f"spark_hvd_{self.job_id}", self._running, self.log)
        driver.post(("discovered", {}))
        try:
            self.slot_jobs.start()
            for target in (self._discover, self._watch_start):
                threading.Thread(target=target, args=(slots,), daemon=True,
                                 name=f"spark-hvd-elastic-{target.__name__[1:]}").start()
            outcome = driver.run(wind_down=15.0)
        finally:
            self._done.set()
            self._end(spawner, channel)
        if not outcome.ok:
            raise self._error(outcome)
        return self._results(outcome, channel.server, slots_scope)

    def _sinks(self, key: str, box: dict) -> dict:
        def rank_of():
            wid = box["spawner"].worker_of.get(key)
            w = box["driver"].workers.get(wid) if wid else None
            if w is None:
                return "?"
            return w.rank if w.rank is not None else w.spec.planned.rank
        return {STDOUT: _RankLines(self.stdout, rank_of, "stdout", self.timestamp),
                STDERR: _RankLines(self.stderr, rank_of, "stderr", self.timestamp)}

    def _discover(self, slots: SparkSlots) -> None:
        while not self._done.wait(DISCOVER_SECONDS):
            self.driver.post(("discovered", slots.find_available_hosts_and_slots()))

    def _watch_start(self, slots: SparkSlots) -> None:
        """Fail the run when too few slot tasks start within ``start_timeout``: the cluster
        has too few free task slots, or (Spark Connect) the executors cannot reach us."""
        deadline = time.monotonic() + self.start_timeout
        while not self._done.wait(0.25):
            if self.driver.round >= 1:
                return
            if time.monotonic() >= deadline:
                started = len(slots.tasks)
                if started >= self.sizes.num_proc:
                    return  # the driver bounds the workers' start itself
                self.driver.post(("fail", (
                    f"only {started} of {self.sizes.num_proc} Spark slot tasks started within "
                    f"start_timeout={self.start_timeout:g} s: the cluster has fewer free task "
                    "slots than num_proc (lower num_proc, add executors or raise "
                    "start_timeout), or its executors cannot reach this driver at "
                    f"{self.channel_addr}")))
                return

    def _end(self, spawner: SparkSlotSpawner, channel: DriverChannel) -> None:
        """Release the idle slot tasks, give the slot jobs a moment to end, cancel the rest."""
        for key in spawner.idle_tasks():
            channel.server.put(spawner.scope, f"work/{key}",
                               json.dumps({"stop": "the run is over"}).encode())
        if self.slot_jobs is not None:
            if not self.slot_jobs.join(_END_WAIT_SECONDS):
                self.slot_jobs.cancel()
                self.slot_jobs.join(10.0)
        channel.close()

    def _error(self, outcome) -> RunError:
        for w in self.driver.workers.values():
            report = w.error
            if report and report.get("kind") == "user":
                rank = w.rank if w.rank is not None else report.get("rank")
                return RunError(f"spark_hvd.spark.run_elastic: {outcome.error}", rank=rank,
                                host=w.host, kind="user", detail=report.get("traceback"),
                                state="running")
        return RunError(f"spark_hvd.spark.run_elastic: {outcome.error}", kind="lost",
                        detail=outcome.error, state="running" if outcome.rounds else "starting")

    def _results(self, outcome, server, scope) -> list:
        import cloudpickle
        if outcome.members:
            order = outcome.members
        else:  # no worker called init(): each is collected by the rank it was started for
            order = sorted((w for w in outcome.spawn_ranks
                            if server.get_nowait(scope, f"result/{w}/n") is not None),
                           key=outcome.spawn_ranks.get)
        results = []
        for rank, wid in enumerate(order):
            count = server.get_nowait(scope, f"result/{wid}/n")
            if count is None:
                raise RunError(f"spark_hvd.spark.run_elastic: rank {rank} ({wid}) returned no "
                               "result", rank=rank, kind="crash")
            data = b"".join(server.get_nowait(scope, f"result/{wid}/{i}")
                            for i in range(int(count)))
            results.append(cloudpickle.loads(data))
        return results
