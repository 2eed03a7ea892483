"""Horovod's TensorFlow API on spark_hvd: change ``import horovod.tensorflow as hvd`` to
``import spark_hvd.tensorflow as hvd`` and nothing else.

    import tensorflow as tf
    import spark_hvd.tensorflow as hvd

    hvd.init()
    model = make_model()
    opt = tf.keras.optimizers.SGD(0.01 * hvd.size())

    @tf.function
    def train_step(x, y, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)       # gradients averaged over the ranks
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:                                # after the optimizer built its state
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

Run it with ``spark-hvd-run -np 4 python train.py`` (or ``spark_hvd.spark.run``). Keras users
import ``spark_hvd.keras`` (also reachable as ``spark_hvd.tensorflow.keras``).

Modules: ``collectives`` (the ops as TF kernels, eager and in graphs; join, barrier),
``differentiable`` (the public ops with gradients), ``functions`` (broadcast of variables and
objects), ``gradient_tape`` (DistributedGradientTape, PartialDistributedGradientTape),
``optimizer`` (DistributedOptimizer, tf.compat.v1 hooks), ``compression``,
``sync_batch_norm``; ``mpi_ops`` is kept as an alias for scripts that import it.
"""

import tensorflow as tf
# Horovod's private name, which its tests call (hvd._executing_eagerly()).
from tensorflow.python.eager.context import executing_eagerly as _executing_eagerly  # noqa: F401

from ..common.basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                             gloo_built, gloo_enabled, init, is_homogeneous, is_initialized,
                             local_rank, local_size, mpi_built, mpi_enabled,
                             mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size,
                             start_timeline, stop_timeline)
from ..common._ops import Adasum, Average, Max, Min, Product, Sum
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ..common.process_sets import (ProcessSet, add_process_set, global_process_set,
                                   remove_process_set)
from .collectives import CollectiveError, barrier, join
from .compression import Compression
from .differentiable import (allgather, allreduce, alltoall, broadcast, grouped_allgather,
                             grouped_allreduce, grouped_reducescatter, reducescatter)
from .functions import (allgather_object, broadcast_, broadcast_object, broadcast_object_fn,
                        broadcast_variables)
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from .optimizer import (BroadcastGlobalVariablesHook, DistributedOptimizer,
                        broadcast_global_variables)
from .sync_batch_norm import SyncBatchNormalization
from . import elastic  # noqa: E402 - hvd.elastic, as in Horovod


def _process_set_of(process_set_id):
    from ..common.process_sets import _registered
    return global_process_set if not process_set_id else _registered[process_set_id]


def size_op(process_set_id=0, name=None):
    """The number of ranks in the process set, as an int32 scalar tensor."""
    return tf.constant(_process_set_of(process_set_id).size(), tf.int32, name=name)


def local_size_op(name=None):
    """``local_size()`` as an int32 scalar tensor."""
    return tf.constant(local_size(), tf.int32, name=name)


def rank_op(name=None):
    """``rank()`` as an int32 scalar tensor."""
    return tf.constant(rank(), tf.int32, name=name)


def local_rank_op(name=None):
    """``local_rank()`` as an int32 scalar tensor."""
    return tf.constant(local_rank(), tf.int32, name=name)


def process_set_included_op(process_set_id=0, name=None):
    """1 if this rank belongs to the process set, else 0 (int32 scalar tensor)."""
    return tf.constant(int(_process_set_of(process_set_id).included()), tf.int32, name=name)


__all__ = [
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "CollectiveError", "Compression",
    "DistributedGradientTape", "DistributedOptimizer", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max", "Min", "PartialDistributedGradientTape", "ProcessSet",
    "Product", "Sum", "SyncBatchNormalization", "add_process_set", "allgather",
    "allgather_object", "allreduce", "alltoall", "barrier", "broadcast", "broadcast_",
    "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "broadcast_variables", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "gloo_built", "gloo_enabled", "global_process_set", "grouped_allgather",
    "grouped_allreduce", "grouped_reducescatter", "init", "is_homogeneous", "is_initialized",
    "join", "local_rank", "local_rank_op", "local_size", "local_size_op", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "process_set_included_op", "rank",
    "rank_op", "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size",
    "size_op", "start_timeline", "stop_timeline",
]

# hvd.mpi_ops, as in Horovod; imported last because it re-exports this package's names.
from . import mpi_ops  # noqa: E402,F401
