"""Horovod's module-level names that its own test suite reaches into, on a real job:
``hvd.mpi_ops._basics._get_process_set_ids_and_ranks()`` (torch and TensorFlow) through
dynamic process sets, a process set's string form, ``hvd._executing_eagerly``, and
reducescatter with op=Adasum refused with an error that is a RuntimeError (as Horovod's) and a
ValueError, in torch, TensorFlow and NumPy alike; torch.uint16 tensors through the core.
"""

import numpy as np
import tensorflow as tf
import torch

import spark_hvd.numpy as hnp
import spark_hvd.tensorflow as htf
import spark_hvd.torch as hvd
from _wutil import Checks


def main():
    hvd.init(process_sets="dynamic")
    rank, size = hvd.rank(), hvd.size()
    c = Checks(rank)
    everyone = list(range(size))
    for label, module in (("torch", hvd), ("tensorflow", htf)):
        table = module.mpi_ops._basics._get_process_set_ids_and_ranks()
        c.check(table == {0: everyone}, f"{label}: table at start {table}")
        c.check(module.mpi_ops._basics.size() == size, f"{label}: _basics.size()")
    added = hvd.add_process_set([size - 1])
    want_str = (f"ProcessSet(process_set_id={added.process_set_id}, ranks=[{size - 1}], "
                "mpi_comm=None)")
    c.check(str(added) == want_str, f"str(process set) {added} vs Horovod's {want_str}")
    want = {0: everyone, added.process_set_id: [size - 1]}
    for label, module in (("torch", hvd), ("tensorflow", htf)):
        table = module.mpi_ops._basics._get_process_set_ids_and_ranks()
        c.check(table == want, f"{label}: table after add {table} vs {want}")
    hvd.remove_process_set(added)
    table = htf.mpi_ops._basics._get_process_set_ids_and_ranks()
    c.check(table == {0: everyone}, f"table after remove {table}")

    c.check(htf._executing_eagerly() is True, "hvd._executing_eagerly() eagerly")
    with tf.Graph().as_default():
        c.check(htf._executing_eagerly() is False, "hvd._executing_eagerly() in a graph")

    rows = 2 * size
    for label, module, value in (("torch", hvd, torch.ones(rows, 2)),
                                 ("tensorflow", htf, tf.ones([rows, 2])),
                                 ("numpy", hnp, np.ones((rows, 2), np.float32))):
        e = c.raises(f"{label}: reducescatter Adasum", RuntimeError, module.reducescatter,
                     value, op=module.Adasum, match=["Adasum", "Average", "Sum"])
        c.check(isinstance(e, ValueError), f"{label}: {type(e).__mro__} is not a ValueError")
    got = hvd.reducescatter(torch.ones(rows, 2), op=hvd.Sum)  # nothing was enqueued above
    c.check(torch.equal(got, torch.full((2, 2), float(size))), f"reducescatter after: {got}")

    # torch.uint16 (few torch ops support it: the checks compare through int64).
    mine = torch.tensor([rank, 40000 + rank, 65535], dtype=torch.uint16)
    got = hvd.allreduce(mine, op=hvd.Max).to(torch.int64).tolist()
    c.check(got == [size - 1, 40000 + size - 1, 65535], f"uint16 allreduce Max: {got}")
    got = hvd.allreduce(mine, op=hvd.Sum).to(torch.int64).tolist()
    want = [sum(range(size)) % 65536, (40000 * size + sum(range(size))) % 65536,
            (65535 * size) % 65536]
    c.check(got == want, f"uint16 allreduce Sum (wraps as uint16): {got} vs {want}")
    got = hvd.allgather(mine).to(torch.int64).tolist()
    c.check(got == [v for r in range(size) for v in (r, 40000 + r, 65535)],
            f"uint16 allgather: {got}")
    got = hvd.broadcast(mine, size - 1).to(torch.int64).tolist()
    c.check(got == [size - 1, 40000 + size - 1, 65535], f"uint16 broadcast: {got}")
    hvd.shutdown()
    c.finish(size=size)


if __name__ == "__main__":
    main()
