"""Rendezvous: a tiny authenticated key-value store, and allgather on top of it.

Workers find each other by publishing their addresses under a job scope and reading everybody
else's. The launcher runs a :class:`RendezvousServer`; workers talk to it with a
:class:`KVClient` and use :class:`KVRendezvous` for ``allgather``. Spark tasks implement the same
:class:`Rendezvous` interface with ``BarrierTaskContext.allGather``, so the core's bootstrap only
ever sees ``Rendezvous.allgather``.

Wire format: every message is a frame, a 4-byte big-endian length followed by the payload. A
request or reply payload is a list of byte fields (``!I`` count, then ``!I`` length + bytes for
each). Frames over 64 MiB are refused, so a bad peer cannot make us allocate without bound.

Authentication, on every connection before anything else (mutual HMAC-SHA256 challenge on the
job secret; the secret itself never crosses the wire):

1. server -> client: ``server_nonce`` (32 random bytes)
2. client -> server: ``hmac(secret, server_nonce + b"client") + client_nonce``
3. server checks, closes the connection on a mismatch, else answers
   ``hmac(secret, client_nonce + b"server")``
4. client checks that answer, so it cannot be fooled by a server that does not know the secret.

The different suffixes stop a reflection attack (using one side to answer the other's challenge).

Elastic jobs (``launch/elastic``) use the same server with hooks: ``on_put(scope, key, value)``
for every put, and a connection that says hello (op ``H``, a worker id) is watched: its close,
or its time-out when the peer host goes silent (keepalive probes and ``TCP_USER_TIMEOUT`` at the
core's peer timeout), is reported through ``on_disconnect(wid, how)``, even while the server
waits for a key on its behalf. Hooks run in the connection's thread, before the reply is sent,
so a worker's report is seen before anything the worker does next (such as exiting).
"""

from __future__ import annotations

import abc
import errno
import hashlib
import hmac
import os
import secrets
import select
import socket
import struct
import threading
import time

from spark_hvd.common import _bootstrap_contract as contract
from spark_hvd.common._secret import secret_from_env

MAX_FRAME_BYTES = 64 * 1024 * 1024
# Handshake frames are tiny; an unauthenticated peer gets no more than this, and no more than
# _HANDSHAKE_TIMEOUT seconds, before it is dropped.
_MAX_HANDSHAKE_FRAME = 1024
_HANDSHAKE_TIMEOUT = 10.0
_NONCE_BYTES = 32
_DIGEST_BYTES = 32
# The client waits this much longer than a server-side get, so the server's "timed out" answer
# (which names the key) arrives before the socket's own timeout.
_REPLY_MARGIN = 5.0

_OP_PUT = b"P"
_OP_GET = b"G"
_OP_DELETE_SCOPE = b"D"
_OP_HELLO = b"H"
# How often a server-side wait looks at a hello connection for its close or time-out.
_WATCH_SECONDS = 0.1
_OK = b"O"
_TIMED_OUT = b"T"
_ERROR = b"E"

AUTH_FAILED_MESSAGE = (
    f"rendezvous rejected this process: wrong or missing job secret ({contract.SECRET})")


class RendezvousTimeoutError(RuntimeError, TimeoutError):
    """A rendezvous wait ran out of time (a ``RuntimeError``, and a ``TimeoutError`` too)."""


class _ConnectionClosed(Exception):
    """The peer closed the connection (possibly mid-frame)."""


def set_peer_timeout(sock: socket.socket, seconds: float | None) -> None:
    """The core's liveness settings on ``sock`` (``native/transport/tcp.cc``): keepalive probes
    after half of ``seconds`` of silence, and ``TCP_USER_TIMEOUT`` = ``seconds``, so the kernel
    ends the connection when the peer host stays silent that long. None or 0: kernel defaults."""
    if not seconds or seconds <= 0:
        return
    secs = max(1, int(seconds))
    idle = max(1, secs // 2)
    interval = max(1, secs // 20)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, (secs - idle) // interval + 1))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(min(seconds * 1000, 2e9)))
    except (OSError, AttributeError):
        pass  # not Linux: the kernel's defaults


def _describe_socket_error(e: BaseException) -> str:
    """"closed" (the peer process ended: FIN, or RST when it left data unread), "timeout"
    (its host stayed silent for the peer timeout), or "error: ..."."""
    if isinstance(e, (_ConnectionClosed, ConnectionResetError, BrokenPipeError,
                      ConnectionAbortedError)):
        return "closed"
    if isinstance(e, OSError) and e.errno in (errno.ETIMEDOUT, errno.EHOSTUNREACH):
        return "timeout"
    return f"error: {e}"


def _check_alive(conn: socket.socket) -> None:
    """Raises when ``conn`` was closed by its peer or failed (a silent host's time-out)."""
    readable, _, _ = select.select([conn], [], [], 0)
    if not readable:
        return
    try:
        data = conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return
    if not data:
        raise _ConnectionClosed()


def _digest(secret: bytes, nonce: bytes, side: bytes) -> bytes:
    return hmac.new(secret, nonce + side, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise _ConnectionClosed()
        got += k
    return bytes(buf)


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"rendezvous message of {len(payload)} bytes exceeds the "
                         f"{MAX_FRAME_BYTES} byte limit")
    sock.sendall(struct.pack("!I", len(payload)) + payload)


def _recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    if n > max_bytes:
        raise ValueError(f"rendezvous message of {n} bytes exceeds the {max_bytes} byte limit")
    return _recv_exact(sock, n)


def _pack_fields(fields: list[bytes]) -> bytes:
    parts = [struct.pack("!I", len(fields))]
    for f in fields:
        parts.append(struct.pack("!I", len(f)))
        parts.append(f)
    return b"".join(parts)


def _unpack_fields(payload: bytes) -> list[bytes]:
    def take(pos: int, n: int) -> tuple[bytes, int]:
        if pos + n > len(payload):
            raise ValueError("truncated rendezvous message")
        return payload[pos:pos + n], pos + n

    raw, pos = take(0, 4)
    (count,) = struct.unpack("!I", raw)
    fields = []
    for _ in range(count):
        raw, pos = take(pos, 4)
        (n,) = struct.unpack("!I", raw)
        field, pos = take(pos, n)
        fields.append(field)
    if pos != len(payload):
        raise ValueError("trailing bytes in rendezvous message")
    return fields


def _parse_addr(addr: str) -> tuple[str, int]:
    """Split "host:port" (or "[v6]:port") into host and port."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"rendezvous address {addr!r} is not of the form host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


class RendezvousServer:
    """Authenticated key-value server that the launcher runs for one job.

    Keys live in scopes (one per job or per round of a protocol). ``get`` blocks on the server
    until the key is put or the caller's timeout runs out. One thread serves each connection.
    """

    def __init__(self, secret: bytes, bind_host: str = "127.0.0.1", on_put=None, on_hello=None,
                 on_disconnect=None, peer_timeout: float | None = None):
        if not secret:
            raise ValueError("RendezvousServer needs a non-empty job secret")
        self._secret = secret
        self._bind_host = bind_host
        self._on_put = on_put
        self._on_hello = on_hello
        self._on_disconnect = on_disconnect
        self._peer_timeout = peer_timeout
        self._hello: dict[socket.socket, str] = {}
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._store: dict[str, dict[str, bytes]] = {}
        self._cond = threading.Condition()
        self._stopped = False

    def start(self) -> int:
        """Bind to ``bind_host`` on a free port, start serving, return the port."""
        family = socket.AF_INET6 if ":" in self._bind_host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self._bind_host, 0))
        listener.listen(128)
        self._listener = listener
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="spark-hvd-rendezvous", daemon=True)
        self._accept_thread.start()
        return listener.getsockname()[1]

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("RendezvousServer is not started")
        return self._listener.getsockname()[1]

    def stop(self) -> None:
        """Stop accepting, drop every connection and wake any waiting ``get``."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            conns = list(self._conns)
        if self._listener is not None:
            # shutdown() wakes the accept() blocked in the other thread; close() alone may not.
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)

    def put(self, scope: str, key: str, value: bytes) -> None:
        """Store a value from this process (the elastic driver's side of the protocol)."""
        with self._cond:
            self._store.setdefault(scope, {})[key] = bytes(value)
            self._cond.notify_all()

    def get_nowait(self, scope: str, key: str) -> bytes | None:
        """The value of ``scope``/``key``, or None, without waiting."""
        with self._cond:
            return self._store.get(scope, {}).get(key)

    def __enter__(self) -> "RendezvousServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- serving ----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener closed by stop()
            with self._cond:
                if self._stopped:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="spark-hvd-rendezvous-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        how = "closed"
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_peer_timeout(conn, self._peer_timeout)
            if not self._authenticate(conn):
                return
            conn.settimeout(None)
            while True:
                try:
                    request = _unpack_fields(_recv_frame(conn))
                except _ConnectionClosed:
                    return
                _send_frame(conn, _pack_fields(self._handle(request, conn)))
        except Exception as e:
            # Malformed or oversized input, a failed handshake, or the peer went away: drop the
            # connection. Nothing a peer sends may take the server down.
            how = _describe_socket_error(e)
            return
        finally:
            with self._cond:
                self._conns.discard(conn)
                wid = self._hello.pop(conn, None)
                stopped = self._stopped
            conn.close()
            if wid is not None and self._on_disconnect is not None:
                self._on_disconnect(wid, "server stopped" if stopped else how)

    def _authenticate(self, conn: socket.socket) -> bool:
        conn.settimeout(_HANDSHAKE_TIMEOUT)
        server_nonce = secrets.token_bytes(_NONCE_BYTES)
        _send_frame(conn, server_nonce)
        answer = _recv_frame(conn, _MAX_HANDSHAKE_FRAME)
        if len(answer) != _DIGEST_BYTES + _NONCE_BYTES:
            return False
        expected = _digest(self._secret, server_nonce, b"client")
        if not hmac.compare_digest(answer[:_DIGEST_BYTES], expected):
            return False
        client_nonce = answer[_DIGEST_BYTES:]
        _send_frame(conn, _digest(self._secret, client_nonce, b"server"))
        return True

    def _handle(self, request: list[bytes], conn: socket.socket | None = None) -> list[bytes]:
        if not request:
            return [_ERROR, b"empty request"]
        op, args = request[0], request[1:]
        if op == _OP_PUT and len(args) == 3:
            scope, key, value = args[0].decode(), args[1].decode(), args[2]
            with self._cond:
                self._store.setdefault(scope, {})[key] = value
                self._cond.notify_all()
            if self._on_put is not None:
                self._on_put(scope, key, value)
            return [_OK]
        if op == _OP_HELLO and len(args) == 1 and conn is not None:
            wid = args[0].decode()
            with self._cond:
                self._hello[conn] = wid
            if self._on_hello is not None:
                self._on_hello(wid)
            return [_OK]
        if op == _OP_GET and len(args) == 3:
            scope, key = args[0].decode(), args[1].decode()
            deadline = time.monotonic() + max(0.0, float(args[2].decode()))
            watched = conn is not None and conn in self._hello
            with self._cond:
                while True:
                    if self._stopped:
                        return [_ERROR, b"rendezvous server is shutting down"]
                    value = self._store.get(scope, {}).get(key)
                    if value is not None:
                        return [_OK, value]
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return [_TIMED_OUT]
                    if watched:
                        # A worker's listener: its close or time-out must not wait for the key.
                        self._cond.wait(min(remaining, _WATCH_SECONDS))
                        _check_alive(conn)
                    else:
                        self._cond.wait(min(remaining, 60.0))  # huge timeouts overflow wait()
        if op == _OP_DELETE_SCOPE and len(args) == 1:
            with self._cond:
                self._store.pop(args[0].decode(), None)
            return [_OK]
        return [_ERROR, b"unknown rendezvous request"]


class KVClient:
    """Client of a :class:`RendezvousServer` at ``addr`` ("host:port").

    Connects (retrying while the server is not up yet, up to ``timeout`` seconds) and
    authenticates with the job secret. Safe to share between threads: one request at a time.
    """

    def __init__(self, addr: str, secret: bytes, timeout: float = 30,
                 peer_timeout: float | None = None):
        self.addr = addr
        self.timeout = float(timeout)
        self._secret = secret
        self._peer_timeout = peer_timeout
        self._lock = threading.Lock()
        self._sock = self._connect()

    def _connect(self) -> socket.socket:
        host, port = _parse_addr(self.addr)
        deadline = time.monotonic() + self.timeout
        delay = 0.05
        while True:
            try:
                sock = socket.create_connection(
                    (host, port), timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as e:
                # The server may not be listening yet (workers can start before the driver's
                # service in some launch modes): retry refusals until the timeout.
                retry = isinstance(e, (ConnectionRefusedError, socket.timeout))
                if not retry or time.monotonic() + delay >= deadline:
                    raise RuntimeError(
                        f"could not connect to the rendezvous server at {self.addr} within "
                        f"{self.timeout:g} s: {e}") from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_peer_timeout(sock, self._peer_timeout)
            sock.settimeout(max(self.timeout, _HANDSHAKE_TIMEOUT))
            self._handshake(sock)
        except BaseException:
            sock.close()
            raise
        return sock

    def _handshake(self, sock: socket.socket) -> None:
        try:
            server_nonce = _recv_frame(sock, _MAX_HANDSHAKE_FRAME)
            client_nonce = secrets.token_bytes(_NONCE_BYTES)
            _send_frame(sock, _digest(self._secret, server_nonce, b"client") + client_nonce)
            answer = _recv_frame(sock, _MAX_HANDSHAKE_FRAME)
        except (_ConnectionClosed, ConnectionError):
            # The server hangs up without a word on a bad answer (an attacker learns nothing).
            raise RuntimeError(AUTH_FAILED_MESSAGE) from None
        except (OSError, ValueError) as e:
            raise RuntimeError(
                f"rendezvous handshake with {self.addr} failed: {e or type(e).__name__}") from None
        if not hmac.compare_digest(answer, _digest(self._secret, client_nonce, b"server")):
            raise RuntimeError(
                f"the rendezvous server at {self.addr} failed to prove it knows the job secret "
                f"({contract.SECRET}): refusing to talk to it")

    def _request(self, fields: list[bytes], reply_timeout: float) -> list[bytes]:
        with self._lock:
            if self._sock is None:
                raise RuntimeError("KVClient is closed")
            self._sock.settimeout(reply_timeout)
            try:
                _send_frame(self._sock, _pack_fields(fields))
                reply = _unpack_fields(_recv_frame(self._sock))
            except (_ConnectionClosed, ConnectionError, socket.timeout) as e:
                raise RuntimeError(
                    f"lost the connection to the rendezvous server at {self.addr}"
                    + (f": {e}" if str(e) else "")) from None
        if reply and reply[0] == _ERROR:
            raise RuntimeError(f"rendezvous server error: {reply[1].decode(errors='replace')}")
        return reply

    def put(self, scope: str, key: str, value: bytes) -> None:
        """Store ``value`` under ``scope``/``key`` (overwriting any earlier value)."""
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"rendezvous values are bytes, got {type(value).__name__}")
        self._request([_OP_PUT, scope.encode(), key.encode(), bytes(value)],
                      self.timeout + _REPLY_MARGIN)

    def get(self, scope: str, key: str, timeout: float | None = None) -> bytes:
        """Return the value of ``scope``/``key``, waiting up to ``timeout`` seconds (default: the
        client's timeout) for some process to put it. Raises ``RuntimeError`` on timeout."""
        wait = self.timeout if timeout is None else float(timeout)
        reply = self._request([_OP_GET, scope.encode(), key.encode(), repr(wait).encode()],
                              wait + _REPLY_MARGIN)
        if reply[0] == _TIMED_OUT:
            raise RendezvousTimeoutError(
                f"rendezvous timed out after {wait:g} s waiting for key {scope}/{key}")
        return reply[1]

    def hello(self, wid: str) -> None:
        """Bind this connection to worker ``wid`` (elastic jobs): the server reports its close
        or time-out to the driver as that worker's loss."""
        self._request([_OP_HELLO, wid.encode()], self.timeout + _REPLY_MARGIN)

    def delete_scope(self, scope: str) -> None:
        """Drop every key of ``scope`` (e.g. when a job or a round is over)."""
        self._request([_OP_DELETE_SCOPE, scope.encode()], self.timeout + _REPLY_MARGIN)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self) -> "KVClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Rendezvous(abc.ABC):
    """What the core needs to bootstrap: every rank contributes bytes, every rank gets all."""

    @abc.abstractmethod
    def allgather(self, value: bytes) -> list[bytes]:
        """Contribute ``value``; return every rank's value, ordered by rank."""

    def barrier(self) -> None:
        """Return once every rank has called ``barrier``."""
        self.allgather(b"")


class KVRendezvous(Rendezvous):
    """:class:`Rendezvous` over a :class:`KVClient`: each rank puts its value under
    ``scope`` then reads everybody's. Each call is the next round, with fresh keys (see
    ``_bootstrap_contract``), so it can be called repeatedly.
    """

    def __init__(self, client: KVClient, rank: int, size: int, scope: str,
                 timeout: float | None = None):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in [0, {size})")
        self.client = client
        self.rank = rank
        self.size = size
        self.scope = scope
        self.timeout = client.timeout if timeout is None else float(timeout)
        self._round = 0

    def allgather(self, value: bytes) -> list[bytes]:
        round_ = self._round
        self._round += 1
        self.client.put(self.scope, contract.allgather_key(round_, self.rank), value)
        deadline = time.monotonic() + self.timeout
        values: list[bytes] = []
        for r in range(self.size):
            try:
                values.append(self.client.get(self.scope, contract.allgather_key(round_, r),
                                              timeout=max(0.0, deadline - time.monotonic())))
            except RendezvousTimeoutError:
                missing = [r] + self._missing(round_, range(r + 1, self.size))
                raise RendezvousTimeoutError(
                    f"rendezvous timed out after {self.timeout:g} s: ranks {missing} never "
                    f"arrived (raise --start-timeout / {contract.START_TIMEOUT} if they are "
                    f"just slow to start)") from None
        return values

    def _missing(self, round_: int, ranks) -> list[int]:
        missing = []
        for r in ranks:
            try:
                self.client.get(self.scope, contract.allgather_key(round_, r), timeout=0)
            except RendezvousTimeoutError:
                missing.append(r)
        return missing


def rendezvous_from_env(env=None, generation: int = 0) -> KVRendezvous:
    """The :class:`KVRendezvous` of the ``generation``-th ``init()`` of a process that
    ``spark-hvd-run`` or ``spark_hvd.spark.run`` started: the one ``init()`` itself uses.

    Reads the bootstrap variables of ``_bootstrap_contract`` from ``env`` (default
    ``os.environ``): the store's address, the job secret, rank, size, the job id (the scope's
    prefix) and the start timeout (its ``HOROVOD_`` and Gloo names too, default 30 s). A
    process that gathers through it must not also ``init()`` with the same generation: the
    two would use the same keys.
    """
    env = os.environ if env is None else env
    missing = [k for k in (contract.RENDEZVOUS_ADDR, contract.RANK, contract.SIZE)
               if not env.get(k)]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: start this process with spark-hvd-run "
                           "(or spark_hvd.spark.run)")
    timeout = contract.start_timeout(env)
    client = KVClient(env[contract.RENDEZVOUS_ADDR],
                      secret_from_env(env.get(contract.SECRET, "")), timeout=timeout)
    scope = contract.init_scope(env.get(contract.JOB_ID) or contract.DEFAULT_JOB_ID, generation)
    return KVRendezvous(client, int(env[contract.RANK]), int(env[contract.SIZE]), scope=scope,
                        timeout=timeout)
