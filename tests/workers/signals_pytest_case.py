"""Runs pytest on itself inside each rank of a job (tests/test_signals.py): rank 0 blocks in an
allreduce whose peer comes 10 s later, and pytest-timeout's SIGALRM (``--timeout 1``) must fail
the test after about a second instead of when the peer arrives. Not collected by the suite (the
file name does not start with ``test_``).

Usage: signals_pytest_case.py
"""

import signal
import sys
import time

import numpy as np
import pytest

import spark_hvd.numpy as hvd

PEER_LATE_SECONDS = 10

if __name__ != "__main__":
    # Joined when pytest imports this file, before the 1 s limit starts: the two ranks'
    # start-ups may be over a second apart on a busy machine.
    hvd.init()


def test_blocked_allreduce():
    if hvd.rank() != 0:
        signal.setitimer(signal.ITIMER_REAL, 0)  # the late peer: its own limit does not apply
        time.sleep(PEER_LATE_SECONDS)
    hvd.allreduce(np.ones(4, np.float32), name="late")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "--timeout", "1",
                          "--timeout-method", "signal"]))
