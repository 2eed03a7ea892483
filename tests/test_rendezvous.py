"""The rendezvous key-value store: authentication, blocking gets, allgather, limits."""

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from spark_hvd.common import _rendezvous as rdv
from spark_hvd.common._rendezvous import KVClient, KVRendezvous, RendezvousServer
from spark_hvd.common._secret import make_secret, secret_from_env, secret_to_env

REPO = Path(__file__).resolve().parent.parent
AUTH_MESSAGE = ("rendezvous rejected this process: wrong or missing job secret "
                "(SPARK_HVD_SECRET)")


@pytest.fixture
def server():
    secret = make_secret()
    srv = RendezvousServer(secret)
    port = srv.start()
    srv.addr = f"127.0.0.1:{port}"
    srv.secret = secret
    yield srv
    srv.stop()


def client(server, **kw):
    return KVClient(server.addr, server.secret, **kw)


def test_secret_helpers():
    s = make_secret()
    assert len(s) == 32 and s != make_secret()
    assert secret_from_env(secret_to_env(s)) == s
    with pytest.raises(ValueError, match="missing"):
        secret_from_env("")
    with pytest.raises(ValueError, match="not a hex"):
        secret_from_env("xyz")


@pytest.mark.timeout(30)
def test_put_get_round_trip(server):
    with client(server) as c:
        c.put("job", "a", b"\x00\x01binary")
        c.put("job", "empty", b"")
        c.put("other", "a", b"other scope")
        assert c.get("job", "a") == b"\x00\x01binary"
        assert c.get("job", "empty") == b""
        assert c.get("other", "a") == b"other scope"
        c.put("job", "a", b"overwritten")
    with client(server) as c2:  # a second connection sees the same store
        assert c2.get("job", "a") == b"overwritten"
        c2.delete_scope("job")
        with pytest.raises(RuntimeError, match="job/a"):
            c2.get("job", "a", timeout=0)
        assert c2.get("other", "a") == b"other scope"


@pytest.mark.timeout(30)
def test_get_blocks_until_put(server):
    with client(server) as reader, client(server) as writer:
        timer = threading.Timer(0.3, writer.put, args=("s", "late", b"here"))
        start = time.monotonic()
        timer.start()
        assert reader.get("s", "late", timeout=10) == b"here"
        assert 0.2 < time.monotonic() - start < 5


@pytest.mark.timeout(30)
def test_get_timeout_names_the_key(server):
    with client(server) as c:
        start = time.monotonic()
        with pytest.raises(RuntimeError,
                           match=r"rendezvous timed out after 0\.3 s waiting for key s/missing"):
            c.get("s", "missing", timeout=0.3)
        assert time.monotonic() - start < 3
        with pytest.raises(TimeoutError):  # also catchable as a TimeoutError
            c.get("s", "missing", timeout=0)
        c.put("s", "k", b"v")  # the connection is still usable after a timeout
        assert c.get("s", "k") == b"v"


@pytest.mark.timeout(30)
def test_wrong_secret_is_refused(server):
    with client(server) as good:
        good.put("s", "k", b"secret data")
        for bad_secret in (make_secret(), b"x"):
            with pytest.raises(RuntimeError) as info:
                KVClient(server.addr, bad_secret, timeout=5)
            assert str(info.value) == AUTH_MESSAGE
        # Skipping the handshake and sending a put straight away gets the connection closed
        # without the put taking effect.
        raw = socket.create_connection(("127.0.0.1", int(server.addr.split(":")[1])))
        raw.settimeout(5)
        rdv._recv_frame(raw)  # the server's nonce
        rdv._send_frame(raw, rdv._pack_fields([b"P", b"s", b"k", b"injected"]))
        assert raw.recv(1) == b""  # closed
        raw.close()
        assert good.get("s", "k") == b"secret data"
    with client(server) as again:  # the server still serves good clients
        assert again.get("s", "k") == b"secret data"


@pytest.mark.timeout(30)
def test_client_refuses_a_server_without_the_secret():
    """Mutual authentication: a fake server that accepts any answer cannot prove itself."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def fake_server():
        conn, _ = listener.accept()
        rdv._send_frame(conn, os.urandom(32))
        rdv._recv_frame(conn)
        rdv._send_frame(conn, os.urandom(32))
        conn.recv(1)
        conn.close()

    t = threading.Thread(target=fake_server, daemon=True)
    t.start()
    with pytest.raises(RuntimeError, match="failed to prove it knows the job secret"):
        KVClient(f"127.0.0.1:{listener.getsockname()[1]}", make_secret(), timeout=5)
    listener.close()


@pytest.mark.timeout(30)
def test_message_size_limits(server):
    with client(server) as c:
        with pytest.raises(ValueError, match="exceeds"):
            c.put("s", "big", b"\0" * (rdv.MAX_FRAME_BYTES + 1))
        # A frame header announcing more than 64 MiB makes the server drop the connection.
        c._sock.sendall(struct.pack("!I", rdv.MAX_FRAME_BYTES + 1))
        c._sock.settimeout(5)
        assert c._sock.recv(1) == b""
    with client(server) as c2:
        c2.put("s", "k", b"still fine")
        assert c2.get("s", "k") == b"still fine"


@pytest.mark.timeout(30)
def test_stop_wakes_blocked_gets(server):
    c = client(server)
    errors = []

    def blocked():
        try:
            c.get("s", "never", timeout=20)
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.2)
    server.stop()
    t.join(timeout=10)
    assert not t.is_alive() and errors


@pytest.mark.timeout(30)
def test_allgather_threads_repeated(server):
    size = 4
    results = [None] * size

    def worker(rank):
        with client(server) as c:
            r = KVRendezvous(c, rank, size, scope="job1")
            results[rank] = [r.allgather(f"{rank}-{round_}".encode()) for round_ in range(3)]

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    for rank in range(size):
        assert results[rank] == [[f"{r}-{round_}".encode() for r in range(size)]
                                 for round_ in range(3)]


@pytest.mark.timeout(60)
def test_allgather_processes(server):
    code = ("import os; from spark_hvd.common._rendezvous import rendezvous_from_env; "
            "r = rendezvous_from_env(); print(b'|'.join(r.allgather(os.environ['V'].encode()))"
            ".decode())")
    procs = []
    for rank in range(3):
        env = dict(os.environ, PYTHONPATH=str(REPO), SPARK_HVD_RENDEZVOUS_ADDR=server.addr,
                   SPARK_HVD_SECRET=secret_to_env(server.secret), SPARK_HVD_RANK=str(rank),
                   SPARK_HVD_SIZE="3", SPARK_HVD_JOB_ID="procs", SPARK_HVD_START_TIMEOUT="20",
                   V=f"value{rank}")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for p in procs:
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
        assert out.strip() == "value0|value1|value2"


@pytest.mark.timeout(30)
def test_allgather_timeout_names_missing_ranks(server):
    errors = {}

    def worker(rank):
        with client(server) as c:
            try:
                KVRendezvous(c, rank, 3, scope="late", timeout=2).allgather(b"x")
            except RuntimeError as e:
                errors[rank] = str(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(errors) == [0, 1]
    for msg in errors.values():
        assert msg.startswith("rendezvous timed out after 2 s: ranks [2] never arrived")


def test_rendezvous_from_env_requires_launcher_env():
    with pytest.raises(RuntimeError, match="start this process with spark-hvd-run"):
        rdv.rendezvous_from_env({})


@pytest.mark.timeout(30)
def test_rendezvous_from_env_is_the_one_init_uses(server):
    """Same keys and timeout as init()'s own rendezvous (the bootstrap builds it through this
    function): the scope of the job's init number ``generation``, whose first round a Spark task
    relays, and the start timeout under Horovod's name too. It once used the bare job id as
    its scope and SPARK_HVD_START_TIMEOUT only."""
    env = {"SPARK_HVD_RENDEZVOUS_ADDR": server.addr,
           "SPARK_HVD_SECRET": secret_to_env(server.secret), "SPARK_HVD_RANK": "0",
           "SPARK_HVD_SIZE": "2", "SPARK_HVD_JOB_ID": "j7", "HOROVOD_START_TIMEOUT": "1"}
    r = rdv.rendezvous_from_env(env, generation=3)
    started = time.monotonic()
    with pytest.raises(rdv.RendezvousTimeoutError,
                       match=r"timed out after 1 s: ranks \[1\] never arrived"):
        r.allgather(b"line of rank 0")
    assert time.monotonic() - started < 10
    r.client.close()
    with client(server) as c:
        assert c.get("j7/init.3", "allgather.0/0", timeout=0) == b"line of rank 0"


# -- elastic hooks: puts, hello, and a watched connection's end ----------------------------

def test_elastic_hooks_see_puts_hellos_and_closes():
    """on_put runs before the put is answered; a hello binds the connection to a worker id and
    its close is reported even while the server waits for a key on its behalf, within ~0.1 s."""
    events = []
    secret = make_secret()
    srv = RendezvousServer(secret, on_put=lambda s, k, v: events.append(("put", s, k, v)),
                           on_hello=lambda wid: events.append(("hello", wid)),
                           on_disconnect=lambda wid, how: events.append(
                               ("gone", wid, how, time.monotonic())),
                           peer_timeout=5)
    port = srv.start()
    try:
        addr = f"127.0.0.1:{port}"
        c = KVClient(addr, secret, timeout=5)
        c.put("job/elastic", "join/h/0/1/1", b"{}")
        assert events == [("put", "job/elastic", "join/h/0/1/1", b"{}")]
        srv.put("job/elastic", "x", b"1")  # the driver's own puts do not call the hook
        assert srv.get_nowait("job/elastic", "x") == b"1"
        assert srv.get_nowait("job/elastic", "missing") is None
        listener = KVClient(addr, secret, timeout=5, peer_timeout=5)
        listener.hello("h/0/1")
        assert events[-1] == ("hello", "h/0/1")
        waiting = threading.Thread(target=lambda: pytest.raises(
            RuntimeError, listener.get, "job/elastic", "notice/h/0/1/0", timeout=30))
        waiting.start()
        time.sleep(0.3)
        closed = time.monotonic()
        listener._sock.shutdown(socket.SHUT_RDWR)  # the process's end, seen by the server
        deadline = time.monotonic() + 5
        while not any(e[0] == "gone" for e in events) and time.monotonic() < deadline:
            time.sleep(0.01)
        gone = [e for e in events if e[0] == "gone"]
        assert gone and gone[0][1:3] == ("h/0/1", "closed"), events
        assert gone[0][3] - closed < 1.0
        waiting.join(5)
        c.close()
    finally:
        srv.stop()


def test_peer_timeout_socket_options():
    """The liveness settings the core uses, on rendezvous sockets (Linux)."""
    with socket.socket() as s:
        rdv.set_peer_timeout(s, 10)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 10000
    with socket.socket() as s:
        rdv.set_peer_timeout(s, 0)  # 0: the kernel's defaults
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
