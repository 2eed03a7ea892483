"""Rendezvous over the channels that other launchers already provide.

A process started by ``torchrun``, MPICH's or Intel MPI's ``mpiexec`` (Hydra), ``srun
--mpi=pmi2`` or ``horovodrun`` has no spark_hvd rendezvous server to ask. Each class here
implements :class:`~._rendezvous.Rendezvous` (``allgather``) over what its launcher does provide,
so the rest of the bootstrap is the same for every launcher:

- :class:`TorchStoreRendezvous`: a ``torch.distributed.TCPStore`` (torchrun's agent store, or
  the store rank 0 hosts under torch's ``env://`` convention).
- :class:`PmiRendezvous`: the PMI-1 wire protocol (Hydra, Intel MPI, Slurm's pmi2 plugin).
- :class:`HorovodHttpRendezvous`: Horovod's Gloo rendezvous server (HTTP ``PUT``/``GET`` of
  ``/<scope>/<key>``, 404 until the key exists).

None of these channels is authenticated by spark_hvd: whoever can reach them can read the job
secret that :func:`agree_on_job` publishes there. They are exactly as trusted as the launcher's
own processes (torch.distributed, MPI and Horovod's Gloo trust them the same way).

Every class knows ``rank`` and ``size`` and a ``route_host``: the address of the launcher's
service, so a rank can advertise the local address that routes towards the other machines.
"""

from __future__ import annotations

import abc
import atexit
import http.client
import os
import secrets
import socket
import threading
import time

from ._bootstrap_contract import START_TIMEOUT
from ._rendezvous import Rendezvous, RendezvousTimeoutError

_JOB_SECRET_BYTES = 32


def agree_on_job(rendezvous: Rendezvous, rank: int) -> tuple[bytes, str]:
    """Returns (secret, job_id) for the job, drawn by rank 0 and shared through ``rendezvous``.

    The secret then authenticates the core's mesh as it does under spark-hvd-run; the job id
    names shared-memory segments, so two jobs on one host never meet.
    """
    mine = b""
    if rank == 0:
        mine = secrets.token_bytes(_JOB_SECRET_BYTES) + secrets.token_hex(4).encode()
    first = rendezvous.allgather(mine)[0]
    return first[:_JOB_SECRET_BYTES], first[_JOB_SECRET_BYTES:].decode()


class _BlockingKVRendezvous(Rendezvous):
    """Allgather over a store whose ``get`` can wait for a key: put ours, read everybody's."""

    def __init__(self, rank: int, size: int, timeout: float, who: str):
        self.rank, self.size, self.timeout, self.who = rank, size, timeout, who
        self._round = 0

    @abc.abstractmethod
    def _put(self, key: str, value: bytes) -> None:
        """Stores ``value`` under ``key``."""

    @abc.abstractmethod
    def _get(self, key: str, deadline: float) -> bytes | None:
        """The value of ``key``, waiting until ``deadline`` (monotonic); None when it ran out."""

    def _round_done(self, round_: int) -> None:
        """Hook called after a rank has read every value of ``round_``."""

    def allgather(self, value: bytes) -> list[bytes]:
        round_ = self._round
        self._round += 1
        self._put(f"{round_}.{self.rank}", value)
        deadline = time.monotonic() + self.timeout
        values = []
        for r in range(self.size):
            got = self._get(f"{round_}.{r}", deadline)
            if got is None:
                missing = [q for q in range(r, self.size)
                           if self._get(f"{round_}.{q}", time.monotonic()) is None]
                raise RendezvousTimeoutError(
                    f"rendezvous through {self.who} timed out after {self.timeout:g} s: ranks "
                    f"{missing} never arrived (raise {START_TIMEOUT} if they are just slow to "
                    "start)")
            values.append(got)
        self._round_done(round_)
        return values


class TorchStoreRendezvous(_BlockingKVRendezvous):
    """Allgather through a ``torch.distributed.TCPStore`` at ``host:port``.

    ``is_master``: this process hosts the store (rank 0 under torch's ``env://`` convention,
    where no torchrun agent hosts one). The host then waits, in every round, until each rank has
    read all values, so dropping this object (which stops the store and frees the port for a
    later ``torch.distributed.init_process_group``) never cuts off a slower rank.
    """

    def __init__(self, host: str, port: int, rank: int, size: int, prefix: str,
                 is_master: bool, timeout: float, who: str):
        super().__init__(rank, size, timeout, who)
        from datetime import timedelta
        try:
            from torch.distributed import TCPStore
        except ImportError:
            raise RuntimeError(
                f"this process was started by {who}; spark_hvd joins such a job through "
                "torch.distributed's TCPStore, but torch is not installed. Install torch or "
                "start the job with spark-hvd-run.") from None
        self.route_host = host
        self._prefix = prefix
        self._is_master = is_master
        self._timedelta = timedelta
        try:
            self._store = TCPStore(host, port, is_master=is_master,
                                   timeout=timedelta(seconds=timeout), wait_for_workers=False)
        except RuntimeError as e:  # torch's DistNetworkError, a RuntimeError
            role = "host" if is_master else "reach"
            raise RuntimeError(
                f"could not {role} the torch.distributed store at {host}:{port} (MASTER_ADDR:"
                f"MASTER_PORT, from {who}) within {timeout:g} s: {str(e).splitlines()[0]}"
            ) from None

    def _put(self, key, value):
        self._store.set(self._prefix + key, value)

    def _get(self, key, deadline):
        from torch.distributed import DistStoreError
        try:
            self._store.wait([self._prefix + key],
                             self._timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except DistStoreError:
            return None
        return self._store.get(self._prefix + key)

    def _round_done(self, round_):
        if self.size <= 1:
            return
        done = f"{self._prefix}{round_}.read."
        self._store.set(done + str(self.rank), b"")
        if self._is_master:
            # The hosting rank returns only once every rank has read this round (see above).
            from torch.distributed import DistStoreError
            try:
                self._store.wait([done + str(r) for r in range(self.size)],
                                 self._timedelta(seconds=self.timeout))
            except DistStoreError:
                raise RendezvousTimeoutError(
                    f"rendezvous through {self.who} timed out after {self.timeout:g} s: not "
                    "every rank confirmed it read the others' addresses") from None


class HorovodHttpRendezvous(_BlockingKVRendezvous):
    """Allgather through Horovod's Gloo rendezvous server (the one ``horovodrun`` starts).

    Its protocol: ``PUT /<scope>/<key>`` stores the request body, ``GET /<scope>/<key>`` answers
    200 with the value or 404 while it is missing, so a wait is a poll. Scope and key may not
    contain ``/``. Our scope is our own (``spark_hvd.<generation>``), apart from Horovod's
    ``global``/``local_*``/``cross_*`` scopes.
    """

    _POLL_MAX = 0.1

    def __init__(self, host: str, port: int, rank: int, size: int, scope: str, timeout: float,
                 who: str):
        super().__init__(rank, size, timeout, who)
        self.route_host = host
        self._host, self._port, self._scope = host, port, scope

    def _request(self, method: str, key: str, body: bytes | None, deadline: float):
        delay = 0.02
        while True:
            conn = http.client.HTTPConnection(self._host, self._port,
                                              timeout=max(1.0, deadline - time.monotonic()))
            try:
                conn.request(method, f"/{self._scope}/{key}", body=body)
                resp = conn.getresponse()
                return resp.status, resp.read()
            except (ConnectionRefusedError, ConnectionResetError, socket.timeout,
                    http.client.RemoteDisconnected) as e:
                # The server may still be starting, or dropped a request under load: retry.
                if time.monotonic() + delay >= deadline:
                    raise RuntimeError(
                        f"could not reach Horovod's rendezvous server at {self._host}:"
                        f"{self._port} (HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT, from {self.who}) "
                        f"within {self.timeout:g} s: {e or type(e).__name__}") from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except OSError as e:
                raise RuntimeError(
                    f"Horovod's rendezvous server at {self._host}:{self._port} (from {self.who})"
                    f" failed: {e}") from None
            finally:
                conn.close()

    def _put(self, key, value):
        status, _ = self._request("PUT", key, value, time.monotonic() + self.timeout)
        if status != 200:
            raise RuntimeError(f"Horovod's rendezvous server at {self._host}:{self._port} "
                               f"refused to store {self._scope}/{key} (HTTP {status})")

    def _get(self, key, deadline):
        delay = 0.01
        while True:
            status, body = self._request("GET", key, None, max(deadline, time.monotonic() + 1))
            if status == 200:
                return body
            if status != 404:
                raise RuntimeError(f"Horovod's rendezvous server at {self._host}:{self._port} "
                                   f"answered HTTP {status} for {self._scope}/{key}")
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, self._POLL_MAX)


class _PmiConnection:
    """One PMI-1 session with the process manager, for the life of the process.

    PMI-1 is line-based text: ``cmd=<name> key=value ...`` out, one such line back. The session
    is set up once (``init``) and must end with ``finalize`` before the process exits: Hydra
    reports a rank that exits without it as failed. Re-inits of spark_hvd in the same process
    reuse it with fresh keys.
    """

    def __init__(self, fd: int | None, port: str | None, pmi_id: str | None, who: str,
                 timeout: float):
        self.who, self.timeout = who, timeout
        self._lock = threading.Lock()
        try:
            if fd is not None:
                self._sock = socket.socket(fileno=fd)
            else:
                host, _, portnum = port.rpartition(":")
                self._sock = socket.create_connection((host, int(portnum)), timeout=timeout)
            # Every reply, the barrier's included, comes within the start timeout or never.
            self._sock.settimeout(timeout)
        except (OSError, ValueError) as e:
            channel = f"PMI_FD={fd}" if fd is not None else f"PMI_PORT={port}"
            raise RuntimeError(f"cannot reach the process manager that started this process "
                               f"({who}) through {channel}: {e}") from None
        self._file = self._sock.makefile("rb")
        self.rank = self.size = None
        if fd is None:
            # Over a port the process manager says who we are after our id.
            self._send(f"cmd=initack pmiid={pmi_id or 0}")
            self._expect("initack")
            for _ in range(3):
                reply = self._expect("set")
                if "size" in reply:
                    self.size = int(reply["size"])
                elif "rank" in reply:
                    self.rank = int(reply["rank"])
        self._ask("cmd=init pmi_version=1 pmi_subversion=1", "response_to_init")
        self.vallen_max = int(self._ask("cmd=get_maxes", "maxes").get("vallen_max", 1024))
        self.kvsname = self._ask("cmd=get_my_kvsname", "my_kvsname")["kvsname"]
        self._finalized = False
        atexit.register(self.finalize)

    def _send(self, line: str) -> None:
        self._sock.sendall(line.encode() + b"\n")

    def _expect(self, cmd: str) -> dict[str, str]:
        try:
            line = self._file.readline().decode(errors="replace").strip()
        except socket.timeout:
            raise RendezvousTimeoutError(
                f"the process manager ({self.who}) did not answer within {self.timeout:g} s "
                f"(waiting for cmd={cmd}; in a barrier, some ranks never arrived): raise "
                f"{START_TIMEOUT} if they are just slow to start") from None
        if not line:
            raise RuntimeError(f"the process manager ({self.who}) closed the PMI connection")
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("cmd") != cmd:
            raise RuntimeError(f"unexpected PMI reply from the process manager ({self.who}): "
                               f"{line!r} (expected cmd={cmd})")
        return fields

    def _ask(self, line: str, reply: str) -> dict[str, str]:
        with self._lock:
            self._send(line)
            fields = self._expect(reply)
        if fields.get("rc", "0") != "0":
            raise RuntimeError(f"PMI request {line.split()[0]} failed at the process manager "
                               f"({self.who}): {fields.get('msg', fields)}")
        return fields

    def put(self, key: str, value: str) -> None:
        if len(value) > self.vallen_max:
            raise RuntimeError(f"PMI value for {key} is {len(value)} characters, over the "
                               f"process manager's limit of {self.vallen_max}")
        self._ask(f"cmd=put kvsname={self.kvsname} key={key} value={value}", "put_result")

    def get(self, key: str) -> str:
        return self._ask(f"cmd=get kvsname={self.kvsname} key={key}", "get_result")["value"]

    def barrier(self) -> None:
        self._ask("cmd=barrier_in", "barrier_out")

    def finalize(self) -> None:
        with self._lock:
            if self._finalized:
                return
            self._finalized = True
            try:
                self._send("cmd=finalize")
                self._expect("finalize_ack")
            except (OSError, RuntimeError):
                pass  # the process manager is gone already; nothing left to tell it


_pmi_lock = threading.Lock()
_pmi_connection: _PmiConnection | None = None


def pmi_connection(fd: int | None, port: str | None, pmi_id: str | None, who: str,
                   timeout: float) -> _PmiConnection:
    """The process's PMI session, opened on first use (PMI allows one ``init`` per process)."""
    global _pmi_connection
    with _pmi_lock:
        if _pmi_connection is None:
            _pmi_connection = _PmiConnection(fd, port, pmi_id, who, timeout)
        return _pmi_connection


class PmiRendezvous(Rendezvous):
    """Allgather over PMI-1: each rank puts its value, all meet in the PMI barrier, then each
    reads every value. Values travel as hex (PMI values are space-free text)."""

    def __init__(self, connection: _PmiConnection, rank: int, size: int, generation: int,
                 route_host: str | None = None):
        self.pmi, self.rank, self.size = connection, rank, size
        self.route_host = route_host
        self._prefix = f"shvd.{generation}."
        self._round = 0

    def allgather(self, value: bytes) -> list[bytes]:
        prefix = f"{self._prefix}{self._round}."
        self._round += 1
        self.pmi.put(prefix + str(self.rank), value.hex() or "-")
        self.pmi.barrier()
        return [bytes.fromhex(v.strip("-")) for v in
                (self.pmi.get(prefix + str(r)) for r in range(self.size))]


def pmi_fd_from_env(value: str | None) -> int | None:
    """PMI_FD as an int (None when unset), with a clear error for junk."""
    if value in (None, ""):
        return None
    try:
        fd = int(value)
        os.fstat(fd)
    except (ValueError, OSError):
        raise RuntimeError(f"PMI_FD={value!r} is not an open file descriptor of this process: "
                           "the process manager's PMI channel was lost (a wrapper closed it?)"
                           ) from None
    return fd
