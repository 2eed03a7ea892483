"""What each Spark barrier task of ``spark_hvd.spark.run`` does (runs in the Python worker).

1. Learn its place: ranks are host-major over the executors of ``getTaskInfos()``; GPUs come
   from ``resources()['gpu']``.
2. Start a rendezvous server on 127.0.0.1 for its rank only, and spawn the rank: a child Python
   process with the launcher's bootstrap environment pointing at that server. The rank is then
   exactly a launcher-started process (one bootstrap for every way a job starts).
3. Proxy the rank's rendezvous rounds through ``BarrierTaskContext.allGather``: when the rank's
   ``hvd.init()`` puts its "host port host_id" line into the local server, the task gathers
   every task's line and puts the other ranks' lines there too, so the rank's
   ``KVRendezvous.allgather`` completes. The ranks then connect directly, authenticated by the
   job secret. A later ``init()`` after ``shutdown()`` is another round.
4. Forward the rank's output to the driver, then return its pickled result as rows.
5. Meanwhile, tell the driver every ``heartbeat_seconds`` that the task lives (``alive``): a
   task whose executor or machine is lost cannot report anything, and the driver names its
   ranks and host when the heartbeats stop (see ``_controller``).

Spark requires every task to call ``allGather`` equally often, and each call costs about a
second (Spark polls for its completion once a second), so there is one call per ``init()`` and
none other. A rank that calls ``init()`` once more than another would leave that call waiting
forever: a task whose rank returns says so through the driver's channel, and a task still in a
round then fails with a clear message. If a rank fails, its task does not wait for anything: it
reports the error to the driver, which tells every other task to stop its rank, and fails the
Spark task, which makes Spark abort the barrier stage.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

from spark_hvd.common import _bootstrap_contract as contract
from spark_hvd.common._rendezvous import KVClient, RendezvousServer
from spark_hvd.common._secret import secret_to_env
from spark_hvd.launch import function_rank
from spark_hvd.launch.environment import rank_env
from spark_hvd.launch.hosts import SlotInfo
from spark_hvd.launch.output import forward
from spark_hvd.launch.spawn import spawn
from spark_hvd.launch.supervise import describe_exit, group_alive
from spark_hvd.spark import _placement
from spark_hvd.spark._channel import TaskChannel

# Marks the message of a Spark task failure that carries a rank's error, so the driver can find
# it in Spark's exception when the channel to the driver was not available.
FAILURE_MARKER = "spark_hvd rank failure"
# Variables of the Python worker that belong to Spark's worker protocol, not to the rank.
_WORKER_ONLY = ("PYTHON_WORKER_FACTORY_SECRET", "PYTHON_WORKER_FACTORY_PORT",
                "SPARK_REUSE_WORKER", "SPARK_BUFFER_SIZE")
_KILL_GRACE_SECONDS = 3.0
_STDERR_TAIL_LINES = 30
# The rank's own GPU addresses as Spark gave them to its task (``resources()['gpu']``), comma
# separated; unset when the task has no GPU resource (Horovod's ``get_available_devices()``).
SPARK_GPUS_ENV = "SPARK_HVD_SPARK_GPUS"


class TaskSpec:
    """Everything a task needs from the driver (pickled into the Spark task)."""

    def __init__(self, job_id, secret, num_proc, payload, channel_addr, start_timeout,
                 env, timestamp, executable, verbose, heartbeat_seconds=1.0):
        self.job_id = job_id
        self.secret = secret
        self.num_proc = num_proc
        self.payload = payload
        self.channel_addr = channel_addr
        self.start_timeout = start_timeout
        self.env = env
        self.timestamp = timestamp
        self.executable = executable
        self.verbose = verbose
        self.heartbeat_seconds = heartbeat_seconds


class TaskFailed(RuntimeError):
    """This task's rank failed (or was stopped because another one did)."""


def mapper(spec: TaskSpec):
    """The ``mapInArrow`` function of the barrier stage."""

    def run_barrier_task(batches):
        for _ in batches:  # one row per task: the partition itself is the work item
            pass
        yield from run_task(spec)

    return run_barrier_task


def run_task(spec: TaskSpec, ctx=None):
    """Runs one rank to completion in this task; yields the result rows (Arrow batches)."""
    if ctx is None:
        from pyspark import BarrierTaskContext
        ctx = BarrierTaskContext.get()
    addresses = [info.address for info in ctx.getTaskInfos()]
    if len(addresses) != spec.num_proc:
        raise TaskFailed(f"the barrier stage has {len(addresses)} tasks, expected "
                         f"{spec.num_proc}")
    slot = _placement.slots_by_partition(addresses)[ctx.partitionId()]
    task = _RankTask(spec, ctx, slot)
    try:
        result = task.run()
    finally:
        task.cleanup()
    yield from result_batches(slot.rank, result)


def result_batches(rank: int, data: bytes, chunk_bytes: int = 1 << 20):
    """The rows carrying one rank's pickled result: (rank, seq, chunk) in batches of one row,
    small enough for Spark Connect's result stream."""
    import pyarrow as pa
    chunks = [data[i:i + chunk_bytes] for i in range(0, len(data), chunk_bytes)] or [b""]
    for seq, chunk in enumerate(chunks):
        yield pa.RecordBatch.from_arrays(
            [pa.array([rank], pa.int32()), pa.array([seq], pa.int32()),
             pa.array([chunk], pa.binary())], names=["rank", "seq", "chunk"])


def executor_env() -> dict[str, str]:
    """The base of a rank's environment: the executor's (``spark.executorEnv.*`` included),
    less Spark's worker protocol, with the worker's import path (Spark adds ``--py-files``
    and archives at run time) as ``PYTHONPATH``, so the rank can import what fn refers to."""
    base = {k: v for k, v in os.environ.items() if k not in _WORKER_ONLY}
    base["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return base


def stop_child(proc) -> None:
    """Stop a task's child process and everything it started: SIGTERM, then SIGKILL after a
    grace."""
    if proc is None or not group_alive(proc):
        return
    proc.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + _KILL_GRACE_SECONDS
    while group_alive(proc) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.signal_group(signal.SIGKILL)
    try:
        proc.popen.wait(timeout=5)
    except Exception:  # noqa: BLE001
        pass


def _bind_address(address: str) -> str:
    """The address the rank's listeners bind to: the executor's own address, where the driver
    reaches this executor (a network interface set for the job, ``nics`` or
    ``spark.spark_hvd.networkInterface``, wins in the rank's bootstrap)."""
    host = _placement.host_of(address)
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except OSError:
        return host


class _RankTask:
    """One task's rank: the child process, its output, its rendezvous rounds."""

    def __init__(self, spec: TaskSpec, ctx, slot: SlotInfo):
        self.spec = spec
        self.ctx = ctx
        self.slot = slot
        self.rank = slot.rank
        self.address = slot.hostname
        self.events: queue.Queue = queue.Queue()
        self.proc = None
        self.server = None
        self.workdir = None
        self.output_threads = []
        self.stderr_tail = collections.deque(maxlen=_STDERR_TAIL_LINES)
        self.pending = None     # generation of the init round in progress
        self.returned = None    # "rank R" once some rank returned from fn
        self.finished = False
        self.heartbeat_stop = threading.Event()
        self.gpu_note = None    # rank 0's: which ranks share a GPU, for the driver
        self.channel = TaskChannel(spec.channel_addr, spec.secret, spec.job_id, self.rank)

    # -- set-up -------------------------------------------------------------------------------

    def _gpu_env(self) -> dict[str, str]:
        """The rank's GPU binding from Spark's GPU scheduling: ``CUDA_VISIBLE_DEVICES`` (see
        :func:`_placement.visible_devices`) and the task's own Spark addresses in
        ``SPARK_HVD_SPARK_GPUS``. A task without a GPU resource changes nothing: the rank sees
        the executor's ``CUDA_VISIBLE_DEVICES`` (set or not) as any process there would.
        Rank 0's task also keeps the note about GPUs that ranks share, for the driver."""
        gpu = self.ctx.resources().get("gpu")
        if gpu is None:
            return {}
        mine = list(gpu.addresses)
        # Every task of the stage has the same resource profile, so either all of them have
        # a GPU resource and take part in this round, or none does.
        gathered = [json.loads(m) for m in self.ctx.allGather(
            json.dumps({"a": self.address, "r": self.rank, "g": mine}))]
        host = sorted((m["r"], m["g"]) for m in gathered if m["a"] == self.address)
        if self.rank == 0:
            shared = _placement.shared_gpus([(m["a"], m["r"], m["g"]) for m in gathered])
            if shared:
                self.gpu_note = _placement.sharing_note(shared)
        return {"CUDA_VISIBLE_DEVICES": _placement.visible_devices(mine, [g for _, g in host]),
                SPARK_GPUS_ENV: ",".join(mine)}

    def _child_env(self, rendezvous_addr: str, bind_addr: str) -> dict[str, str]:
        # The driver's tuning variables and env= override the executor's environment, the
        # bootstrap variables override everything.
        base = executor_env()
        base.update(self._gpu_env())
        base.update(self.spec.env)
        slot = SlotInfo(hostname=_placement.host_id(self.address), rank=self.slot.rank,
                        size=self.slot.size, local_rank=self.slot.local_rank,
                        local_size=self.slot.local_size, cross_rank=self.slot.cross_rank,
                        cross_size=self.slot.cross_size)
        env = rank_env(base, slot, rendezvous_addr=rendezvous_addr,
                       secret_hex=secret_to_env(self.spec.secret), job_id=self.spec.job_id,
                       bind_addr=bind_addr, start_timeout=self.spec.start_timeout, config={})
        env[function_rank.PAYLOAD_ENV] = os.path.join(self.workdir, "payload")
        env[function_rank.RESULT_ENV] = os.path.join(self.workdir, "result")
        env[function_rank.ERROR_ENV] = os.path.join(self.workdir, "error.json")
        return env

    def _start(self) -> None:
        attempt = self.ctx.attemptNumber()
        if attempt > 0:
            self.channel.start()
            self.channel.log(f"rank {self.rank}: Spark task attempt {attempt + 1} (an earlier "
                             "attempt of this barrier stage failed)")
            earlier = self.channel.get_global("user_error")
            if earlier is not None:
                raise TaskFailed(
                    f"not running fn again on rank {self.rank}: it raised an exception in an "
                    f"earlier attempt ({earlier.decode(errors='replace')}); Spark retried the "
                    "stage, but the error would repeat")
        self.workdir = tempfile.mkdtemp(prefix=f"spark_hvd_rank{self.rank}_")
        with open(os.path.join(self.workdir, "payload"), "wb") as f:
            f.write(self.spec.payload)
        self.server = RendezvousServer(self.spec.secret, bind_host="127.0.0.1")
        port = self.server.start()
        bind_addr = _bind_address(self.address)
        env = self._child_env(f"127.0.0.1:{port}", bind_addr)
        command = [self.spec.executable or sys.executable, "-m", function_rank.__name__]
        # Spawn before the channel's thread starts: the spawn runs Python code between fork
        # and exec, which must not wait for a lock that another thread held at the fork.
        self.proc = spawn(self.rank, self.address, command, env, os.getcwd(), remote=False)
        self.channel.start()
        if self.gpu_note and self.spec.verbose >= 1:
            self.channel.log(self.gpu_note)
        if self.spec.verbose >= 2:
            self.channel.log(f"rank {self.rank}: pid {self.proc.popen.pid} on executor "
                             f"{self.address}, listening on {bind_addr}")
        ts = self.spec.timestamp
        self.output_threads = [
            forward(self.proc.popen.stdout, self.rank, "stdout", self.channel.stdout, None, ts),
            forward(self.proc.popen.stderr, self.rank, "stderr", _Tee(self.channel.stderr,
                                                                        self.stderr_tail),
                    None, ts),
        ]
        threading.Thread(target=self._heartbeat, daemon=True,
                         name=f"spark-hvd-heartbeat-{self.rank}").start()
        threading.Thread(target=self._wait_child, daemon=True,
                         name=f"spark-hvd-child-{self.rank}").start()
        threading.Thread(target=self._watch_rendezvous, args=(port,), daemon=True,
                         name=f"spark-hvd-rendezvous-{self.rank}").start()
        self.channel.watch("abort", lambda value: self.events.put(("abort", value)))
        self.channel.watch("returned", lambda value: self.events.put(("returned", value)))

    def _heartbeat(self) -> None:
        """``alive/<rank>``: a counter and where the task runs, until the task ends. The driver
        only looks at whether the value changes (its own clock: none is shared)."""
        where = {"host": _placement.host_of(self.address), "executor": self.address,
                 "hostname": socket.gethostname()}
        beat = 0
        while True:
            beat += 1
            if not self.channel.put("alive", json.dumps({"n": beat, **where}).encode()) \
                    and not self.channel.connected:
                return  # no driver to tell (a Spark Connect client out of reach)
            if self.heartbeat_stop.wait(self.spec.heartbeat_seconds):
                return

    def _wait_child(self) -> None:
        self.proc.popen.wait()
        self.events.put(("exit", self.proc.popen.returncode))

    def _watch_rendezvous(self, port: int) -> None:
        """Report each ``init()`` of the rank: its line in the local server, under the init
        round of the next generation's scope."""
        try:
            client = KVClient(f"127.0.0.1:{port}", self.spec.secret, timeout=30)
        except RuntimeError:
            return
        generation = 0
        with client:
            while True:
                try:
                    value = client.get(contract.init_scope(self.spec.job_id, generation),
                                       contract.allgather_key(contract.INIT_ROUND, self.rank),
                                       timeout=7 * 24 * 3600)
                except RuntimeError:
                    return  # the server stopped: the task is over
                self.events.put(("init", generation, value))
                generation += 1

    # -- the rank's life ------------------------------------------------------------------------

    def run(self) -> bytes:
        """Returns the rank's pickled result; raises :class:`TaskFailed`."""
        self._start()
        while True:
            event = self.events.get()
            kind = event[0]
            if kind == "abort":
                self._stop_child()
                raise TaskFailed(f"rank {self.rank} stopped: {event[1].decode(errors='replace')}")
            if kind == "exit":
                if event[1] != 0:
                    self._fail(event[1])
                return self._finish()
            if kind == "returned":
                self.returned = event[1].decode(errors="replace")
                if self.pending is not None:
                    self._init_mismatch(self.pending)
            elif kind == "init":
                self._start_round(event[1], event[2])
            elif kind == "gathered":
                self._end_round(event[1], event[2])

    def _start_round(self, generation: int, value: bytes) -> None:
        """The rank is in ``hvd.init()``: gather every rank's line, in a thread, so that this
        loop still sees the rank die, an abort, or another rank return (which would leave
        ``allGather`` waiting forever: every task must call it equally often)."""
        if self.returned is not None:
            self._init_mismatch(generation)
        self.pending = generation
        message = json.dumps({"r": self.rank, "g": generation,
                              "v": base64.b64encode(value).decode()})

        def gather() -> None:
            try:
                self.events.put(("gathered", generation, self.ctx.allGather(message)))
            except BaseException as e:  # noqa: BLE001 - Spark's error, reported by run()
                self.events.put(("gathered", generation, e))

        threading.Thread(target=gather, daemon=True,
                         name=f"spark-hvd-allgather-{self.rank}").start()

    def _end_round(self, generation: int, messages) -> None:
        """Put every other rank's line into the local server: the rank's ``allgather``
        completes and the ranks connect to each other."""
        self.pending = None
        if isinstance(messages, BaseException):
            self._stop_child()
            raise TaskFailed(f"rank {self.rank}: BarrierTaskContext.allGather failed during "
                             f"hvd.init(): {messages}") from messages
        scope = contract.init_scope(self.spec.job_id, generation)
        with KVClient(f"127.0.0.1:{self.server.port}", self.spec.secret, timeout=30) as client:
            for m in map(json.loads, messages):
                if m["r"] != self.rank:
                    client.put(scope, contract.allgather_key(contract.INIT_ROUND, m["r"]),
                               base64.b64decode(m["v"]))

    def _init_mismatch(self, generation: int) -> None:
        self._stop_child()
        raise TaskFailed(
            f"rank {self.rank} called hvd.init() (call {generation + 1}) but {self.returned} "
            "already returned from fn: every rank must call init() the same number of times")

    def _finish(self) -> bytes:
        """The rank returned: hand over its result, and tell the tasks whose ranks might
        still wait for it in ``hvd.init()``."""
        self._drain_output()
        path = os.path.join(self.workdir, "result")
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            raise TaskFailed(f"rank {self.rank} exited without leaving a result") from None
        self.finished = True
        self.channel.put_global("returned", f"rank {self.rank}".encode())
        return data

    def _fail(self, returncode: int) -> None:
        """The rank exited with an error: tell the driver and the other tasks, fail the task."""
        report = None
        try:
            with open(os.path.join(self.workdir, "error.json"), "rb") as f:
                report = json.loads(f.read())
        except (OSError, ValueError):
            pass
        host = _placement.host_of(self.address)
        if report is not None:
            kind = "internal" if report.get("internal") else "user"
            detail = report["traceback"]
            summary = f"{report['type']}: {report['message']}".strip()
        else:
            kind = "crash"
            tail = b"".join(self.stderr_tail).decode(errors="replace")
            summary = f"the process {describe_exit(returncode)}"
            detail = summary + (f"\nlast lines of its stderr:\n{tail}" if tail else "")
        info = {"rank": self.rank, "host": host, "executor": self.address, "kind": kind,
                "returncode": returncode, "summary": summary, "detail": detail,
                "time": time.time(), "attempt": self.ctx.attemptNumber()}
        self.channel.put("error", json.dumps(info).encode())
        if kind == "user":
            self.channel.put_global("user_error", f"rank {self.rank}: {summary}".encode())
        self.channel.put_global("abort", f"rank {self.rank} failed ({summary})".encode())
        self._stop_child()
        self._drain_output(timeout=1.0)  # the rank's last lines (its traceback) go first
        raise TaskFailed(f"[{FAILURE_MARKER} {self.rank}] rank {self.rank} on {host} failed: "
                         f"{detail}")

    def _drain_output(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        for t in self.output_threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _stop_child(self) -> None:
        stop_child(self.proc)

    def cleanup(self) -> None:
        # Also after a clean exit: whatever the rank started and left behind goes with it.
        self._stop_child()
        self.heartbeat_stop.set()
        self.channel.put("stopped", b"done")
        self._drain_output(timeout=1.0)
        self.channel.close()
        if self.server is not None:
            self.server.stop()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


class _Tee:
    """A line sink that also keeps the last lines (for the report of a crashed rank)."""

    def __init__(self, sink, tail: collections.deque):
        self._sink, self._tail = sink, tail

    def write_line(self, line: bytes) -> None:
        self._tail.append(line.split(b": ", 1)[-1] if line.startswith(b"[") else line)
        self._sink.write_line(line)
