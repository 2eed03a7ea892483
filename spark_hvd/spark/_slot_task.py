"""What each Spark slot task of ``spark_hvd.spark.run_elastic`` does (runs in the Python worker).

A slot task is a place a worker can run, not a rank: the elastic driver (on the Spark driver,
``_elastic``) decides who runs where and which rank each worker has in each round. One slot task
is the only task of its own, non-barrier Spark job, so that a lost executor fails only the jobs
of its own slots, and Spark runs the task again (a new attempt is a new slot task) wherever it
has room.

1. Register: put ``task/<key>`` (``key`` = ``t<Spark task attempt id>``, unique in the
   application) into the driver's ``<job>/slots`` scope with the executor it runs on, and say
   hello on a connection of its own (``slot:<key>``): the driver takes that connection's close
   or time-out (the peer timeout) for the loss of the slot task.
2. Wait on that connection for ``work/<key>``: the worker the driver wants to run here (its
   worker id and its planned place), or ``{"stop": why}``.
3. Start the worker as ``spark.run``'s tasks start a rank (``_task``'s pieces: a child process
   of :mod:`spark_hvd.launch.function_rank`, the executor's environment, the task's GPUs, its
   output to the driver), with the elastic environment of ``spark-hvd-run``'s workers
   (``launch.elastic.spawner.elastic_env``): from ``init()`` on, the worker talks to the elastic
   driver itself. Its output lines go to the driver without a rank: the driver puts the worker's
   current rank in front of each.
4. ``stop/<key>`` stops the worker (SIGTERM to its process group, SIGKILL after a grace).
5. When the worker exits: its last output lines, then its pickled result (``result/<wid>/<i>``
   chunks and ``result/<wid>/n``) if it left one, then ``exited/<key>`` with its exit code. The
   task then ends normally, whatever the worker did: a worker's failure is the elastic driver's
   business, and Spark must not run the task again for it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time

from spark_hvd.common._network import route_address
from spark_hvd.common._rendezvous import KVClient, RendezvousTimeoutError
from spark_hvd.common._secret import secret_to_env
from spark_hvd.launch import function_rank
from spark_hvd.launch.elastic.driver import WorkerSpec
from spark_hvd.launch.elastic.spawner import elastic_env
from spark_hvd.launch.hosts import SlotInfo
from spark_hvd.launch.output import forward
from spark_hvd.launch.spawn import spawn
from spark_hvd.spark import _placement
from spark_hvd.spark._channel import TaskChannel
from spark_hvd.spark._task import SPARK_GPUS_ENV, executor_env, stop_child

# A long poll is re-issued this often, so no request lives forever on the server.
_POLL_SECONDS = 5.0
RESULT_CHUNK_BYTES = 1 << 20


class SlotSpec:
    """Everything a slot task needs from the driver (pickled into the Spark task)."""

    def __init__(self, job_id, secret, channel_addr, payload, start_timeout, elastic_timeout,
                 env, executable, verbose, peer_timeout):
        self.job_id = job_id
        self.secret = secret
        self.channel_addr = channel_addr
        self.payload = payload
        self.start_timeout = start_timeout
        self.elastic_timeout = elastic_timeout
        self.env = env
        self.executable = executable
        self.verbose = verbose
        self.peer_timeout = peer_timeout


def slots_scope(job_id: str) -> str:
    return f"{job_id}/slots"


def hello_id(key: str) -> str:
    """The name a slot task's liveness connection says hello with (workers use their ids)."""
    return "slot:" + key


def executor_key(host: str, env=None) -> str:
    """The "host" of the elastic driver for this task: its executor, as ``spark.run`` counts
    executors as hosts (two executors on one machine are two hosts). Spark does not tell a
    Python task its executor id, but the executor's environment does: ``SPARK_EXECUTOR_ID``
    (Kubernetes), the log URLs of standalone executors, YARN's ``CONTAINER_ID``; else the
    Python daemon that forked this worker (one per executor)."""
    env = os.environ if env is None else env
    ident = env.get("SPARK_EXECUTOR_ID")
    if not ident:
        m = re.search(r"[?&]executorId=([^&\s]+)", env.get("SPARK_LOG_URL_STDERR", ""))
        ident = m.group(1) if m else None
    if not ident and env.get("CONTAINER_ID"):
        ident = env["CONTAINER_ID"]
    if not ident:
        ident = f"pid{os.getppid()}"
    return re.sub(r"\s+", "_", f"executor-{ident}@{host}")


def mapper(spec: SlotSpec):
    """The ``mapInArrow`` function of a slot job (one partition, one task)."""

    def run_slot_task(batches):
        for _ in batches:
            pass
        run_slot(spec)
        return
        yield  # a generator that yields nothing: the results travel through the driver's store

    return run_slot_task


def run_slot(spec: SlotSpec, ctx=None) -> None:
    if ctx is None:
        from pyspark import TaskContext
        ctx = TaskContext.get()
    task = _SlotTask(spec, ctx)
    try:
        task.run()
    finally:
        task.cleanup()


class _SlotTask:
    def __init__(self, spec: SlotSpec, ctx):
        self.spec = spec
        self.ctx = ctx
        self.key = f"t{ctx.taskAttemptId()}"
        self.scope = slots_scope(spec.job_id)
        self.address = route_address(_placement.host_of(spec.channel_addr))
        self.host = executor_key(self.address)
        self.gpus = self._gpus()
        self.proc = None
        self.workdir = None
        self.wid = None
        self.output_threads = []
        self.channel = TaskChannel(spec.channel_addr, spec.secret, spec.job_id, self.key)
        self.client = None      # the liveness connection, which also waits for work and stop
        self.stopped = threading.Event()

    def _gpus(self) -> list[str]:
        gpu = self.ctx.resources().get("gpu")
        return list(gpu.addresses) if gpu is not None else []

    def run(self) -> None:
        self.client = KVClient(self.spec.channel_addr, self.spec.secret, timeout=30,
                               peer_timeout=self.spec.peer_timeout)
        self.client.hello(hello_id(self.key))
        info = {"host": self.host, "address": self.address, "hostname": socket.gethostname(),
                "gpus": self.gpus, "attempt": self.ctx.attemptNumber(),
                "partition": self.ctx.partitionId()}
        self.client.put(self.scope, f"task/{self.key}", json.dumps(info).encode())
        work = self._wait(f"work/{self.key}")
        if work is None or "stop" in work:
            return
        self._start(work)
        threading.Thread(target=self._watch_stop, daemon=True,
                         name=f"spark-hvd-slot-stop-{self.key}").start()
        code = self.proc.popen.wait()
        deadline = time.monotonic() + 5.0
        for t in self.output_threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self.channel.close_output(timeout=5.0)  # its last lines reach the driver first
        try:
            self._send_result(code)
            self.client.put(self.scope, f"exited/{self.key}",
                            json.dumps({"wid": self.wid, "code": code}).encode())
        except RuntimeError:
            pass  # the driver is gone (the run ended): nobody is left to tell

    def _wait(self, key: str):
        """The driver's answer under ``key`` (JSON), or None when the driver is gone."""
        while True:
            try:
                return json.loads(self.client.get(self.scope, key, timeout=_POLL_SECONDS))
            except RendezvousTimeoutError:
                continue
            except RuntimeError:
                return None

    def _watch_stop(self) -> None:
        try:
            with KVClient(self.spec.channel_addr, self.spec.secret, timeout=30) as client:
                while self.proc.popen.poll() is None:
                    try:
                        client.get(self.scope, f"stop/{self.key}", timeout=_POLL_SECONDS)
                        break
                    except RendezvousTimeoutError:
                        continue
        except RuntimeError:
            pass  # the driver is gone: stop the worker too
        if self.proc.popen.poll() is None:
            stop_child(self.proc)

    def _start(self, work: dict) -> None:
        self.wid = work["wid"]
        planned = SlotInfo(**work["planned"])
        spec = WorkerSpec(work["wid"], work["host"], work["slot"], work["seq"], planned)
        self.workdir = tempfile.mkdtemp(prefix="spark_hvd_worker_")
        with open(os.path.join(self.workdir, "payload"), "wb") as f:
            f.write(self.spec.payload)
        base = executor_env()
        if self.gpus:
            # Only the task's own GPUs, device 0 first: local ranks change at a reset, so
            # the worker pins hvd.local_rank() % device_count(), which is always its own.
            base["CUDA_VISIBLE_DEVICES"] = _placement.visible_devices(self.gpus, [self.gpus])
            base[SPARK_GPUS_ENV] = ",".join(self.gpus)
        base.update(self.spec.env)
        env = elastic_env(base, spec, rendezvous_addr=self.spec.channel_addr,
                          secret_hex=secret_to_env(self.spec.secret), job_id=self.spec.job_id,
                          bind_addr=self.address, start_timeout=self.spec.start_timeout,
                          elastic_timeout=self.spec.elastic_timeout, config={})
        env[function_rank.PAYLOAD_ENV] = os.path.join(self.workdir, "payload")
        env[function_rank.RESULT_ENV] = os.path.join(self.workdir, "result")
        env[function_rank.ERROR_ENV] = os.path.join(self.workdir, "error.json")
        command = [self.spec.executable or sys.executable, "-m", function_rank.__name__]
        # In the task's main thread, before the channel's thread starts (see _task._start).
        self.proc = spawn(planned.rank, self.address, command, env, os.getcwd(), remote=False)
        self.channel.start()
        if self.spec.verbose >= 2:
            self.channel.log(f"worker {self.wid}: pid {self.proc.popen.pid} in Spark task "
                             f"{self.key} (attempt {self.ctx.attemptNumber() + 1}) on "
                             f"{self.host}")
        self.output_threads = [
            forward(self.proc.popen.stdout, None, "stdout", self.channel.stdout),
            forward(self.proc.popen.stderr, None, "stderr", self.channel.stderr),
        ]

    def _send_result(self, code: int) -> None:
        path = os.path.join(self.workdir, "result")
        if code != 0 or not os.path.exists(path):
            return
        with open(path, "rb") as f:
            data = f.read()
        chunks = [data[i:i + RESULT_CHUNK_BYTES]
                  for i in range(0, len(data), RESULT_CHUNK_BYTES)] or [b""]
        for i, chunk in enumerate(chunks):
            self.client.put(self.scope, f"result/{self.wid}/{i}", chunk)
        self.client.put(self.scope, f"result/{self.wid}/n", str(len(chunks)).encode())

    def cleanup(self) -> None:
        stop_child(self.proc)
        self.channel.close()
        if self.client is not None:
            self.client.close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
