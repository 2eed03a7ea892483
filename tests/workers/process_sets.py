"""Process-set behaviour beyond the op matrix (which collectives.py runs on static and dynamic
sets): the dynamic add/remove API and its errors, and sets used side by side.

Usage: process_sets.py MODE
  dynamic_api        add/remove/re-add, ids, errors (needs SPARK_HVD_DYNAMIC_PROCESS_SETS=1)
  static_errors      invalid init(process_sets=...) arguments
  unnamed_on_subsets unnamed ops and barrier() on a subset, then on the global set
  same_name_disjoint two disjoint sets use the same tensor names at the same time
"""

import os
import time

import numpy as np

import spark_hvd.numpy as hvd
from _wutil import Checks, run_mode


def dynamic_api(c):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    c.check(hvd.config().dynamic_process_sets, "dynamic_process_sets is off")
    # Two ranks: [0] and [1]; more: [0, last] and [1 .. last].
    pair = [0, size - 1] if size > 2 else [0]
    first = hvd.add_process_set(pair)
    c.check(first.process_set_id not in (None, 0), f"id {first.process_set_id}")
    c.check(first.ranks == pair, f"ranks {first.ranks}")
    second = hvd.add_process_set(hvd.ProcessSet(range(1, size)))
    c.check(second.process_set_id != first.process_set_id, "ids not distinct")
    for ps in (first, second):
        if rank in ps.ranks:
            got = hvd.allreduce(np.full(3, rank, np.int32), name=f"in{ps.process_set_id}",
                                op=hvd.Sum, process_set=ps)
            c.check(np.all(got == sum(ps.ranks)), f"set {ps.ranks}: {got}")
            got = hvd.allgather(np.array([rank]), name=f"ag{ps.process_set_id}", process_set=ps)
            c.check(got.tolist() == ps.ranks, f"set {ps.ranks}: allgather {got}")
            c.check(ps.size() == len(ps.ranks), f"size {ps.size()}")
    # Adding a set that exists, or naming a rank outside the job, fails on the caller.
    c.raises("duplicate set", ValueError, hvd.add_process_set, list(pair), match="exists")
    c.raises("rank out of range", ValueError, hvd.add_process_set, [0, size], match=f"{size}")
    c.raises("duplicate ranks", ValueError, hvd.ProcessSet, [0, 0], match="duplicate")
    c.raises("already registered", ValueError, hvd.add_process_set, first, match="registered")
    # Mismatched add_process_set calls across ranks fail on every rank.
    if size > 2:  # (with two ranks every subset exists already)
        c.raises("mismatched add", ValueError, hvd.add_process_set, [rank],
                 match="Mismatched add_process_set")
    # Remove: ops on the removed set fail, its id is not reused, the ranks can be added again.
    old_id = first.process_set_id
    c.check(hvd.remove_process_set(first) is True, "remove returned False")
    c.check(first.process_set_id is None, "removed set keeps its id")
    c.check(hvd.remove_process_set(first) is False, "second remove returned True")
    c.check(hvd.remove_process_set(hvd.global_process_set) is False, "removed the global set")
    if rank in pair:
        c.raises("op on a removed set", ValueError, hvd.allreduce, np.ones(2), name="gone",
                 process_set=first)
    again = hvd.add_process_set(list(pair))
    c.check(again.process_set_id not in (old_id, second.process_set_id),
            f"re-added set got id {again.process_set_id} (old {old_id})")
    if rank in again.ranks:
        got = hvd.allreduce(np.ones(2), name="again", op=hvd.Sum, process_set=again)
        c.check(np.all(got == len(pair)), f"re-added set: {got}")
    c.check(hvd.remove_process_set(again) and hvd.remove_process_set(second), "remove")
    # Many add/remove cycles keep every rank's registry in step.
    for i in range(10):
        ps = hvd.add_process_set([i % size])
        if rank == i % size:
            got = hvd.broadcast(np.array([i]), rank, name=f"cycle{i}", process_set=ps)
            c.check(got.tolist() == [i], f"cycle {i}: {got}")
        hvd.remove_process_set(ps)
    got = hvd.allreduce(np.ones(2), name="global_after", op=hvd.Sum)
    c.check(np.all(got == size), f"global after: {got}")
    hvd.shutdown()


def static_errors(c):
    size = int(os.environ["SPARK_HVD_SIZE"])
    c.raises("same set twice", ValueError, hvd.init, process_sets=[[0], [0]], match="twice")
    c.check(not hvd.is_initialized(), "initialized despite a bad process set list")
    c.raises("rank outside the job", ValueError, hvd.init,
             process_sets=[hvd.ProcessSet([0, size])], match=f"{size}")
    # That failed init registered nothing and left the engine running: shut it down and start
    # again with a valid list.
    hvd.shutdown()
    ps = hvd.ProcessSet([size - 1])
    hvd.init(process_sets=[ps])
    c.check(ps.process_set_id is not None, "valid set not registered")
    if hvd.rank() == size - 1:
        got = hvd.allreduce(np.ones(1), name="alone", op=hvd.Sum, process_set=ps)
        c.check(np.all(got == 1), f"alone: {got}")
    hvd.shutdown()


def unnamed_on_subsets(c):
    """Horovod lets a subset run unnamed ops and barriers while the other ranks do not: every
    op is scoped to its process set. Afterwards unnamed global ops must still line up."""
    size = int(os.environ["SPARK_HVD_SIZE"])
    sub = hvd.ProcessSet(range(size - 1))
    hvd.init(process_sets=[sub])
    rank = hvd.rank()
    if rank in sub.ranks:
        for _ in range(2):
            c.run("subset barrier", hvd.barrier, process_set=sub)
            got = c.run("subset allreduce", hvd.allreduce, np.ones(2), op=hvd.Sum,
                        process_set=sub)
            c.check(got is not None and np.all(got == len(sub.ranks)), f"subset: {got}")
    c.run("global barrier", hvd.barrier)
    got = c.run("global allreduce", hvd.allreduce, np.ones(2), op=hvd.Sum)
    c.check(got is not None and np.all(got == size), f"global: {got}")
    hvd.shutdown()


def same_name_disjoint(c):
    """Two disjoint sets (a "model-parallel" split) reduce tensors of the same names at the
    same time, as with Horovod's per-process-set negotiation."""
    size = int(os.environ["SPARK_HVD_SIZE"])
    half = size // 2
    a, b = hvd.ProcessSet(range(half)), hvd.ProcessSet(range(half, size))
    hvd.init(process_sets=[a, b])
    rank = hvd.rank()
    mine = a if rank in a.ranks else b
    for step in range(30):
        got = c.run(f"step {step}", hvd.allreduce, np.full(4, rank, np.float64),
                    name=f"grad.{step % 3}", op=hvd.Sum, process_set=mine)
        if got is None:
            break
        c.check(np.all(got == sum(mine.ranks)), f"step {step}: {got} != {sum(mine.ranks)}")
        if step % 7 == rank % 7:
            time.sleep(0.01)  # vary who submits first
    c.run("global barrier", hvd.barrier)
    hvd.shutdown()


if __name__ == "__main__":
    run_mode(globals())
