"""What an elastic job's workers and its driver say to each other, and under which keys.

Everything goes through the job's authenticated rendezvous store, in the scope
``_bootstrap_contract.elastic_scope(job)``; values are JSON. The driver is the single authority:
it numbers the rounds, assigns ranks, decides whether every member syncs, and pushes notices.

=========================  ========  ========================================================
key                        writer    value
=========================  ========  ========================================================
op ``H`` hello(wid)        worker    binds the worker's listener connection to ``wid``: its
                                     close (process gone) or time-out (host silent for the
                                     peer timeout) is a loss the driver sees at once
``join/<wid>/<seq>``       worker    ``addr`` ("host port host_id hostname"), ``reason``
                                     (start, interrupt, failure, reinit), ``error``,
                                     ``commit`` (the commit token), ``in_run``, ``last_round``
``assign/<wid>/<seq>``     driver    ``{round, rank, sync}``, or ``{removed: why}``,
                                     ``{finished: true}``, ``{error: why}``
``plan/<R>``               driver    ``{round, size, peers, slots, sync, notice}``
``notice/<wid>/<k>``       driver    ``{kind: hosts_updated, id, timestamp, update}``,
                                     ``{kind: abort, round, why}``; k = 0, 1, ... per worker
``done/<wid>``             worker    ``{round, rank}``: finished normally
``error/<wid>``            worker    ``{kind: user, type, message, traceback}`` before it exits
=========================  ========  ========================================================

Pure data: the standard library only, so the launcher can import it.
"""

from __future__ import annotations

import enum
import json

# Why a worker asks to join the next round.
REASON_START = "start"          # first init() of the process
REASON_INTERRUPT = "interrupt"  # HostsUpdatedInterrupt at a commit
REASON_FAILURE = "failure"      # HorovodInternalError (a peer was lost, or the driver aborted)
REASON_REINIT = "reinit"        # shutdown() then init() outside hvd.elastic.run

NOTICE_HOSTS_UPDATED = "hosts_updated"
NOTICE_ABORT = "abort"


class HostUpdateResult(enum.IntFlag):
    """What changed in the hosts (Horovod's ``horovod.runner.elastic.worker.HostUpdateResult``)."""
    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


def join_key(wid: str, seq: int) -> str:
    return f"join/{wid}/{seq}"


def assign_key(wid: str, seq: int) -> str:
    return f"assign/{wid}/{seq}"


def plan_key(round_: int) -> str:
    return f"plan/{round_}"


def notice_key(wid: str, k: int) -> str:
    return f"notice/{wid}/{k}"


def done_key(wid: str) -> str:
    return f"done/{wid}"


def error_key(wid: str) -> str:
    return f"error/{wid}"


def parse_key(key: str) -> tuple[str, str, int | None] | None:
    """``(kind, wid, seq)`` of a key a worker writes (join, done, error); None for others."""
    kind, sep, rest = key.partition("/")
    if not sep:
        return None
    if kind == "join":
        wid, sep, seq = rest.rpartition("/")
        if sep and seq.isdigit():
            return kind, wid, int(seq)
        return None
    if kind in ("done", "error"):
        return kind, rest, None
    return None


def encode(value) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def decode(data: bytes):
    return json.loads(data.decode())


def worker_id(host: str, slot: int, seq: int) -> str:
    """A worker's id: its host, its slot there, and the driver's spawn counter."""
    return f"{host}/{slot}/{seq}"
