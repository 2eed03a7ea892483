"""hvd.join with CUDA tensors: the last rank joins first; the others go on reducing CUDA
tensors (the joined rank contributes zeros), then join; join returns the rank that joined last,
and the job goes on with every rank.

Usage: join.py --expect nccl|host   (2 or more ranks)
"""

import torch

import spark_hvd.torch as hvd
from _data import ints, put, reference
from _gpu import C, main


def body(args, device):
    rank, size = hvd.rank(), hvd.size()
    if size < 2:
        C.fail("join", "needs 2 or more ranks")
    joiner = size - 1
    active = list(range(size - 1))
    xs = {i: [ints(f"join.{i}", r, (33,), -8, 9, torch.float32) for r in range(size)]
          for i in range(3)}
    # Warm-up with everyone: the CUDA path is set up before anyone joins.
    got = hvd.allreduce(put(xs[0][rank], device), op=hvd.Sum, name="join.warm")
    C.same(got, reference(xs[0], "Sum"), "allreduce with every rank before join", device=device)
    if rank == joiner:
        last = hvd.join(device=device.index if device.type == "cuda" else -1)
    else:
        for i in (1, 2):
            got = hvd.allreduce(put(xs[i][rank], device), op=hvd.Sum, name=f"join.{i}")
            C.same(got, reference([xs[i][r] for r in active], "Sum"),
                   f"allreduce {i} while rank {joiner} has joined (it contributes zeros)",
                   device=device)
        last = hvd.join(device=device.index if device.type == "cuda" else -1)
    C.check(last in active, f"join returned {last}, a rank that joined last",
            f"join returned {last!r}; ranks {active} joined after rank {joiner}")
    if size == 2:
        C.check(last == 0, "join returned rank 0 (the last to join)", f"returned {last!r}")
    got = hvd.allreduce(put(xs[1][rank], device), op=hvd.Sum, name="join.after")
    C.same(got, reference(xs[1], "Sum"), "allreduce with every rank after join", device=device)


if __name__ == "__main__":
    main(body)
