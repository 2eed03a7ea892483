"""Worker for tests/test_shm_negotiation.py: the steady state of a training loop (the same named
allreduces every step, answered from the response cache), which on one host the ranks agree on
through shared memory, mixed with what the coordinator decides (new names, other ops, a shape
that one rank changes), with exact results checked on every rank.

  steady    40 steps of 12 async allreduces (float32/float64/int32, several shapes), a broadcast
            and, every 5 steps, an allgather; at step 20 rank 1 changes one tensor's shape (a
            mismatch every rank must report); a sub-set allreduce on ranks [0, 1]
"""

import numpy as np

import spark_hvd.numpy as hvd
from _wutil import Checks, run_mode

DTYPES = [np.float32, np.float64, np.int32]


def steady(c):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    pair = hvd.add_process_set([0, 1]) if hvd.config().dynamic_process_sets else None
    for step in range(40):
        handles = []
        for k in range(12):
            shape = (k + 1, 3) if not (step == 20 and k == 5 and rank == 1) else (k + 2, 3)
            x = np.full(shape, rank * 100 + step + k, DTYPES[k % 3])
            handles.append((k, shape, c.run(f"step {step} enqueue {k}", hvd.allreduce_async, x,
                                            name=f"grad.{k}", op=hvd.Sum)))
        for k, shape, h in handles:
            if h is None:
                continue
            if step == 20 and k == 5:
                c.raises(f"step {step}: mismatched grad.{k}", ValueError, hvd.synchronize, h,
                         match=["Mismatched shapes", "grad.5"])
                continue
            got = c.run(f"step {step} grad.{k}", hvd.synchronize, h)
            want = sum(r * 100 + step + k for r in range(size))
            c.check(got is not None and got.shape == shape and np.all(got == want),
                    f"step {step} grad.{k}: {None if got is None else got.ravel()[:3]} != {want}")
        got = c.run(f"step {step} broadcast", hvd.broadcast, np.full(4, rank + step, np.int64),
                    root_rank=step % size, name="weights")
        c.check(got is not None and np.all(got == step % size + step), f"step {step}: broadcast {got}")
        if step % 5 == 0:
            got = c.run(f"step {step} allgather", hvd.allgather, np.array([rank, step]),
                        name="gathered")
            c.check(got is not None and got.tolist() == [v for r in range(size) for v in (r, step)],
                    f"step {step}: allgather {got}")
        if pair is not None and rank in (0, 1):
            got = c.run(f"step {step} pair", hvd.allreduce, np.full(2, rank + 1.0), name="pair",
                        op=hvd.Sum, process_set=pair)
            c.check(got is not None and np.all(got == 3.0), f"step {step}: pair {got}")
    c.run("final barrier", hvd.barrier)
    hvd.shutdown()


if __name__ == "__main__":
    run_mode(globals())
