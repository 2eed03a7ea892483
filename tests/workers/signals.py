"""A rank blocked in a collective (its peer is late) handles signals at once: Ctrl-C's SIGINT
raises KeyboardInterrupt and a SIGALRM handler's exception propagates within a second, not when
the peer arrives. The interrupted op stays in flight: when the peer arrives it completes (an
in-place op writes its result, an async handle can be waited for again), later collectives
work, and an op the peer never submits fails at a clean shutdown.

Usage: signals.py {torch,numpy}
"""

import os
import signal
import sys
import threading
import time

import numpy as np

from _wutil import Checks

LATE_SECONDS = 6  # how long rank 1 sleeps: rank 0 is interrupted three times meanwhile
SIGNAL_AFTER = 0.3  # rank 0's signals come this long after it started waiting


class Alarm(Exception):
    pass


def on_alarm(signum, frame):
    raise Alarm()


def send_later(sig, sent):
    """Sends ``sig`` to this process from another thread after SIGNAL_AFTER seconds (as a
    terminal's Ctrl-C or a supervisor would) and records when."""
    def fire():
        sent.append(time.monotonic())
        os.kill(os.getpid(), sig)
    threading.Timer(SIGNAL_AFTER, fire).start()


def interrupt(c, what, sig, exc_type, fn, delays):
    """Runs ``fn`` (blocked on the late peer), delivers ``sig`` and expects ``exc_type``."""
    sent = []
    if sig == signal.SIGALRM:
        signal.setitimer(signal.ITIMER_REAL, SIGNAL_AFTER)
        sent.append(time.monotonic() + SIGNAL_AFTER)
    else:
        send_later(sig, sent)
    c.raises(what, exc_type, fn)
    delay = time.monotonic() - sent[0] if sent else float("inf")
    delays.append(delay)
    c.check(delay < 1.0, f"{what}: the exception came {delay:.2f} s after the signal")


def main():
    framework = sys.argv[1]
    if framework == "torch":
        import torch
        import spark_hvd.torch as hvd
        full = lambda n, v: torch.full((n,), float(v))  # noqa: E731
        as_np = lambda t: t.numpy()  # noqa: E731
    else:
        import spark_hvd.numpy as hvd
        full = lambda n, v: np.full(n, v, np.float32)  # noqa: E731
        as_np = lambda t: t  # noqa: E731
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    c = Checks(rank)
    total = size * (size + 1) / 2
    x = full(1000, rank + 1)  # reduced in place by the op SIGINT interrupts
    y = full(10, rank + 1)    # reduced in place by the op SIGALRM interrupts
    z = full(20, rank + 1)    # its async handle's wait is interrupted, then waited for again
    delays = []
    if rank == 0:
        signal.signal(signal.SIGALRM, on_alarm)
        interrupt(c, "SIGINT in allreduce_", signal.SIGINT, KeyboardInterrupt,
                  lambda: hvd.allreduce_(x, op=hvd.Sum, name="late.sigint"), delays)
        interrupt(c, "SIGALRM in allreduce_", signal.SIGALRM, Alarm,
                  lambda: hvd.allreduce_(y, op=hvd.Sum, name="late.sigalrm"), delays)
        handle = hvd.allreduce_async(z, op=hvd.Sum, name="late.async")
        interrupt(c, "SIGINT in synchronize", signal.SIGINT, KeyboardInterrupt,
                  lambda: hvd.synchronize(handle), delays)
        # Never submitted by the peer: it fails at shutdown, which must still be clean.
        interrupt(c, "SIGINT in an op the peer never runs", signal.SIGINT, KeyboardInterrupt,
                  lambda: hvd.allreduce(full(5, 1), name="never"), delays)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        c.check(not np.all(as_np(x) == total), "the interrupted op completed without the peer")
    else:
        time.sleep(LATE_SECONDS)
        hvd.allreduce_(x, op=hvd.Sum, name="late.sigint")
        hvd.allreduce_(y, op=hvd.Sum, name="late.sigalrm")
        handle = hvd.allreduce_async(z, op=hvd.Sum, name="late.async")
    got = c.run("waiting again for the interrupted handle", hvd.synchronize, handle)
    if got is not None:
        c.check(np.all(as_np(got) == total), f"interrupted async allreduce gave {got}")
    hvd.barrier()
    c.check(np.all(as_np(x) == total), f"interrupted allreduce_ (SIGINT) left {x[:4]}")
    c.check(np.all(as_np(y) == total), f"interrupted allreduce_ (SIGALRM) left {y[:4]}")
    after = c.run("allreduce after the interruptions", hvd.allreduce, full(3, rank + 1),
                  op=hvd.Sum, name="after")
    if after is not None:
        c.check(np.all(as_np(after) == total), f"allreduce after gave {after}")
    start = time.monotonic()
    hvd.shutdown()
    took = time.monotonic() - start
    c.check(took < 20, f"shutdown after the interruptions took {took:.1f} s")
    worst = max(delays) if delays else 0.0
    c.finish(framework=framework, worst_ms=f"{worst * 1e3:.0f}")


if __name__ == "__main__":
    main()
