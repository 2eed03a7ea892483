"""The one place where spark_hvd.keras depends on Keras 3's backend (``KERAS_BACKEND``).

Everything else in the package (the optimizer wrapper, the callbacks, the estimator's rank
side) is backend-neutral and asks :func:`current` for the few things that differ:

- ``tensorflow``: TensorFlow tensors through spark_hvd.tensorflow's ops, which also run inside
  the ``tf.function`` that ``model.fit`` traces (``tf.IndexedSlices`` gradients too).
- ``torch``: gradients are torch tensors, reduced by spark_hvd.torch's grouped allreduce (on a
  GPU that is the core's NCCL path, no host copy).
- ``jax``: ``model.fit``'s step is a pure function compiled by XLA, so the gradients are
  reduced by an ordered ``jax.experimental.io_callback`` that hands host copies to
  spark_hvd.numpy (the callback keeps the ranks' collectives in program order).

Variables (broadcasts, elastic state) travel as NumPy copies on every backend other than
TensorFlow: that happens once per training, not per step.
"""

import keras
import numpy as np

from ..common.basics import size as _global_size
from ..common.exceptions import HorovodInternalError, internal_error_in_message
from ..common.gradients import BaseGradientAllreducer
from ..common.process_sets import global_process_set
from .. import numpy as _np_ops

SUPPORTED = ("tensorflow", "torch", "jax")


def name():
    """The Keras backend this process runs (``keras.backend.backend()``); raises ValueError,
    naming the fix, for a backend spark_hvd.keras does not support."""
    backend = keras.backend.backend()
    if backend not in SUPPORTED:
        raise ValueError(
            f"spark_hvd.keras supports the Keras backends {', '.join(SUPPORTED)}; this process "
            f"runs Keras on {backend!r}. Set KERAS_BACKEND to one of them in the environment "
            f"of every rank before keras is imported (e.g. KERAS_BACKEND=torch spark-hvd-run "
            f"... or env={{'KERAS_BACKEND': 'torch'}} for spark.run).")
    return backend


def set_size(process_set):
    """Number of ranks in ``process_set``."""
    if process_set is None or process_set is global_process_set:
        return _global_size()
    return process_set.size()


# -- NumPy copies (torch and JAX variables, and JAX gradients) ---------------------------------

_INT_OF_WIDTH = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _wire(array):
    """``array`` as a dtype the core knows: others (uint32 seed states, bfloat16) travel bit
    for bit as a signed integer of the same width."""
    array = np.ascontiguousarray(array)
    if array.dtype in _np_ops._DTYPES:
        return array
    width = _INT_OF_WIDTH.get(array.dtype.itemsize)
    if width is None:
        raise ValueError(f"cannot broadcast a variable of dtype {array.dtype}")
    return array.view(width)


def broadcast_variables_as_numpy(variables, root_rank, process_set=global_process_set,
                                 name=None):
    """Assigns ``root_rank``'s values to Keras ``variables`` (all submitted at once, fused by
    the core), through NumPy copies; ``name`` names the ops (``name.<i>``)."""
    variables = list(variables)
    values = [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]
    handles = [_np_ops.broadcast_async(_wire(a), root_rank, process_set=process_set,
                                       name=None if name is None else f"{name}.{i}")
               for i, a in enumerate(values)]
    for var, value, handle in zip(variables, values, handles):
        var.assign(handle.wait().view(value.dtype).reshape(value.shape))


# -- the backends ----------------------------------------------------------------------------

class _Backend:
    """What every backend answers the same way."""

    def sync_model_state(self, model):
        """Makes ``model``'s variables hold the training state before a callback reads or
        assigns them (only JAX keeps it elsewhere during ``fit``)."""

    def internal_error(self, error):
        """The ``HorovodInternalError`` that ``error`` stands for, or None."""
        return error if isinstance(error, HorovodInternalError) else None

    def on_update_step(self, optimizer, reduce, grads):
        """``reduce(grads)`` for the gradients Keras' accumulation applies: its optimizer
        calls ``_clip_gradients`` on update steps only (torch; TensorFlow's accumulation is
        spark_hvd's own)."""
        return reduce(grads)


class _TensorFlow(_Backend):
    """KERAS_BACKEND=tensorflow: spark_hvd.tensorflow's ops."""

    def __init__(self):
        from ..tensorflow import collectives, differentiable, functions, gradient_tape
        self._ops, self._functions, self._tape = differentiable, functions, gradient_tape
        self._collectives = collectives

    def gradient_allreducer(self, **kwargs):
        return self._tape.GradientAllreducer(**kwargs)

    def broadcast_variables(self, variables, root_rank, process_set=global_process_set,
                            name=None):
        if name is None:
            self._functions.broadcast_variables(variables, root_rank, process_set=process_set)
        else:
            self._functions.broadcast_(variables, root_rank, name=name, process_set=process_set)

    def allreduce(self, value, op, prescale_factor, postscale_factor, name, process_set):
        return self._ops.allreduce(value, name=name, op=op, prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor, process_set=process_set)

    def allgather(self, value, name, process_set):
        return self._ops.allgather(value, name=name, process_set=process_set)

    def broadcast(self, value, root_rank, name, process_set):
        return self._ops.broadcast(value, root_rank, name=name, process_set=process_set)

    def reducescatter(self, value, op, name, process_set):
        return self._ops.reducescatter(value, name=name, op=op, process_set=process_set)

    def join(self):
        return self._collectives.join()

    def barrier(self, process_set=global_process_set):
        return self._collectives.barrier(process_set)

    def internal_error(self, error):
        from ..tensorflow.elastic import internal_error
        return internal_error(error)


class _NeutralAllreducer(BaseGradientAllreducer):
    """Gradients of the torch and JAX backends: the shared rules, with the backend's grouped
    allreduce (``reduce_group(tensors, op, prescale, postscale, process_set)``)."""

    def __init__(self, reduce_group, compression, sparse_as_dense, op,
                 gradient_predivide_factor, groups, process_set, name, scale_local_gradients):
        super().__init__(compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                         process_set, name, scale_local_gradients, set_size)
        self._reduce_group = reduce_group

    def _allreduce_group(self, tensors):
        return self._reduce_group(tensors, self.op, self.prescale, self.postscale,
                                  self.process_set)


class _NumPyValues(_Backend):
    """The value collectives and join/barrier through spark_hvd.numpy, results as the
    backend's tensors (shared by torch and JAX)."""

    def allreduce(self, value, op, prescale_factor, postscale_factor, name, process_set):
        return keras.ops.convert_to_tensor(_np_ops.allreduce(
            keras.ops.convert_to_numpy(value), name=name, op=op,
            prescale_factor=prescale_factor, postscale_factor=postscale_factor,
            process_set=process_set))

    def allgather(self, value, name, process_set):
        return keras.ops.convert_to_tensor(_np_ops.allgather(
            keras.ops.convert_to_numpy(value), name=name, process_set=process_set))

    def broadcast(self, value, root_rank, name, process_set):
        return keras.ops.convert_to_tensor(_np_ops.broadcast(
            keras.ops.convert_to_numpy(value), root_rank, name=name, process_set=process_set))

    def reducescatter(self, value, op, name, process_set):
        return keras.ops.convert_to_tensor(_np_ops.reducescatter(
            keras.ops.convert_to_numpy(value), op=op, name=name, process_set=process_set))

    def join(self):
        return _np_ops.join()

    def barrier(self, process_set=global_process_set):
        _np_ops.barrier(process_set)

    def broadcast_variables(self, variables, root_rank, process_set=global_process_set,
                            name=None):
        broadcast_variables_as_numpy(variables, root_rank, process_set, name)


class _Torch(_NumPyValues):
    """KERAS_BACKEND=torch: gradients through spark_hvd.torch (NCCL for CUDA tensors)."""

    def __init__(self):
        import torch

        from ..torch import collectives
        self._torch, self._collectives = torch, collectives

    def _reduce_group(self, tensors, op, prescale, postscale, process_set):
        handle = self._collectives.grouped_allreduce_async(
            [t.detach() for t in tensors], None, None, op, prescale, postscale, process_set)
        return self._collectives.synchronize(handle)

    def gradient_allreducer(self, **kwargs):
        return _NeutralAllreducer(self._reduce_group, **kwargs)


class _Jax(_NumPyValues):
    """KERAS_BACKEND=jax: gradients through an ordered io_callback to spark_hvd.numpy."""

    def __init__(self):
        import jax
        from jax.experimental import io_callback
        self._jax, self._io_callback = jax, io_callback

    def _reduce_group(self, tensors, op, prescale, postscale, process_set):
        jnp = self._jax.numpy
        # The core has no bfloat16: such gradients travel as float32.
        wire = [t.astype(jnp.float32) if t.dtype == jnp.bfloat16 else t for t in tensors]
        shapes = [self._jax.ShapeDtypeStruct(t.shape, t.dtype) for t in wire]

        def on_host(*arrays):
            return tuple(_np_ops.grouped_allreduce(
                [np.asarray(a) for a in arrays], op=op, prescale_factor=prescale,
                postscale_factor=postscale, process_set=process_set))
        reduced = self._io_callback(on_host, tuple(shapes), *wire, ordered=True)
        return [r.astype(t.dtype) for r, t in zip(reduced, tensors)]

    def gradient_allreducer(self, **kwargs):
        return _NeutralAllreducer(self._reduce_group, **kwargs)

    def on_update_step(self, optimizer, reduce, grads):
        # Keras' JAX optimizer computes every step's update and keeps only the update steps':
        # communicate on those only (the same steps on every rank: the iteration counter).
        is_update = (optimizer._iterations + 1) % optimizer.gradient_accumulation_steps == 0
        return self._jax.lax.cond(is_update, lambda: list(reduce(grads)), lambda: list(grads))

    def sync_model_state(self, model):
        # model.fit keeps JAX's state outside the variables between its own syncs: write it
        # back before reading or assigning variables, which also makes the next step read
        # them again.
        sync = getattr(model, "jax_state_sync", None)
        if sync is not None:
            sync()

    def internal_error(self, error):
        # An exception raised in the io_callback reaches the caller as a JaxRuntimeError whose
        # message carries the Python exception's line.
        found = super().internal_error(error)
        if found is None and isinstance(error, self._jax.errors.JaxRuntimeError):
            found = internal_error_in_message(str(error))
        return found


_BACKENDS = {"tensorflow": _TensorFlow, "torch": _Torch, "jax": _Jax}
_current = {}


def current():
    """The collective path of this process's Keras backend (made once)."""
    backend = name()
    impl = _current.get(backend)
    if impl is None:
        impl = _current[backend] = _BACKENDS[backend]()
    return impl



def not_converted(func):
    """``func`` as it is, kept out of TensorFlow's AutoGraph on the TensorFlow backend (the
    step ``model.fit`` traces calls it; its Python control flow is meant as written)."""
    if keras.backend.backend() != "tensorflow":
        return func
    import tensorflow as tf
    return tf.autograph.experimental.do_not_convert(func)
