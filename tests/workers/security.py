"""Connections without the job secret are refused, and the job still completes.

Usage: security.py strangers | wrong_secret

strangers: before the job's mesh is up, rank 0 probes the launcher's rendezvous server (raw
    garbage, a client with a wrong secret, a silent connection), and the last rank probes rank
    0's data listener (found in the rendezvous with the real secret) with a handshake signed by
    a wrong secret and with a silent connection. Then every rank joins normally and runs ops.
wrong_secret: the last rank replaces SPARK_HVD_SECRET with a wrong one before init(): it must be
    refused by the rendezvous, and the others must time out instead of running with it.
"""

import hashlib
import hmac
import os
import secrets
import socket
import struct
import sys
import threading
import time

import numpy as np

import spark_hvd.numpy as hvd
from _wutil import Checks
from spark_hvd.common._rendezvous import AUTH_FAILED_MESSAGE, KVClient
from spark_hvd.common._secret import secret_from_env


def parse_addr(addr):
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def closed_without_answer(sock, timeout=15.0):
    """True if the peer closes ``sock`` (or resets it) without sending anything more."""
    sock.settimeout(timeout)
    try:
        data = sock.recv(4096)
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return data == b""


def probe_rendezvous(c):
    addr = os.environ["SPARK_HVD_RENDEZVOUS_ADDR"]
    host, port = parse_addr(addr)
    # Garbage instead of the challenge answer.
    s = socket.create_connection((host, port), timeout=5)
    s.settimeout(5)
    hdr = s.recv(4)
    c.check(len(hdr) == 4, "rendezvous sent no challenge")
    (n,) = struct.unpack("!I", hdr)
    s.recv(n)
    s.sendall(struct.pack("!I", 64) + os.urandom(64))
    c.check(closed_without_answer(s), "rendezvous answered a client with a wrong HMAC")
    s.close()
    # A well-formed client that holds the wrong secret.
    c.raises("KVClient with a wrong secret", RuntimeError, KVClient, addr,
             secrets.token_bytes(32), timeout=5, match=AUTH_FAILED_MESSAGE)
    # A request sent without any handshake is not served.
    s = socket.create_connection((host, port), timeout=5)
    payload = struct.pack("!I", 3) + b"".join(struct.pack("!I", len(f)) + f
                                               for f in (b"G", b"scope", b"key"))
    s.sendall(struct.pack("!I", len(payload)) + payload)
    s.settimeout(5)
    try:
        hdr = s.recv(4)
        (n,) = struct.unpack("!I", hdr)
        body = s.recv(n)  # the server's challenge nonce, nothing else
        c.check(n == 32 and len(body) == 32, f"unexpected reply of {n} bytes")
        c.check(closed_without_answer(s), "rendezvous served a request without a handshake")
    except (ConnectionResetError, struct.error):
        pass
    s.close()


def probe_data_listener(c, target_rank, connected):
    """Connect to ``target_rank``'s core listener like a peer would, but sign the handshake
    with a wrong secret; the core must drop us without its answer. ``connected`` is set once
    our connections wait in the listener's backlog (ahead of this rank's real ones)."""
    secret = secret_from_env(os.environ["SPARK_HVD_SECRET"])
    job = os.environ.get("SPARK_HVD_JOB_ID", "job")
    try:
        with KVClient(os.environ["SPARK_HVD_RENDEZVOUS_ADDR"], secret, timeout=20) as kv:
            # The bootstrap publishes "host port host_id" per rank (common/_bootstrap.py).
            value = kv.get(f"{job}/init.0", f"allgather.0/{target_rank}", timeout=20).decode()
        host, port = value.split()[0], int(value.split()[1])
        # A silent stranger: holds a connection open and says nothing.
        silent = socket.create_connection((host, port), timeout=5)
        # A stranger that answers the challenge with a MAC made from a wrong key.
        s = socket.create_connection((host, port), timeout=5)
    finally:
        connected.set()
    s.settimeout(20)
    nonce_a = b""
    while len(nonce_a) < 32:
        chunk = s.recv(32 - len(nonce_a))
        if not chunk:
            break
        nonce_a += chunk
    if len(nonce_a) == 32:
        hello = struct.pack("<IIB", hvd_rank_env(), os.getpid(), 1) + os.urandom(32)
        mac = hmac.new(secrets.token_bytes(32), nonce_a + hello + b"spark_hvd-connect",
                       hashlib.sha256).digest()
        try:
            s.sendall(hello + mac)
        except (BrokenPipeError, ConnectionResetError):
            pass
        c.check(closed_without_answer(s), "the data listener accepted a wrong-secret handshake")
    # else: the listener closed us before even sending its challenge (its mesh was complete).
    s.close()
    return silent


def hvd_rank_env():
    return int(os.environ["SPARK_HVD_RANK"])


def strangers():
    rank = hvd_rank_env()
    size = int(os.environ["SPARK_HVD_SIZE"])
    c = Checks(rank)
    silent_rdv = None
    if rank == 0:
        host, port = parse_addr(os.environ["SPARK_HVD_RENDEZVOUS_ADDR"])
        silent_rdv = socket.create_connection((host, port), timeout=5)  # never speaks
        probe_rendezvous(c)
    holder = []
    t = None
    if rank == size - 1:
        # Rank 0's listener is up (it waits for us in the rendezvous). Queue two strangers in
        # its backlog before this rank's own connections, then join the job: rank 0 must drop
        # them and still connect everyone.
        connected = threading.Event()
        t = threading.Thread(target=lambda: holder.append(
            c.run("probe data listener", probe_data_listener, c, 0, connected)))
        t.start()
        c.check(connected.wait(30), "could not reach rank 0's listener")
    t0 = time.time()
    hvd.init()
    init_s = time.time() - t0
    if t is not None:
        t.join(60)
        c.check(not t.is_alive(), "probing the data listener hung")
    got = c.run("allreduce", hvd.allreduce, np.full(5, rank, np.int64), name="after_strangers",
                op=hvd.Sum)
    c.check(got is not None and np.array_equal(got, np.full(5, size * (size - 1) // 2)),
            f"allreduce: {got}")
    hvd.shutdown()
    if silent_rdv is not None:
        silent_rdv.close()
    for s in holder:
        if s is not None:
            s.close()
    c.finish(init_s=f"{init_s:.2f}")


def wrong_secret():
    rank = hvd_rank_env()
    size = int(os.environ["SPARK_HVD_SIZE"])
    c = Checks(rank)
    if rank == size - 1:
        os.environ["SPARK_HVD_SECRET"] = secrets.token_hex(32)
        c.raises("init with a wrong secret", RuntimeError, hvd.init,
                 match=["rejected", "secret"])
        c.check(not hvd.is_initialized(), "initialized with a wrong secret")
    else:
        t0 = time.time()
        e = c.raises("init while a rank cannot join", Exception, hvd.init,
                     match=[f"{size - 1}"])
        c.check(not hvd.is_initialized(), "initialized without the last rank")
        c.check(time.time() - t0 < 30, f"init took {time.time() - t0:.1f} s to fail")
        print(f"INFO rank={rank} error={type(e).__name__}: {e}", flush=True)
    c.finish()


if __name__ == "__main__":
    {"strangers": strangers, "wrong_secret": wrong_secret}[sys.argv[1]]()
