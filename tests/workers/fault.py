"""A rank SIGKILLs itself while the others are blocked in an allreduce; the survivors must raise
HorovodInternalError promptly, for pending and later ops, and shut down without hanging.

Usage: fault.py VICTIM MODE
  MODE "negotiate": the victim dies before submitting; survivors wait in negotiation.
  MODE "transfer":  the victim dies during a stream of large allreduces (mid data transfer).

Survivors ignore SIGTERM so that the launcher (which stops the remaining ranks as soon as one
dies) does not take them down before they have reported what they saw. $KILL_TIME_FILE gets
the victim's time of death.
"""

import os
import signal
import sys
import threading
import time

import numpy as np

import spark_hvd.numpy as hvd
from _wutil import Checks, write_pid


def main():
    victim, mode = int(sys.argv[1]), sys.argv[2]
    kill_file = os.environ["KILL_TIME_FILE"]
    write_pid()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    c = Checks(rank)
    if rank != victim:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    got = hvd.allreduce(np.ones(4, np.float32), name="warmup", op=hvd.Sum)
    c.check(np.array_equal(got, np.full(4, size, np.float32)), f"warmup: {got}")
    hvd.barrier()

    def die():
        with open(kill_file + ".tmp", "w") as f:
            f.write(repr(time.time()))
        os.rename(kill_file + ".tmp", kill_file)
        os.kill(os.getpid(), signal.SIGKILL)

    big = np.ones(4 * 2 ** 20, np.float32)
    if rank == victim:
        if mode == "negotiate":
            time.sleep(1.0)  # the survivors are blocked in "blocked" by now
            die()
        threading.Timer(1.0, die).start()
        for i in range(100000):
            hvd.allreduce(big, name=f"stream.{i % 4}", op=hvd.Sum)
        print(f"FAIL rank={rank} victim still alive", flush=True)
        os._exit(3)

    # Survivors.
    pending = hvd.allreduce_async(np.ones(8, np.float32), name="pending_async", op=hvd.Sum) \
        if mode == "negotiate" else None
    start = time.time()
    error = None
    try:
        if mode == "negotiate":
            hvd.allreduce(np.ones(8, np.float32), name="blocked", op=hvd.Sum)
        else:
            for i in range(100000):
                hvd.allreduce(big, name=f"stream.{i % 4}", op=hvd.Sum)
        c.fail("the allreduce returned although a peer died")
    except hvd.HorovodInternalError as e:
        error = e
    except Exception as e:  # noqa: BLE001
        c.fail(f"expected HorovodInternalError, got {type(e).__name__}: {e}")
    raised_at = time.time()
    deadline = time.time() + 10
    while not os.path.exists(kill_file) and time.time() < deadline:
        time.sleep(0.01)
    killed_at = float(open(kill_file).read()) if os.path.exists(kill_file) else start
    detect = raised_at - killed_at
    c.check(error is not None and str(error), f"error message: {error!r}")
    c.check(detect < 10.0, f"took {detect:.1f} s after the kill to raise")
    if pending is not None:
        c.raises("pending async op", hvd.HorovodInternalError, hvd.synchronize, pending)
    # Every later op raises too, quickly.
    t0 = time.time()
    c.raises("later allreduce", hvd.HorovodInternalError, hvd.allreduce,
             np.ones(2, np.float32), name="later", op=hvd.Sum)
    c.raises("later broadcast", hvd.HorovodInternalError, hvd.broadcast,
             np.ones(2, np.float32), 0, name="later_bc")
    c.raises("later barrier", hvd.HorovodInternalError, hvd.barrier)
    c.check(time.time() - t0 < 5.0, f"later ops took {time.time() - t0:.1f} s to fail")
    t0 = time.time()
    hvd.shutdown()
    c.check(time.time() - t0 < 5.0, f"shutdown took {time.time() - t0:.1f} s")
    c.finish(detect=f"{detect:.3f}", job=os.environ.get("SPARK_HVD_JOB_ID", ""),
             message=repr(str(error))[:200].replace(" ", "_"))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
