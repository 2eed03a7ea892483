"""The channel between ``run``'s driver and its Spark tasks: output lines, status, errors.

It is the core's authenticated key-value store (:mod:`spark_hvd.common._rendezvous`) run by the
driver, not a second protocol: tasks put, the driver gets. The rendezvous itself does not use
it (tasks exchange addresses with ``BarrierTaskContext.allGather``); the channel carries what
Spark has no way to carry while the stage runs:

- ``<job>/out/<rank>/<window>`` ``<seq>``: chunks of the rank's output lines, each line tagged
  with its stream (``o`` stdout, ``e`` stderr); the chunk ``EOF`` ends a rank's output. Windows
  of :data:`WINDOW` chunks are deleted once read, so a long job does not pile up its output.
- ``<job>/ctl`` ``started/<rank>``, ``stopped/<rank>``, ``error/<rank>`` (a JSON report),
  ``alive/<rank>`` (the task's heartbeat: a counter and its host, see ``_task``),
  ``abort`` (set by the first failure: every task stops its rank at once) and ``user_error``
  (an exception in ``fn``: a retried stage attempt refuses to run it again).

``run_elastic`` serves its elastic protocol from the same store (``DriverChannel.server``
with the store's hooks): the workers' ``<job>/elastic`` scope, the slot tasks' ``<job>/slots``
scope (registrations, work, exits, results), and each slot task's output under its task key
(:meth:`DriverChannel.follow`).

Every task reaches the driver when the driver is Spark's (its address is ``spark.driver.host``,
which executors reach by construction). A Spark Connect client may not be reachable from the
executors: then each task writes its ranks' output to its executor log instead and the run
still works, without live output.
"""

from __future__ import annotations

import json
import queue
import socket
import sys
import threading
import time

from spark_hvd.common._rendezvous import KVClient, RendezvousServer
from spark_hvd.spark._placement import host_of

WINDOW = 256
EOF = b"\x00EOF"
STDOUT, STDERR = b"o", b"e"
# A chunk is sent when it reaches this size, or this long after its first line.
_CHUNK_BYTES = 64 * 1024
_CHUNK_SECONDS = 0.02
# Waits that only end when the other side acts (or the driver stops the server).
_FOREVER = 7 * 24 * 3600.0


def _addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def encode_lines(lines: list[tuple[bytes, bytes]]) -> bytes:
    """``[(stream tag, line ending in \\n)]`` -> one chunk."""
    return b"".join(tag + line for tag, line in lines)


def decode_lines(chunk: bytes) -> list[tuple[bytes, bytes]]:
    """Inverse of :func:`encode_lines`."""
    out = []
    for record in chunk.splitlines(keepends=True):
        if record:
            out.append((record[:1], record[1:]))
    return out


class DriverChannel:
    """The driver's end: serves the store and copies each rank's output to the sinks."""

    def __init__(self, job_id: str, secret: bytes, num_proc: int, bind_host: str,
                 advertise_host: str, sinks: dict[bytes, object], **server_options):
        self.job_id = job_id
        self.num_proc = num_proc
        self._secret = secret
        self._sinks = sinks
        # The store itself: run_elastic's driver also serves its elastic scope here
        # (``server_options``: the store's hooks, see RendezvousServer).
        self.server = RendezvousServer(secret, bind_host=bind_host, **server_options)
        port = self.server.start()
        local = "127.0.0.1" if bind_host in ("0.0.0.0", "") else bind_host
        self._local_addr = _addr(local, port)
        self.addr = _addr(advertise_host, port)
        self.ctl_scope = f"{job_id}/ctl"
        self._client = KVClient(self._local_addr, secret, timeout=10)
        self._eof = [threading.Event() for _ in range(num_proc)]
        self._readers = [threading.Thread(target=self._read_output, args=(r,), daemon=True,
                                          name=f"spark-hvd-output-{r}")
                         for r in range(num_proc)]
        for t in self._readers:
            t.start()

    def follow(self, key: str, sinks: dict[bytes, object]) -> None:
        """Copy the output that the task channel named ``key`` sends to ``sinks`` (a
        run_elastic slot task, whose name is not a rank: its worker's rank changes)."""
        t = threading.Thread(target=self._read_output, args=(key, sinks), daemon=True,
                             name=f"spark-hvd-output-{key}")
        self._readers.append(t)
        t.start()

    def _read_output(self, rank, sinks=None) -> None:
        sinks = sinks or self._sinks
        try:
            client = KVClient(self._local_addr, self._secret, timeout=10)
        except RuntimeError:
            return
        seq = 0
        try:
            while True:
                scope = f"{self.job_id}/out/{rank}/{seq // WINDOW}"
                try:
                    chunk = client.get(scope, str(seq), timeout=_FOREVER)
                except RuntimeError:
                    return  # the server stopped: the run is over
                if chunk == EOF:
                    if isinstance(rank, int):
                        self._eof[rank].set()
                    client.delete_scope(scope)
                    return
                for tag, line in decode_lines(chunk):
                    sink = sinks.get(tag) or sinks[STDERR]
                    sink.write_line(line)
                if seq % WINDOW == WINDOW - 1:
                    client.delete_scope(scope)
                seq += 1
        except RuntimeError:
            return
        finally:
            client.close()

    def client(self) -> KVClient:
        """A connection of its own to the store (for a thread other than the driver's)."""
        return KVClient(self._local_addr, self._secret, timeout=10)

    def ranks_with(self, key: str, ranks=None, client=None) -> dict[int, bytes]:
        """``{rank: value}`` of the ranks that have put ``<key>/<rank>`` so far (through
        ``client``, default the driver's own connection)."""
        found = {}
        client = client or self._client
        for r in (range(self.num_proc) if ranks is None else ranks):
            try:
                found[r] = client.get(self.ctl_scope, f"{key}/{r}", timeout=0)
            except RuntimeError:
                pass
        return found

    def wait_all(self, key: str, timeout: float, ranks=None, stop=None) -> set[int]:
        """Wait until every rank (of ``ranks``) put ``<key>/<rank>``, ``timeout`` seconds at
        most or until ``stop`` is set; returns the ranks that did. Uses its own connection, so
        it may run in another thread than the driver's other calls."""
        want = set(range(self.num_proc) if ranks is None else ranks)
        done: set[int] = set()
        deadline = time.monotonic() + timeout
        with self.client() as client:
            for r in sorted(want):
                while r not in done:
                    left = deadline - time.monotonic()
                    if left <= 0 or (stop is not None and stop.is_set()):
                        return done
                    try:
                        client.get(self.ctl_scope, f"{key}/{r}", timeout=min(left, 0.5))
                        done.add(r)
                    except RuntimeError:
                        pass
        return done

    def errors(self) -> dict[int, dict]:
        """The error reports the ranks have put so far."""
        return {r: json.loads(v) for r, v in self.ranks_with("error").items()}

    def abort(self, why: str) -> None:
        """Tell every task to stop its rank now."""
        try:
            self._client.put(self.ctl_scope, "abort", why.encode())
        except RuntimeError:
            pass

    def wait_output(self, timeout: float) -> bool:
        """Wait until the output of every rank that reached the driver has ended; False if
        some did not within ``timeout``. (A rank whose task could not reach the driver wrote
        its output to its executor's log.)"""
        deadline = time.monotonic() + timeout
        for r in self.ranks_with("started"):
            if not self._eof[r].wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def close(self) -> None:
        self._client.close()
        self.server.stop()
        for t in self._readers:
            t.join(timeout=2)


class _StreamSink:
    """What :func:`spark_hvd.launch.output.forward` writes one stream's lines to."""

    def __init__(self, channel: "TaskChannel", tag: bytes):
        self._channel, self._tag = channel, tag

    def write_line(self, line: bytes) -> None:
        self._channel.send_line(self._tag, line)


class TaskChannel:
    """A task's end. Connects in the background (from :meth:`start`) so the rank starts at
    once; lines written before the connection is up are kept and sent (or, if the driver cannot
    be reached, written to this executor's log)."""

    def __init__(self, addr: str | None, secret: bytes, job_id: str, rank: int,
                 connect_timeout: float = 5.0, fallback=None):
        self.rank = rank
        self.job_id = job_id
        self.ctl_scope = f"{job_id}/ctl"
        self._addr = addr
        self._secret = secret
        self._connect_timeout = connect_timeout
        self._fallback = fallback if fallback is not None else getattr(sys.stderr, "buffer",
                                                                       None)
        self._lines: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._ctl: KVClient | None = None
        self._ctl_lock = threading.Lock()
        self._closed = False
        self.connected = False
        self.stdout = _StreamSink(self, STDOUT)
        self.stderr = _StreamSink(self, STDERR)
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"spark-hvd-channel-{rank}")

    def start(self) -> "TaskChannel":
        """Start connecting (lines written before are kept)."""
        if not self._sender.is_alive() and not self._ready.is_set():
            self._sender.start()
        return self

    # -- connection -----------------------------------------------------------------------

    def _connect(self) -> KVClient | None:
        if not self._addr:
            return None
        try:
            # The driver's server is up before any task starts, so a refused connection is
            # final (KVClient itself would retry refusals until its timeout).
            port = int(self._addr.rpartition(":")[2])
            socket.create_connection((host_of(self._addr), port),
                                     timeout=self._connect_timeout).close()
            return KVClient(self._addr, self._secret, timeout=self._connect_timeout)
        except (RuntimeError, OSError, ValueError):
            return None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the connection attempt to end; True when the driver is reachable."""
        self.start()
        self._ready.wait(timeout)
        return self.connected

    # -- output -----------------------------------------------------------------------------

    def send_line(self, tag: bytes, line: bytes) -> None:
        if not line.endswith(b"\n"):
            line += b"\n"
        self._lines.put((tag, line))

    def log(self, message: str) -> None:
        """A line from the task itself (not the rank), shown on the driver's stderr."""
        self.send_line(STDERR, f"spark_hvd.spark: {message}".encode())

    def _write_fallback(self, batch) -> None:
        if self._fallback is None:
            return
        try:
            for tag, line in batch:
                self._fallback.write(line)
            self._fallback.flush()
        except (OSError, ValueError):
            pass

    def _send_loop(self) -> None:
        client = self._connect()
        if client is not None:
            try:
                self._ctl = self._connect()
            except Exception:  # noqa: BLE001
                self._ctl = None
        self.connected = client is not None and self._ctl is not None
        self._ready.set()
        if self.connected:
            self.put("started", str(time.time()).encode())
        seq = 0
        done = False
        while not done:
            item = self._lines.get()
            batch, size = [], 0
            deadline = time.monotonic() + _CHUNK_SECONDS
            while True:
                if item is None:
                    done = True
                    break
                batch.append(item)
                size += len(item[1]) + 1
                if size >= _CHUNK_BYTES:
                    break
                try:
                    item = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
            if batch:
                if client is not None:
                    try:
                        scope = f"{self.job_id}/out/{self.rank}/{seq // WINDOW}"
                        client.put(scope, str(seq), encode_lines(batch))
                        seq += 1
                    except RuntimeError:
                        client = None  # the driver is gone: keep the lines in the executor log
                if client is None:
                    self._write_fallback(batch)
        if client is not None:
            try:
                client.put(f"{self.job_id}/out/{self.rank}/{seq // WINDOW}", str(seq), EOF)
            except RuntimeError:
                pass
            client.close()

    def close_output(self, timeout: float = 10.0) -> None:
        """Send what is queued, then the end of this rank's output."""
        self.start()
        if not self._closed:
            self._closed = True
            self._lines.put(None)
        self._sender.join(timeout)

    # -- control ------------------------------------------------------------------------------

    def put(self, key: str, value: bytes) -> bool:
        """``ctl`` ``<key>/<rank>`` = value; False when the driver is not reachable."""
        return self._put(f"{key}/{self.rank}", value)

    def put_global(self, key: str, value: bytes) -> bool:
        return self._put(key, value)

    def _put(self, key: str, value: bytes) -> bool:
        if not self.wait_ready(self._connect_timeout + 5) or self._ctl is None:
            return False
        with self._ctl_lock:
            try:
                self._ctl.put(self.ctl_scope, key, value)
                return True
            except RuntimeError:
                return False

    def get_global(self, key: str) -> bytes | None:
        """The value of ``ctl`` ``<key>`` if some process put it already."""
        if not self.wait_ready(self._connect_timeout + 5) or self._ctl is None:
            return None
        with self._ctl_lock:
            try:
                return self._ctl.get(self.ctl_scope, key, timeout=0)
            except RuntimeError:
                return None

    def watch(self, key: str, callback) -> None:
        """Call ``callback(value)`` from a thread when ``ctl`` ``<key>`` is put. The wait ends
        with the run (the driver stops its server)."""

        def wait() -> None:
            if not self.wait_ready(self._connect_timeout + 5):
                return
            client = self._connect()
            if client is None:
                return
            try:
                value = client.get(self.ctl_scope, key, timeout=_FOREVER)
            except RuntimeError:
                return
            finally:
                client.close()
            callback(value)

        threading.Thread(target=wait, daemon=True, name=f"spark-hvd-watch-{key}").start()

    def close(self) -> None:
        self.close_output()
        if self._ctl is not None:
            with self._ctl_lock:
                self._ctl.close()
