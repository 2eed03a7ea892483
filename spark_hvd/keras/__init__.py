"""Horovod's Keras API on Keras 3, on the TensorFlow, torch and JAX backends: change
``import horovod.tensorflow.keras as hvd`` (or ``horovod.keras``) to
``import spark_hvd.keras as hvd`` (or ``spark_hvd.tensorflow.keras``) and nothing else.

    import keras
    import spark_hvd.keras as hvd

    hvd.init()
    model = make_model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback()]
    if hvd.rank() == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint("checkpoint-{epoch}.keras"))
    model.fit(x, y, epochs=5, callbacks=callbacks, verbose=1 if hvd.rank() == 0 else 0)

Run it with ``spark-hvd-run -np 4 python train.py``; ``KERAS_BACKEND`` (tensorflow, torch or
jax, set before keras is imported, as Keras wants) picks how the gradients travel (see
``_backend``). On TensorFlow the collectives run as Python kernels (``tf.numpy_function``),
which XLA cannot compile: on a GPU machine, where Keras 3's ``jit_compile="auto"`` turns XLA
on, pass ``jit_compile=False`` to ``model.compile``. JAX's compiled steps need nothing.

Modules: ``optimizer`` (DistributedOptimizer, PartialDistributedOptimizer), ``callbacks``,
``elastic``, ``compression``.
"""

import keras

from ..common.basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                             gloo_built, gloo_enabled, init, is_homogeneous, is_initialized,
                             local_rank, local_size, mpi_built, mpi_enabled,
                             mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size,
                             start_timeline, stop_timeline)
from ..common._ops import Adasum, Average, Max, Min, Product, Sum
from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ..common.process_sets import (ProcessSet, add_process_set, global_process_set,
                                   remove_process_set)
from ..common._errors import CollectiveError
from ..common._ops import resolve_reduce_op as _resolve_reduce_op
from ..common.session_objects import allgather_object, broadcast_object, broadcast_object_fn
from . import _backend
from .compression import Compression

_backend.name()  # an unsupported KERAS_BACKEND fails here, on every rank, saying what to do

from . import callbacks, elastic  # noqa: E402
from .optimizer import (DistributedOptimizer, PartialDistributedOptimizer,  # noqa: E402
                        _DistributedOptimizer)


def broadcast_global_variables(root_rank):
    """Broadcasts every global variable of the ``tf.compat.v1`` graph from ``root_rank``.

    Keras 3 has no global variables and runs eagerly: as in Horovod under TF2 this raises;
    use ``callbacks.BroadcastGlobalVariablesCallback(root_rank)`` in ``fit`` or
    ``hvd.broadcast_variables(model.variables, root_rank)``.
    """
    if _backend.name() != "tensorflow":
        raise ValueError("broadcast_global_variables broadcasts a tf.compat.v1 graph's global "
                         "variables, which Keras 3 does not have: use "
                         "callbacks.BroadcastGlobalVariablesCallback(root_rank) in fit or "
                         "hvd.broadcast_variables(model.variables, root_rank)")
    from ..tensorflow.optimizer import broadcast_global_variables as tf_broadcast
    return tf_broadcast(root_rank)


def broadcast_variables(variables, root_rank, process_set=global_process_set):
    """Assigns ``root_rank``'s values to the Keras ``variables`` on every rank of
    ``process_set`` (e.g. ``model.variables`` before a custom training loop)."""
    _backend.current().broadcast_variables(list(variables), root_rank, process_set)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none, process_set=global_process_set):
    """Reduces a value (NumPy array, number or tensor) over the ranks; returns a tensor of the
    Keras backend. ``op``: Average (default), Sum, Min, Max, Product or Adasum."""
    op = _resolve_reduce_op(op, average)
    wire, ctx = compression.compress(keras.ops.convert_to_tensor(value))
    reduced = _backend.current().allreduce(wire, op, prescale_factor, postscale_factor, name,
                                           process_set)
    return compression.decompress(reduced, ctx)


def allgather(value, name=None, process_set=global_process_set):
    """Concatenates every rank's value along the first dimension; returns a tensor."""
    return _backend.current().allgather(keras.ops.convert_to_tensor(value), name, process_set)


def broadcast(value, root_rank, name=None, process_set=global_process_set):
    """``root_rank``'s value on every rank, as a tensor."""
    return _backend.current().broadcast(keras.ops.convert_to_tensor(value), root_rank, name,
                                        process_set)


def reducescatter(value, name=None, op=Average, process_set=global_process_set):
    """Reduces a value over the ranks (Average or Sum) and returns this rank's block of the
    first dimension, as a tensor."""
    return _backend.current().reducescatter(keras.ops.convert_to_tensor(value), op, name,
                                            process_set)


def join():
    """Declares this rank out of data; it keeps taking part in the other ranks' allreduces
    until every rank has joined. Returns the rank that joined last."""
    return _backend.current().join()


def barrier(process_set=global_process_set):
    """Returns once every rank of ``process_set`` has called barrier."""
    return _backend.current().barrier(process_set)


def __getattr__(attr):
    # SyncBatchNormalization is a TensorFlow layer: loaded when asked for, so that the torch
    # and JAX backends never import TensorFlow.
    if attr == "SyncBatchNormalization":
        if _backend.name() != "tensorflow":
            raise AttributeError(
                "spark_hvd.keras.SyncBatchNormalization needs KERAS_BACKEND=tensorflow (this "
                f"process runs Keras on {_backend.name()!r}); with torch, use "
                "spark_hvd.torch.SyncBatchNorm in a torch model")
        from ..tensorflow.sync_batch_norm import SyncBatchNormalization
        return SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, legacy_opts=False):
    """Loads a model saved by ``model.save`` and wraps its optimizer in
    :func:`DistributedOptimizer` (keeping the optimizer state that was saved).

    Args:
        filepath: the ``.keras`` (or legacy ``.h5``) file.
        custom_optimizers: optimizer classes the file refers to that Keras does not know.
        custom_objects: other custom classes or functions, as for
            ``keras.models.load_model``.
        compression: compression for the wrapped optimizer's allreduces.
        legacy_opts: Horovod's switch to Keras 2's ``tf.keras.optimizers.legacy`` classes.
            Keras 3 has no legacy optimizers, so ``True`` raises ``ValueError``; ``False``
            (the default) is Keras 3's behaviour.
    """
    if legacy_opts:
        raise ValueError(
            "load_model(legacy_opts=True): Keras 3 has no legacy optimizers "
            "(tf.keras.optimizers.legacy is gone). Leave legacy_opts=False: the optimizer "
            "saved with the model is loaded as its Keras 3 class; for a file that names a "
            "Keras 2 legacy optimizer, pass the Keras 3 class to use in custom_optimizers or "
            "custom_objects.")
    objects = {cls.__name__: cls for cls in (custom_optimizers or [])}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not isinstance(optimizer, _DistributedOptimizer):
        DistributedOptimizer(optimizer, compression=compression)
    return model


__all__ = [
    "Adasum", "Average", "CollectiveError", "Compression", "DistributedOptimizer",
    "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min",
    "PartialDistributedOptimizer", "ProcessSet", "Product",
    "Sum", "add_process_set", "allgather", "allgather_object",
    "allreduce", "barrier", "broadcast", "broadcast_global_variables", "broadcast_object",
    "broadcast_object_fn", "broadcast_variables", "callbacks", "ccl_built", "cross_rank", "cross_size", "cuda_built",
    "ddl_built", "gloo_built", "gloo_enabled", "global_process_set", "init", "is_homogeneous",
    "is_initialized", "join", "load_model", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "reducescatter",
    "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
]
if _backend.name() == "tensorflow":
    __all__.append("SyncBatchNormalization")
