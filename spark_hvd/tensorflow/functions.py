"""Making every rank start from the same state: variables and Python objects.

    hvd.broadcast_variables(model.variables, root_rank=0)
    config = hvd.broadcast_object(config, root_rank=0)
"""

import tensorflow as tf

from ..common.session_objects import allgather_object, broadcast_object, broadcast_object_fn
from ..common.process_sets import global_process_set
from .collectives import _CODES, broadcast_list

__all__ = ["allgather_object", "broadcast_", "broadcast_object", "broadcast_object_fn",
           "broadcast_variables"]

# Dtypes the core does not know travel bit for bit as an integer of the same width (Keras
# seed-generator states are uint32), complex numbers as pairs of reals.
_BITCAST = {tf.uint32: tf.int32, tf.uint64: tf.int64, tf.complex64: tf.float32,
            tf.complex128: tf.float64}


def _to_wire(value):
    if value.dtype in _CODES:
        return value
    wire = _BITCAST.get(value.dtype)
    if wire is None:
        raise ValueError(f"cannot broadcast a variable of dtype {value.dtype.name}")
    return tf.bitcast(value, wire)


def _from_wire(value, dtype):
    return value if value.dtype == dtype else tf.bitcast(value, dtype)


def _assign_from_root(variables, root_rank, name, process_set):
    """Assigns ``root_rank``'s values to ``variables`` (one batch); returns the assign ops."""
    values = [_to_wire(tf.convert_to_tensor(v)) for v in variables]
    received = broadcast_list(values, root_rank, name, process_set)
    # base_dtype: a tf.compat.v1 RefVariable's dtype is the reference type (e.g. bool_ref).
    return [v.assign(_from_wire(r, tf.as_dtype(v.dtype).base_dtype))
            for v, r in zip(variables, received)]


@tf.autograph.experimental.do_not_convert
def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assigns ``root_rank``'s values to ``variables`` on every rank of ``process_set``.

    All variables travel in one batch (one graph node in a ``tf.function`` or a
    ``tf.compat.v1`` graph). In a ``tf.compat.v1`` graph returns the op to run; eagerly and in
    a ``tf.function`` returns None.
    ``inplace`` is accepted for Horovod compatibility.
    """
    variables = list(variables)
    if not variables:
        return None if tf.executing_eagerly() or tf.inside_function() else tf.no_op()
    assigns = _assign_from_root(variables, root_rank, None, process_set)
    if tf.executing_eagerly() or tf.inside_function():
        return None  # done, or ordered by tf.function's automatic control dependencies
    return tf.group(*assigns)


@tf.autograph.experimental.do_not_convert
def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast (Horovod's ``broadcast_``): ``variables`` take ``root_rank``'s
    values on every rank of ``process_set``, in one batch; returns their new values."""
    variables = list(variables)
    if not variables:
        return []
    assigns = _assign_from_root(variables, root_rank, name, process_set)
    with tf.control_dependencies(assigns):
        return [tf.identity(tf.convert_to_tensor(v)) for v in variables]
