"""Allreduces until a peer is lost (a host cut off or frozen, a rank stopped): the rank reports
when and how its op failed.

Usage: lost_peer.py ELEMS OPS [LATE_RANKS LATE_SECONDS [STOP_RANK STOP_AFTER CONT_AFTER]]
  ELEMS         float32 elements per allreduce
  OPS           allreduces to run (0: until one fails)
  LATE_RANKS    comma-separated ranks that print "LATE rank=R" and sleep LATE_SECONDS (idle,
                in no collective) before their first allreduce; the others start at once
  STOP_RANK     this rank SIGSTOPs itself (from a thread, so most likely mid-transfer) once it
                completed STOP_AFTER allreduces of the stream; CONT_AFTER > 0: a helper process
                resumes it that many seconds later
$FRAMEWORK: "torch", "torch-cuda" (CUDA tensors: the NCCL path; every rank on the GPU of its
local rank, modulo the GPUs there are), "emulated-cuda" (NumPy buffers as CUDA tensors of the
emulated CUDA runtime and NCCL: tests/fake_cuda) or "numpy" (default). $STOP_SIGNAL=KILL makes
STOP_RANK SIGKILL itself instead (a rank lost for good, its sockets closed by its kernel). Every rank
prints "READY rank=R host=H" after a first allreduce, "ERROR rank=R at=T called=C ops=N
error=..." (T, C: time.monotonic() of the failure and of the failed call; the clock is shared
by every network namespace of the machine) and exits 3 when an op raises HorovodInternalError,
or "OK rank=R ops=N seconds=S" when OPS completed with correct sums; with $REPORT_DIR set, the
ERROR line also goes to REPORT_DIR/rank<R>.txt (ranks cut off from the launcher report there).
Ranks ignore SIGTERM so the launcher, which stops the others once one rank exits, does not take
them down before they report.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np


def _framework():
    if os.environ.get("FRAMEWORK") == "torch":
        import torch
        import spark_hvd.torch as hvd
        return hvd, lambda a: torch.from_numpy(a), lambda t: t.numpy()
    if os.environ.get("FRAMEWORK") == "torch-cuda":
        import torch
        import spark_hvd.torch as hvd
        local = int(os.environ.get("SPARK_HVD_LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return (hvd, lambda a: torch.from_numpy(a).cuda(),
                lambda t: t.cpu().numpy())  # .cpu() waits for the collective's stream
    if os.environ.get("FRAMEWORK") == "emulated-cuda":
        import _emulated_cuda as hvd
        return hvd, lambda a: a, lambda a: a
    import spark_hvd.numpy as hvd
    return hvd, lambda a: a, lambda a: a


def _stop_later(progress, after_ops, cont_after):
    def stop():
        while progress[0] < after_ops:
            time.sleep(0.001)
        if cont_after > 0:  # a separate process: this one cannot resume itself
            subprocess.Popen(["sh", "-c", f"sleep {cont_after}; kill -CONT {os.getpid()}"])
        kill = os.environ.get("STOP_SIGNAL") == "KILL"
        print(f"{'KILLING' if kill else 'STOPPING'} rank at={time.monotonic():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL if kill else signal.SIGSTOP)
    threading.Thread(target=stop, daemon=True).start()


def main():
    elems, ops = int(sys.argv[1]), int(sys.argv[2])
    late = {int(r) for r in sys.argv[3].split(",") if r} if len(sys.argv) > 3 else set()
    late_seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    stop_rank = int(sys.argv[5]) if len(sys.argv) > 5 else -1
    stop_after = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    cont_after = float(sys.argv[7]) if len(sys.argv) > 7 else 0.0
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    hvd, to_tensor, to_numpy = _framework()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    data = to_tensor(np.full(elems, rank + 1, np.float32))
    want = size * (size + 1) / 2
    first = to_numpy(hvd.allreduce(data, name="first", op=hvd.Sum))
    if not np.all(first == want):
        print(f"FAIL rank={rank} first allreduce: {first[:4]}", flush=True)
    print(f"READY rank={rank} host={socket.gethostname()}", flush=True)
    if rank in late:
        print(f"LATE rank={rank}", flush=True)
        time.sleep(late_seconds)
    progress = [0]  # allreduces completed, for the stop thread
    if rank == stop_rank:
        _stop_later(progress, stop_after, cont_after)
    done, start, called = 0, time.monotonic(), 0.0
    try:
        while ops == 0 or done < ops:
            called = time.monotonic()
            got = to_numpy(hvd.allreduce(data, name=f"step{done % 8}", op=hvd.Sum))
            if not np.all(got == want):
                print(f"FAIL rank={rank} op {done}: {got[:4]} != {want}", flush=True)
            done += 1
            progress[0] = done
    except hvd.HorovodInternalError as e:
        one_line = " ".join(str(e).split())
        report = (f"ERROR rank={rank} at={time.monotonic():.3f} called={called:.3f} ops={done} "
                  f"error={one_line}")
        # The file first: once the launcher is gone (it stops when one rank exits), printing
        # raises BrokenPipeError.
        if os.environ.get("REPORT_DIR"):
            with open(os.path.join(os.environ["REPORT_DIR"], f"rank{rank}.txt"), "w") as f:
                f.write(report + "\n")
        try:
            print(report, flush=True)
        except BrokenPipeError:
            pass
        sys.exit(3)
    print(f"OK rank={rank} ops={done} seconds={time.monotonic() - start:.2f}", flush=True)


if __name__ == "__main__":
    main()
