"""Waiting for the ranks, and tearing the job down when one fails or the launcher is signalled.

A job is all or nothing: when any rank fails, the others would only hang in their next
collective, so they are stopped at once (SIGTERM to each rank's process group, SIGKILL after a
grace period). A SIGINT/SIGTERM to the launcher is forwarded the same way. Events (a rank
exited, a signal arrived) come through one queue, so the decisions are made in one thread.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from typing import Callable

from spark_hvd.launch.spawn import RankProcess

DEFAULT_GRACE_SECONDS = 5.0


def exit_code_of(returncode: int) -> int:
    """Shell convention: a process killed by signal N counts as exit code 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"was killed by signal {-returncode} ({name})"
    return f"exited with code {returncode}"


def _group_members_alive(pgid: int) -> bool | None:
    """Whether a live (non-zombie) process is in group ``pgid``; None when /proc is missing.

    kill(-pgid, 0) also succeeds for zombies nobody has reaped yet, which would make us wait a
    full grace period for processes that are already dead.
    """
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def group_alive(proc: RankProcess) -> bool:
    alive = _group_members_alive(proc.pgid) if sys.platform.startswith("linux") else None
    return proc.group_alive() if alive is None else alive


class Supervisor:
    """Supervises the ranks of one job; :meth:`run` returns the launcher's exit code."""

    def __init__(self, log: Callable[[str], None], grace_seconds: float = DEFAULT_GRACE_SECONDS):
        self.ranks: list[RankProcess] = []
        self._log = log
        self._grace = grace_seconds
        self._events: queue.Queue = queue.Queue()
        self._exit_code: int | None = None
        self._terminating = False
        self._kill_at: float | None = None

    def add(self, proc: RankProcess) -> None:
        """Watch a started rank (a thread waits for it and reports its exit)."""
        self.ranks.append(proc)

        def wait() -> None:
            proc.popen.wait()
            self._events.put(("exit", proc))

        threading.Thread(target=wait, name=f"spark-hvd-wait-{proc.rank}", daemon=True).start()

    def handle_signal(self, signum: int, frame=None) -> None:
        """Signal handler for the launcher: queue the signal for :meth:`run`."""
        self._events.put(("signal", signum))

    def fail(self, exit_code: int) -> None:
        """The job cannot go on (e.g. a rank failed to start): stop the ranks started so far."""
        if self._exit_code is None:
            self._exit_code = exit_code
        self._terminate(signal.SIGTERM)

    def run(self) -> int:
        pending = set(self.ranks)
        while pending:
            timeout = 0.5 if self._kill_at is None else max(0.0, self._kill_at - time.monotonic())
            try:
                kind, value = self._events.get(timeout=timeout)
            except queue.Empty:
                kind, value = None, None
            if kind == "exit":
                pending.discard(value)
                self._on_exit(value)
            elif kind == "signal":
                self._on_signal(value)
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                self._kill_all()
        self._stop_leftovers()
        return self._exit_code or 0

    def _on_exit(self, proc: RankProcess) -> None:
        rc = proc.returncode
        if rc == 0 or self._terminating:
            return
        others = [p for p in self.ranks if p.returncode is None]
        self._exit_code = exit_code_of(rc) or 1
        self._terminate(signal.SIGTERM)
        # Let the rank's last words (its traceback) reach the terminal before our verdict. The
        # pipes may be held open by processes the rank started, which the SIGTERM above stops.
        deadline = time.monotonic() + 0.5
        for t in getattr(proc, "output_threads", ()):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        where = f" on {proc.host}" if proc.remote else ""
        hint = ""
        if proc.remote and rc == 255:
            hint = (" (ssh's code for a connection failure: check that `ssh "
                    f"{proc.host}` works without a password prompt)")
        self._log(f"rank {proc.rank}{where} {describe_exit(rc)}{hint}")
        if others:
            self._log(f"terminating the remaining {len(others)} rank(s)")

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._terminating:
            # A second Ctrl-C: the user does not want to wait for the grace period.
            self._log(f"received {name} again: killing all ranks")
            self._kill_all()
            return
        self._log(f"received {name}: stopping all ranks")
        if self._exit_code is None:
            self._exit_code = 128 + signum
        self._terminate(signum)

    def _terminate(self, sig: int) -> None:
        """Send ``sig`` to every rank's group (also finished ones: their children may linger),
        and schedule SIGKILL after the grace period."""
        if self._terminating:
            return
        self._terminating = True
        for p in self.ranks:
            p.close_stdin()  # a remote rank's watcher takes this as the order to stop
            p.signal_group(sig)
        self._kill_at = time.monotonic() + self._grace

    def _kill_all(self) -> None:
        self._kill_at = None
        for p in self.ranks:
            p.signal_group(signal.SIGKILL)

    def _stop_leftovers(self) -> None:
        """After every rank exited: stop processes the ranks started and left behind (they
        would keep GPUs busy and hold our output pipes open)."""
        stop_leftovers(self.ranks, self._grace)


def stop_leftovers(procs, grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds, to the process groups of ``procs`` in
    which something still lives."""
    left = [p for p in procs if group_alive(p)]
    if not left:
        return
    for p in left:
        p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if group_alive(p)]
    for p in left:
        p.signal_group(signal.SIGKILL)
