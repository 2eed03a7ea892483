"""The core's GPU path on the emulated CUDA runtime and NCCL (tests/fake_cuda/fake_cuda.cc):
NumPy buffers handed to the core as tensors on a CUDA device, so the path a CUDA tensor takes
(ready events, the core's stream, NCCL communicators, fusion, the finalizer, device results)
runs through real processes on a machine without a GPU.

Usage: gpu_emulated.py check     every collective, against NumPy references, bitwise equal on
                                  every rank; prints the GPU counters
       gpu_emulated.py lost      the last rank is killed while the ranks stream allreduces;
                                  the others must get an error (prints ``LOST ... detect=``)

Devices: see _emulated_cuda.py.
"""

import os
import signal
import sys
import threading
import time

import numpy as np

import _emulated_cuda as hvd
from _emulated_cuda import allreduce_async as allreduce, device_result, enqueue
from _wutil import Checks, digest, make_input
from spark_hvd.common import _ops
from spark_hvd.common._native import OP_ALLGATHER, OP_ALLTOALL, OP_BROADCAST, OP_REDUCESCATTER


def check(c: Checks) -> None:
    n, me = hvd.size(), hvd.rank()
    digests = []

    def expect(tag, got, want, exact=True, same_everywhere=True):
        if exact:
            ok = got.shape == want.shape and np.array_equal(got, want)
        else:
            # Floats: the sums' order differs by path (hierarchical: per host first).
            tol = 0.05 if got.dtype == np.float16 else 1e-5
            ok = got.shape == want.shape and np.allclose(got, want, rtol=tol, atol=tol)
        c.check(ok, f"{tag}: got {got.ravel()[:6]} want {want.ravel()[:6]}")
        if same_everywhere:
            digests.append(np.frombuffer(digest(got), dtype=np.uint8))

    # Allreduce: one tensor at a time, then many fused (one response, the fusion buffer).
    for dtype in (np.float32, np.float64, np.int32, np.int64, np.uint8, np.float16):
        for count in (1, 1031, 300_007):
            tag = f"allreduce-{np.dtype(dtype).name}-{count}"
            ins = [make_input(r, (count,), dtype, tag) for r in range(n)]
            h, out = allreduce(ins[me], tag)
            _ops.wait(h, (ins[me], out))
            want = ins[0].copy()
            for r in range(1, n):
                want = (want + ins[r]).astype(dtype)
            expect(tag, out, want, exact=np.dtype(dtype).kind != "f")
    tags = [f"fused-{i}" for i in range(12)]
    ins = {t: [make_input(r, (17 + 5 * i,), np.float32, t) for r in range(n)]
           for i, t in enumerate(tags)}
    handles = [allreduce(ins[t][me], t) for t in tags]
    for t, (h, out) in zip(tags, handles):
        _ops.wait(h, (ins[t][me], out))
        expect(t, out, sum(ins[t][r].astype(np.float64) for r in range(n)), exact=False)
    # Average with prescale and postscale (NCCL's PreMulSum), Min and Max.
    tag = "scaled"
    ins = [make_input(r, (4099,), np.float32, tag) for r in range(n)]
    h, out = allreduce(ins[me], tag, _ops.Average, prescale_factor=0.5, postscale_factor=3.0)
    _ops.wait(h, (ins[me], out))
    expect(tag, out, sum(i.astype(np.float64) for i in ins) * 1.5 / n, exact=False)
    for op, fn in ((_ops.Min, np.minimum.reduce), (_ops.Max, np.maximum.reduce)):
        tag = f"minmax-{op}"
        ins = [make_input(r, (513,), np.int32, tag) for r in range(n)]
        h, out = allreduce(ins[me], tag, op)
        _ops.wait(h, (ins[me], out))
        expect(tag, out, fn(ins))
    # Broadcast from the last rank, in place.
    tag = "broadcast"
    ins = [make_input(r, (3, 1000), np.float32, tag) for r in range(n)]
    buf = ins[me].copy()
    h = _ops.enqueue_one(OP_BROADCAST, tag, hvd._DTYPES[buf.dtype], buf.shape, hvd.ptr(buf),
                         hvd.ptr(buf), root_rank=n - 1, place=hvd.place())
    _ops.wait(h, (buf,))
    expect(tag, buf, ins[n - 1])
    # Allgather: equal and ragged first dimensions (a result the core allocates on the device).
    for ragged in (False, True):
        tag = f"allgather-{ragged}"
        rows = [(r + 1 if ragged else 2) for r in range(n)]
        ins = [make_input(r, (rows[r], 5), np.float32, tag) for r in range(n)]
        h = enqueue(OP_ALLGATHER, tag, ins[me])
        out, _ = device_result(h, np.float32)
        expect(tag, out, np.concatenate(ins))
    # Alltoall with uneven splits.
    tag = "alltoall"
    splits = [[(s + d) % 3 + 1 for d in range(n)] for s in range(n)]
    ins = [make_input(r, (sum(splits[r]), 4), np.int64, tag) for r in range(n)]
    h = enqueue(OP_ALLTOALL, tag, ins[me], splits=tuple(splits[me]))
    out, received = device_result(h, np.int64, want_ints=n)
    parts = []
    for s in range(n):
        start = sum(splits[s][:me])
        parts.append(ins[s][start:start + splits[s][me]])
    expect(tag, out, np.concatenate(parts), same_everywhere=False)
    c.check(list(received) == [splits[s][me] for s in range(n)], f"{tag}: splits {received}")
    # Reducescatter: even and uneven blocks.
    for rows in (2 * n, 2 * n + 1):
        tag = f"reducescatter-{rows}"
        ins = [make_input(r, (rows, 3), np.float32, tag) for r in range(n)]
        h = enqueue(OP_REDUCESCATTER, tag, ins[me], reduce_op=_ops.Sum)
        out, _ = device_result(h, np.float32)
        total = sum(i.astype(np.float64) for i in ins)
        bounds = np.cumsum([0] + [rows // n + (r < rows % n) for r in range(n)])
        expect(tag, out, total[bounds[me]:bounds[me + 1]], exact=False, same_everywhere=False)
    # A dtype NCCL lacks (int16) goes through host memory, and is counted.
    tag = "int16"
    ins = [make_input(r, (100,), np.int16, tag) for r in range(n)]
    before = hvd.gpu_counters()["host_staged_bytes"]
    h, out = allreduce(ins[me], tag)
    _ops.wait(h, (ins[me], out))
    expect(tag, out, sum(i.astype(np.int64) for i in ins).astype(np.int16))
    staged = hvd.gpu_counters()["host_staged_bytes"] - before
    c.check(staged == 2 * ins[me].nbytes, f"int16: {staged} bytes staged")

    # A process set of ranks 0 and 1 gets communicators of its own, which go with the set.
    if n >= 3:
        ps = hvd.add_process_set([0, 1])
        if me in (0, 1):
            for i in range(2):
                tag = f"set-{i}"
                ins = [make_input(r, (99,), np.float64, tag) for r in (0, 1)]
                h, out = allreduce(ins[me], tag, process_set=ps.process_set_id)
                _ops.wait(h, (ins[me], out))
                expect(tag, out, ins[0] + ins[1], exact=False, same_everywhere=False)
        hvd.remove_process_set(ps)
    # Join: the last rank joins at once and the others allreduce; the joined rank takes part
    # in their NCCL allreduces with zeros, having no tensor of its own.
    if me != n - 1:
        for i in range(3):
            tag = f"joined-{i}"
            ins = [make_input(r, (777,), np.float32, tag) for r in range(n)]
            h, out = allreduce(ins[me], tag)
            _ops.wait(h, (ins[me], out))
            expect(tag, out, sum(ins[r].astype(np.float64) for r in range(n - 1)), exact=False,
                   same_everywhere=False)
    last = hvd.join()
    c.check(0 <= last < n - 1, f"join: the last to join was rank {last}")
    # Every rank got the same bits.
    mine = np.concatenate(digests)
    every = hvd.allgather(mine[None, :])
    c.check(all(np.array_equal(every[r], mine) for r in range(n)), "results differ across ranks")
    counters = hvd.gpu_counters()
    print("COUNTERS " + " ".join(f"{k}={v}" for k, v in sorted(counters.items())), flush=True)


def lost(c: Checks) -> None:
    """The last rank streams 4M-float allreduces with the others, its third hangs in NCCL,
    and it SIGKILLs itself after 1 s (writing the time to $KILL_TIME_FILE); the others,
    ignoring the launcher's SIGTERM so they can report, must raise for their op in flight,
    which waits in NCCL for the dead rank's data (the emulated NCCL, like NCCL, waits for a
    lost peer until the core aborts the communicator). The failed op's output must not change
    once the error was raised, not even when the core shuts down: the GPU work queued for it
    must have ended before the buffer was handed back. With FAKE_NCCL_STUCK=1 the others'
    hung work ignores the abort (a GPU stuck for real): the core gives up waiting for it 10 s
    after the abort, and the rank reports and exits without shutting down."""
    n, me = hvd.size(), hvd.rank()
    stuck = os.environ.get("FAKE_NCCL_STUCK") == "1"
    kill_file = os.environ["KILL_TIME_FILE"]
    a = np.ones(1 << 22, dtype=np.float32)
    if me == n - 1:
        # Its third collective never ends (a kernel waiting for data that never comes), so
        # the others wait in NCCL for its data when it dies.
        os.environ["FAKE_NCCL_HANG_AT"] = "3"

        def die():
            with open(kill_file + ".tmp", "w") as f:
                f.write(repr(time.time()))
            os.rename(kill_file + ".tmp", kill_file)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(1.0, die).start()
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for step in range(100_000):
        out = np.full_like(a, -7.0)
        try:
            h, out = allreduce(a, f"lost-{step % 4}", out=out)
            _ops.wait(h, (a, out))
        except Exception as e:  # noqa: BLE001 - the error is what we look at
            if me == n - 1:
                raise
            seen = out.copy()
            killed_at = float(open(kill_file).read()) if os.path.exists(kill_file) else None
            c.check(killed_at is not None, f"step {step} failed before the kill: {e}")
            detect = time.time() - killed_at if killed_at else -1
            head = f"LOST rank={me} step={step} detect={detect:.2f}"
            error = f"error={type(e).__name__}: {str(e)[:400]!r}"
            if stuck:  # the stuck work holds the core's stream: shutdown would wait for it
                print(f"{head} {error}", flush=True)
                c.finish()
                os._exit(0)
            hvd.shutdown()  # aborts what is left of the GPU work, if anything is
            rewritten = not np.array_equal(out, seen)
            c.check(not rewritten, "the failed op's output changed after its error was raised")
            print(f"{head} rewritten={int(rewritten)} {error}", flush=True)
            return
        c.check(out[0] == n, f"step {step}: {out[0]}")
    c.fail("no error after the last rank was killed")


if __name__ == "__main__":
    hvd.init()
    c = Checks(hvd.rank())
    from spark_hvd.common import _gpu
    c.check(_gpu.status() == 2, f"the emulated libraries did not load: {_gpu.report()}")
    {"check": check, "lost": lost}[sys.argv[1]](c)
    c.finish()
    hvd.shutdown()
