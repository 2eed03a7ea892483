"""The core reads and writes an op's tensors until the op completes, whatever the caller does
with the handle (Horovod's guarantee): handles dropped at once, a duplicate-name error beside a
dropped handle, shutdown() with ops in flight, and (TensorFlow, which has no async API) an eager
collective interrupted by a signal handler. After each case the memory the dropped tensors lived
in is reused by tensors of a known pattern, which must stay intact (a write into freed memory
breaks it, or the allocator aborts), and the job keeps working.

Usage: memory_safety.py {discard,duplicate,shutdown} {torch,numpy}
       memory_safety.py interrupted tf
"""

import signal
import sys
import time

import numpy as np

from _wutil import Checks

# Shapes of the dropped tensors and of the pattern tensors that reuse their memory: small ones
# come back from the allocator's free lists, the 1 MiB one from a fresh mapping.
SHAPES = [(17, 17, 17), (64,), (33,), (5, 7), (40,), (4, 9), (512, 512)]
PATTERN = -7.0


class Torch:
    def __init__(self):
        import torch
        import spark_hvd.torch as hvd
        torch.set_num_threads(1)
        self.torch, self.hvd = torch, hvd

    def rand(self, shape):
        return self.torch.rand(*shape)

    def full(self, shape, value):
        return self.torch.full(shape, float(value))

    def noncontiguous(self, rows, cols):
        """A transposed view: the adapter stages it through a contiguous copy (a temporary)."""
        return self.torch.rand(cols, rows).t()

    def numpy(self, t):
        return t.numpy()


class Numpy:
    def __init__(self):
        import spark_hvd.numpy as hvd
        self.hvd = hvd
        self.rng = np.random.default_rng(0)

    def rand(self, shape):
        return self.rng.random(shape, dtype=np.float32)

    def full(self, shape, value):
        return np.full(shape, value, np.float32)

    def noncontiguous(self, rows, cols):
        return self.rng.random((cols, rows), dtype=np.float32).T

    def numpy(self, t):
        return t


class TF:
    def __init__(self):
        import tensorflow as tf
        import spark_hvd.tensorflow as hvd
        self.tf, self.hvd = tf, hvd

    def rand(self, shape):
        return self.tf.random.uniform(shape)

    def full(self, shape, value):
        return self.tf.fill(shape, float(value))

    def numpy(self, t):
        return t.numpy()


def reuse_freed_memory(fw):
    """Tensors of every dropped size, filled with PATTERN: they take the freed memory."""
    return [fw.full(shape, PATTERN) for shape in SHAPES for _ in range(60)]


def check_pattern(c, fw, tensors, case):
    bad = sum(1 for t in tensors if not np.all(fw.numpy(t) == PATTERN))
    c.check(bad == 0, f"{case}: {bad} of {len(tensors)} pattern tensors were overwritten "
                      "(the core wrote into memory a dropped handle freed)")


def check_orphans_released(c, case):
    """The buffers of dropped handles go once their ops completed (no leak)."""
    from spark_hvd.common import _ops
    deadline = time.monotonic() + 20
    while _ops._orphans and time.monotonic() < deadline:
        _ops.sweep_orphans()
        time.sleep(0.01)
    c.check(not _ops._orphans, f"{case}: {len(_ops._orphans)} dropped handles still held after "
                               "their ops completed")


def still_works(c, fw, case):
    hvd = fw.hvd
    got = c.run(f"{case}: allreduce after", hvd.allreduce, fw.full((3,), hvd.rank() + 1),
                name=f"{case}.after", op=hvd.Sum)
    n = hvd.size()
    if got is not None:
        c.check(np.all(fw.numpy(got) == n * (n + 1) / 2), f"{case}: allreduce after gave {got}")


def discard(c, fw):
    """The issue's repro, and every async op with temporaries, handles dropped at once."""
    hvd = fw.hvd
    rank, size = hvd.rank(), hvd.size()
    for i in range(200):
        hvd.allreduce_async(fw.rand((17, 17, 17)), name=f"d.{i}")
    kept = [fw.full((64,), rank + 1) for _ in range(8)]  # in-place targets the caller keeps
    for i, t in enumerate(kept):
        hvd.allreduce_async_(t, name=f"inplace.{i}", op=hvd.Sum)
    hvd.allreduce_async(fw.noncontiguous(33, 5), name="noncontiguous")
    hvd.grouped_allreduce_async([fw.rand((33,)), fw.rand((5, 7))], name="grouped")
    hvd.allgather_async(fw.rand((rank + 1, 9)), name="allgather")
    hvd.broadcast_async(fw.rand((40,)), 0, name="broadcast")
    hvd.broadcast_async_(fw.rand((40,)), 0, name="broadcast_")
    hvd.alltoall_async(fw.rand((2 * size, 3)), name="alltoall")
    hvd.reducescatter_async(fw.rand((2 * size, 5)), name="reducescatter")
    hvd.allreduce_async(fw.rand((512, 512)), name="large")
    if isinstance(fw, Torch):
        hvd.grouped_allreduce_async_([fw.rand((33,)), fw.noncontiguous(4, 9)], name="grouped_")
        hvd.grouped_allgather_async([fw.rand((2, 3)), fw.rand((1,))], name="grouped_allgather")
        hvd.grouped_reducescatter_async([fw.rand((2 * size, 2))], name="grouped_rs")
        hvd.alltoall_async(fw.rand((2 * size, 3)), splits=fw.torch.tensor([size, size]),
                           name="alltoall_splits")
    pattern = reuse_freed_memory(fw)
    hvd.barrier()
    check_orphans_released(c, "discard")
    check_pattern(c, fw, pattern, "discard")
    for i, t in enumerate(kept):
        c.check(np.all(fw.numpy(t) == size * (size + 1) / 2),
                f"discard: in-place op inplace.{i} whose handle was dropped gave {t}")
    still_works(c, fw, "discard")


def duplicate(c, fw):
    """Horovod's *_duplicate_name_error tests: the first op's handle is dropped, the second is
    refused; both ranks survive and the first op completes once the other rank submits it."""
    hvd = fw.hvd
    rank, size = hvd.rank(), hvd.size()
    starts = {
        "allreduce": lambda t, name: hvd.allreduce_async(t, name=name),
        "allgather": lambda t, name: hvd.allgather_async(t, name=name),
        "broadcast": lambda t, name: hvd.broadcast_async(t, 0, name=name),
        "alltoall": lambda t, name: hvd.alltoall_async(t, name=name),
        "reducescatter": lambda t, name: hvd.reducescatter_async(t, name=name),
    }
    for kind, start in starts.items():
        name = f"duplicate_name.{kind}"
        for turn in (lambda r: r == 0, lambda r: r > 0):
            if turn(rank):
                start(fw.rand((2 * size, 17, 17)), name)
                c.raises(f"duplicate {kind}", ValueError, start, fw.rand((2 * size, 17, 17)),
                         name, match=[name, "already in flight"])
            hvd.barrier()
    pattern = reuse_freed_memory(fw)
    hvd.barrier()
    check_orphans_released(c, "duplicate")
    check_pattern(c, fw, pattern, "duplicate")
    still_works(c, fw, "duplicate")


def shutdown(c, fw):
    """shutdown() with ops in flight (matched and never matched, handles dropped and kept)
    returns, fails the pending ops, and the process exits 0."""
    hvd = fw.hvd
    rank = hvd.rank()
    for i in range(50):
        hvd.allreduce_async(fw.rand((17, 17, 17)), name=f"only_rank{rank}.{i}")
        hvd.allreduce_async(fw.rand((17, 17, 17)), name=f"every_rank.{i}")
    hvd.allgather_async(fw.rand((3, 4)), name=f"gather_only_rank{rank}")
    kept = hvd.allreduce_async(fw.rand((100,)), name=f"kept_only_rank{rank}")
    start = time.monotonic()
    hvd.shutdown()
    took = time.monotonic() - start
    c.check(took < 20, f"shutdown with ops in flight took {took:.1f} s")
    c.check(not hvd.is_initialized(), "still initialized after shutdown")
    pattern = reuse_freed_memory(fw)
    check_pattern(c, fw, pattern, "shutdown")
    c.raises("a kept handle after shutdown", Exception, hvd.synchronize, kept)
    from spark_hvd.common import _ops
    c.check(not _ops._orphans, f"shutdown: {len(_ops._orphans)} dropped handles still held")


class Interrupted(Exception):
    pass


def interrupted(c, fw):
    """Eager collectives a signal handler interrupts while the other rank is late: their
    tensors are dropped with the exception; the ops complete when it arrives."""
    hvd = fw.hvd
    rank, size = hvd.rank(), hvd.size()
    ops = [
        lambda: hvd.allreduce(fw.rand((17, 17, 17)), name="late.allreduce"),
        lambda: hvd.grouped_allreduce([fw.rand((33,)), fw.rand((512, 512))], name="late.grouped"),
        lambda: hvd.allgather(fw.rand((rank + 1, 9)), name="late.allgather"),
        lambda: hvd.broadcast(fw.rand((40,)), 0, name="late.broadcast"),
        lambda: hvd.reducescatter(fw.rand((2 * size, 5)), name="late.reducescatter"),
    ]
    if rank != 0:
        time.sleep(0.5 * len(ops) + 2)  # rank 0 is interrupted in each op meanwhile
        for op in ops:
            c.run("late op", op)
    else:
        def alarm(signum, frame):
            raise Interrupted()
        signal.signal(signal.SIGALRM, alarm)
        for i, op in enumerate(ops):
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            start = time.monotonic()
            c.raises(f"interrupted op {i}", Interrupted, op)
            took = time.monotonic() - start
            c.check(took < 1.3, f"op {i}: the SIGALRM set for 0.3 s was handled after {took:.2f} s")
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    pattern = reuse_freed_memory(fw)
    hvd.barrier()
    check_orphans_released(c, "interrupted")
    check_pattern(c, fw, pattern, "interrupted")
    still_works(c, fw, "interrupted")


def main():
    case, framework = sys.argv[1], sys.argv[2]
    fw = {"torch": Torch, "numpy": Numpy, "tf": TF}[framework]()
    fw.hvd.init()
    c = Checks(fw.hvd.rank())
    {"discard": discard, "duplicate": duplicate, "shutdown": shutdown,
     "interrupted": interrupted}[case](c, fw)
    c.finish(case=case, framework=framework)


if __name__ == "__main__":
    main()
