"""Every error case raises on every rank, with a message naming the tensor and the ranks that
disagree, and the job keeps working afterwards (the next op succeeds).

Usage: errors.py
"""

import sys

import time

import numpy as np

import spark_hvd.numpy as hvd
from _wutil import Checks


def main():
    import os
    rank_env = int(os.environ["SPARK_HVD_RANK"])
    c = Checks(rank_env)

    # Before init: every query and op is a ValueError that says to call init().
    for what, fn in (("rank", hvd.rank), ("size", hvd.size), ("local_rank", hvd.local_rank),
                     ("allreduce", lambda: hvd.allreduce(np.ones(2), name="x")),
                     ("barrier", hvd.barrier), ("start_timeline",
                                                 lambda: hvd.start_timeline("/dev/null"))):
        c.raises(f"{what} before init", ValueError, fn, match="init")
    c.check(not hvd.is_initialized(), "is_initialized() before init")

    only0 = hvd.ProcessSet([0])
    hvd.init(process_sets=[only0])
    rank, size = hvd.rank(), hvd.size()
    others = [r for r in range(size) if r != rank]
    step = [0]

    def still_works(case):
        """The job survives the error: a fresh collective succeeds on every rank."""
        step[0] += 1
        tag = f"after/{case}"
        got = c.run(tag, hvd.allreduce, np.full(3, rank + 1, np.int32), name=tag, op=hvd.Sum)
        if got is not None:
            c.check(np.array_equal(got, np.full(3, size * (size + 1) // 2, np.int32)),
                    f"{tag}: got {got}")

    # -- cross-rank mismatches: raised on every rank by the coordinator --------------------

    # Shape: every rank sends a different length.
    c.raises("shape mismatch", ValueError, hvd.allreduce, np.ones(rank + 2, np.float32),
             name="bad_shape", op=hvd.Sum,
             match=["bad_shape", "Mismatched shapes", "ranks [0] sent [2]",
                    "ranks [1] sent [3]"])
    still_works("shape")

    # Shape mismatch of a fused tensor: the others in its batch still complete.
    hs = [hvd.allreduce_async(np.ones(4, np.float32), name=f"fused_ok.{i}", op=hvd.Sum)
          for i in range(3)]
    hbad = hvd.allreduce_async(np.ones(5 if rank == 0 else 6, np.float32), name="fused_bad",
                               op=hvd.Sum)
    for i, h in enumerate(hs):
        got = c.run(f"fused_ok.{i}", hvd.synchronize, h)
        if got is not None:
            c.check(np.array_equal(got, np.full(4, size, np.float32)), f"fused_ok.{i}: {got}")
    c.raises("fused shape mismatch", ValueError, hvd.synchronize, hbad,
             match=["fused_bad", "Mismatched shapes"])

    # Dtype: rank 0 float32, the others int32.
    arr = np.ones(4, np.float32 if rank == 0 else np.int32)
    c.raises("dtype mismatch", ValueError, hvd.allreduce, arr, name="bad_dtype", op=hvd.Sum,
             match=["bad_dtype", "Mismatched data types", "ranks [0] sent float32",
                    "int32"])
    still_works("dtype")

    # Op type: rank 0 allreduces, the others broadcast, under one name.
    x = np.ones(4, np.float32)
    if rank == 0:
        fn = lambda: hvd.allreduce(x, name="bad_op", op=hvd.Sum)  # noqa: E731
    else:
        fn = lambda: hvd.broadcast(x, 0, name="bad_op")  # noqa: E731
    c.raises("op type mismatch", ValueError, fn,
             match=["bad_op", "Mismatched collective operations", "allreduce", "broadcast",
                    "ranks [0]"])
    still_works("op")

    # Reduce op: Sum on rank 0, Max elsewhere.
    c.raises("reduce op mismatch", ValueError, hvd.allreduce, x, name="bad_reduce",
             op=hvd.Sum if rank == 0 else hvd.Max, match=["bad_reduce", "ranks [0]"])
    still_works("reduce_op")

    # A tensor answered before (its requests now travel as response-cache ids) changes on one
    # rank: the mismatch is still found, whichever side changed, and the old form works again.
    for changed in (0, size - 1):
        for _ in range(3):
            c.run("cached round", hvd.allreduce, np.ones(4, np.float32), name="cached_then_bad",
                  op=hvd.Sum)
        n = 5 if rank == changed else 4
        c.raises(f"cached tensor changes shape on rank {changed}", ValueError, hvd.allreduce,
                 np.ones(n, np.float32), name="cached_then_bad", op=hvd.Sum,
                 match=["cached_then_bad", "Mismatched shapes", f"ranks [{changed}] sent [5]"])
        got = c.run("cached round after", hvd.allreduce, np.ones(4, np.float32),
                    name="cached_then_bad", op=hvd.Sum)
        if got is not None:
            c.check(np.all(got == size), f"cached_then_bad after the mismatch: {got}")

    # Prescale factor differs.
    c.raises("prescale mismatch", ValueError, hvd.allreduce, x, name="bad_prescale", op=hvd.Sum,
             prescale_factor=1.0 + rank, match=["bad_prescale", "ranks [0]"])
    still_works("prescale")

    # Broadcast root differs.
    c.raises("root mismatch", ValueError, hvd.broadcast, x, rank, name="bad_root",
             match=["bad_root", "Mismatched root ranks", "ranks [0]", "ranks [1]"])
    still_works("root")

    # Allgather: trailing dimensions must agree (the first may differ).
    c.raises("allgather trailing dims", ValueError, hvd.allgather,
             np.ones((2, rank + 1), np.float32), name="bad_gather",
             match=["bad_gather", "ranks [0]", "ranks [1]"])
    still_works("allgather")

    # Alltoall trailing dims differ.
    c.raises("alltoall trailing dims", ValueError, hvd.alltoall,
             np.ones((size, rank + 1), np.float32), name="bad_a2a_dims",
             match=["bad_a2a_dims", "ranks [0]", "ranks [1]"])
    still_works("alltoall_dims")

    # Reducescatter shape differs.
    c.raises("reducescatter shape", ValueError, hvd.reducescatter,
             np.ones((size + rank, 2), np.float32), op=hvd.Sum, name="bad_rs",
             match=["bad_rs", "ranks [0]", "ranks [1]"])
    still_works("reducescatter")

    # Grouped allreduce: different group sizes (rank 0 with fewer tensors, then with more).
    for case, n0, n1 in (("fewer", 2, 3), ("more", 3, 2)):
        arrays = [np.ones(2, np.float32)] * (n0 if rank == 0 else n1)
        c.raises(f"group size mismatch ({case})", ValueError, hvd.grouped_allreduce, arrays,
                 name=f"bad_group_{case}", op=hvd.Sum,
                 match=[f"bad_group_{case}", "Mismatched grouped operation", "ranks [0]"])
        still_works(f"group_{case}")

    # -- local errors: raised where the bad call is made (here: on every rank) -------------

    c.raises("alltoall splits sum", ValueError, hvd.alltoall, np.ones((4, 2), np.float32),
             splits=[1] * size, name="bad_splits", match=["bad_splits", "splits sum to"])
    c.raises("alltoall float splits", ValueError, hvd.alltoall, np.ones((size, 2), np.float32),
             splits=[1.0] * size, name="float_splits", match=["must be integers"])
    c.raises("alltoall splits count", ValueError, hvd.alltoall, np.ones((4, 2), np.float32),
             splits=[4] + [0] * size, name="bad_nsplits", match=["bad_nsplits", "splits"])
    c.raises("alltoall negative split", ValueError, hvd.alltoall, np.ones((1,), np.float32),
             splits=[2, -1] + [0] * (size - 2), name="neg_split", match=["negative"])
    if size > 1:
        c.raises("alltoall indivisible", ValueError, hvd.alltoall,
                 np.ones((size + 1,), np.float32), name="bad_even", match=["divisible"])
    still_works("splits")

    for root in (size, -1):
        c.raises(f"invalid root {root}", ValueError, hvd.broadcast, x, root,
                 name=f"bad_root_{root}", match=[f"root rank {root}", f"bad_root_{root}"])
    still_works("invalid_root")

    c.raises("adasum int", ValueError, hvd.allreduce, np.ones(3, np.int32), name="adasum",
             op=hvd.Adasum, match=["Adasum", "floating-point", "int32"])
    c.raises("unknown op", ValueError, hvd.allreduce, x, name="bad_op_code", op=42)
    c.raises("reducescatter Max", ValueError, hvd.reducescatter, np.ones((size, 2)),
             op=hvd.Max, name="rs_max", match=["Sum", "Average"])
    # Horovod refuses it with a RuntimeError: both classes, like every CollectiveError.
    c.raises("reducescatter Adasum", RuntimeError, hvd.reducescatter, np.ones((size, 2)),
             op=hvd.Adasum, name="rs_adasum", match=["Sum", "Average", "Adasum"])
    c.raises("op and average", ValueError, hvd.allreduce, x, name="both", op=hvd.Sum,
             average=True)
    c.raises("unsupported dtype", ValueError, hvd.allreduce, np.ones(2, np.complex64),
             name="complex", match=["complex64"])
    c.raises("reducescatter 0-d", ValueError, hvd.reducescatter, np.float32(1.0), name="rs_scalar")
    still_works("local")

    # Duplicate in-flight name: the second submission fails locally, the first completes.
    # Rank 0 submits late, so on the other ranks the first "dup" is provably still in flight
    # when they submit it again (rank 0's own first op may complete at once, so it only
    # submits once).
    if hvd.rank() == 0:
        time.sleep(0.5)
    h = hvd.allreduce_async(np.ones(3, np.float32), name="dup", op=hvd.Sum)
    if hvd.rank() != 0:
        c.raises("duplicate name", ValueError, hvd.allreduce_async, np.ones(3, np.float32),
                 name="dup", op=hvd.Sum, match=["dup", "already in flight"])
    got = c.run("dup first", hvd.synchronize, h)
    if got is not None:
        c.check(np.array_equal(got, np.full(3, size, np.float32)), f"dup: {got}")
    # Once completed, the name can be used again.
    got = c.run("dup reuse", hvd.allreduce, np.ones(3, np.float32), name="dup", op=hvd.Sum)
    c.check(got is not None and np.array_equal(got, np.full(3, size, np.float32)),
            f"dup reuse: {got}")
    still_works("dup")

    # A group with one member's name in flight fails as a whole, and leaves none of its other
    # names marked in flight: they can be used at once (rank 0 is late again, as above).
    if hvd.rank() == 0:
        time.sleep(0.5)
    h = hvd.allreduce_async(np.ones(3, np.float32), name="grp.1", op=hvd.Sum)
    if hvd.rank() != 0:
        c.raises("group with a name in flight", ValueError, hvd.grouped_allreduce_async,
                 [np.ones(2, np.float32)] * 3, name="grp", op=hvd.Sum,
                 match=["grp.1", "already in flight"])
    c.run("grp.1", hvd.synchronize, h)
    got = c.run("grp.0 after the failed group", hvd.allreduce, np.ones(2, np.float32),
                name="grp.0", op=hvd.Sum)
    c.check(got is not None and np.array_equal(got, np.full(2, size, np.float32)),
            f"grp.0 after the failed group: {got}")
    still_works("dup_group")

    # A process set this rank is not in: a local error; its members are unaffected.
    if rank == 0:
        got = c.run("own set", hvd.allreduce, x, name="only0", op=hvd.Sum, process_set=only0)
        c.check(got is not None and np.array_equal(got, x), f"only0: {got}")
        # Roots are global ranks (Horovod's rule): rank 1 is outside the set [0].
        c.raises("root outside the set", ValueError, hvd.broadcast, x, 1, name="only0_root1",
                 process_set=only0, match=["only0_root1", "root rank 1",
                                           "not a member of process set"])
        got = c.run("root inside the set", hvd.broadcast, x, 0, name="only0_root0",
                    process_set=only0)
        c.check(got is not None and np.array_equal(got, x), f"only0_root0: {got}")
    else:
        c.raises("not a member", ValueError, hvd.allreduce, x, name="only0", op=hvd.Sum,
                 process_set=only0, match=["only0", f"rank {rank} is not a member"])
        c.raises("not a member (broadcast)", ValueError, hvd.broadcast, x, 0, name="only0_bc",
                 process_set=only0, match=["not a member"])
    # An unregistered ProcessSet object.
    c.raises("unregistered set", ValueError, hvd.allreduce, x, name="unreg",
             process_set=hvd.ProcessSet([0, 1]), match=["not registered"])
    # Dynamic process sets are off unless SPARK_HVD_DYNAMIC_PROCESS_SETS=1.
    c.raises("add_process_set disabled", ValueError, hvd.add_process_set, [size - 1],
             match=["SPARK_HVD_DYNAMIC_PROCESS_SETS"])
    still_works("process_sets")

    # A handle waited twice returns the same result; an unknown handle id is an error.
    h = hvd.allreduce_async(np.ones(2, np.float32), name="twice", op=hvd.Sum)
    a = hvd.synchronize(h)
    b = hvd.synchronize(h)
    c.check(a is b, "synchronize twice did not return the same result")

    hvd.shutdown()
    c.check(not hvd.is_initialized(), "is_initialized() after shutdown")
    c.raises("allreduce after shutdown", ValueError, hvd.allreduce, x, name="late", match="init")
    c.finish()


if __name__ == "__main__":
    sys.exit(main())
