"""Horovod's ``horovod.tensorflow.elastic`` (``hvd.elastic``) on spark_hvd.

``TensorFlowKerasState`` (a Keras model and its optimizer), ``TensorFlowState`` (a list of
variables) and ``ObjectState``: ``sync()`` makes every rank's variables and objects rank 0's,
``commit()`` / ``restore()`` keep and bring back a copy in host memory. Before a sync a new
worker's optimizer is built (its slots created) and every rank's variables are compared with
rank 0's, so a mismatch raises on every rank instead of hanging the broadcast (Horovod #2652,
#2285; see :mod:`spark_hvd.common._elastic_states`).

``run`` (:func:`spark_hvd.common.elastic.run_fn`) also recognises a peer lost inside a
``tf.function`` (or ``model.fit``): TensorFlow reports it as an ``UnknownError`` whose message
holds the line ``HorovodInternalError: <why>``; ``run`` raises it as ``HorovodInternalError``,
so the elastic loop resets. Other errors propagate unchanged (Horovod's ``run`` silently
returned None for the ``UnknownError`` objects it did not recognise).
"""

import functools

import tensorflow as tf

from ..common._elastic_states import SyncedState, VariablesHandler, model_handlers
from ..common.basics import rank
from ..common.elastic import ElasticNotSupportedError, ObjectState, State, run_fn
from ..common.exceptions import HorovodInternalError, internal_error_in_message
from .functions import broadcast_

__all__ = ["ElasticNotSupportedError", "ObjectState", "State", "TensorFlowKerasState",
           "TensorFlowState", "run", "run_fn"]

def internal_error(error):
    """The ``HorovodInternalError`` that ``error`` stands for (itself if it is one), or None:
    a TensorFlow op error raised by a collective whose peer was lost."""
    if isinstance(error, HorovodInternalError):
        return error
    if isinstance(error, tf.errors.OpError):
        return internal_error_in_message(error.message)
    return None


def raising_internal_errors(func):
    """``func`` with TensorFlow's form of a lost peer re-raised as ``HorovodInternalError``
    (the original error as its ``__cause__``)."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except tf.errors.OpError as e:
            internal = internal_error(e)
            if internal is None:
                raise
            raise internal from e
    return wrapper


def run(func):
    """Horovod's elastic decorator: ``func(state, ...)`` runs until it returns, syncing
    ``state`` first and again after every reset; a lost peer inside a ``tf.function`` counts
    as ``HorovodInternalError`` (see the module docstring)."""
    return run_fn(raising_internal_errors(func), reset=None)


def _broadcast_variables(variables, name):
    broadcast_(variables, root_rank=0, name=name)


def _dtype_name(variable):
    return tf.as_dtype(variable.dtype).base_dtype.name


class TensorFlowKerasState(SyncedState):
    """State of a Keras model and its optimizer (Horovod's ``TensorFlowKerasState``).

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default ``model.optimizer``).
        backend: accepted for Horovod compatibility (TensorFlow 1 sessions); unused.
        kwargs: more state, exposed as attributes (plain picklable Python objects).
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        del backend
        handlers = model_handlers(model, optimizer, _broadcast_variables, _dtype_name)
        super().__init__(handlers, get_rank=rank, **kwargs)
        if "optimizer" not in handlers:
            self.optimizer = None


class TensorFlowState(SyncedState):
    """State of a list of TensorFlow variables (Horovod's ``TensorFlowState``).

    Args:
        variables: the ``tf.Variable`` objects to track (default: the ``tf.compat.v1`` global
            variables).
        session: accepted for Horovod compatibility (TensorFlow 1); unused.
        kwargs: more state, exposed as attributes (plain picklable Python objects).
    """

    def __init__(self, variables=None, session=None, **kwargs):
        del session
        variables = list(variables or tf.compat.v1.global_variables())
        handlers = {"variables": VariablesHandler(variables, "variables", _broadcast_variables,
                                                  _dtype_name)}
        super().__init__(handlers, get_rank=rank, **kwargs)
