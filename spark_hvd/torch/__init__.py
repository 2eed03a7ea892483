"""Horovod's PyTorch API on spark_hvd: change ``import horovod.torch as hvd`` to
``import spark_hvd.torch as hvd`` and nothing else.

    import torch
    import spark_hvd.torch as hvd

    hvd.init()
    torch.set_num_threads(1)                     # CPU: one process per core
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for data, target in loader:                  # each rank reads its own shard
        optimizer.zero_grad()
        loss_fn(model(data), target).backward()  # gradients are averaged while backward runs
        optimizer.step()

Run it with ``spark-hvd-run -np 4 python train.py`` (or ``spark_hvd.spark.run``).

Modules: ``collectives`` (async and in-place ops, handles, join, barrier),
``differentiable`` (the synchronous ops, with autograd), ``functions`` (broadcast of
parameters, optimizer state and objects), ``optimizer`` (DistributedOptimizer),
``compression``, ``sync_batch_norm``, ``shared_gradients`` (gradients in memory the ranks on a
host share); ``mpi_ops`` is kept as an alias for scripts that import it.
"""

from ..common.basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                             gloo_built, gloo_enabled, init, is_homogeneous, is_initialized,
                             local_rank, local_size, mpi_built, mpi_enabled,
                             mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size,
                             start_timeline, stop_timeline)
from ..common._errors import CollectiveError
from ..common._ops import Adasum, Average, Max, Min, Product, Sum
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ..common.process_sets import (ProcessSet, add_process_set, global_process_set,
                                   remove_process_set)
from .collectives import (allgather_async, allreduce_, allreduce_async, allreduce_async_,
                          alltoall_async, barrier, broadcast_, broadcast_async, broadcast_async_,
                          grouped_allgather_async, grouped_allreduce_, grouped_allreduce_async,
                          grouped_allreduce_async_, grouped_reducescatter_async, join, poll,
                          reducescatter_async, sparse_allreduce_async, synchronize)
from .compression import Compression
from .differentiable import (allgather, allreduce, alltoall, broadcast, grouped_allgather,
                             grouped_allreduce, grouped_reducescatter, reducescatter)
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm
from . import elastic  # noqa: E402 - hvd.elastic, as in Horovod

__all__ = [
    "Adasum", "Average", "CollectiveError", "Compression", "DistributedOptimizer",
    "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min", "ProcessSet", "Product",
    "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async",
    "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built",
    "gloo_enabled", "global_process_set", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async", "init",
    "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]

# hvd.mpi_ops, as in Horovod; imported last because it re-exports this package's names.
from . import mpi_ops  # noqa: E402,F401
