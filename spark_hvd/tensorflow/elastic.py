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
import re

import numpy as np
import tensorflow as tf

from ..common._elastic_states import Handler, SyncedState, check_variables
from ..common.basics import rank
from ..common.elastic import ElasticNotSupportedError, ObjectState, State, run_fn
from ..common.exceptions import HorovodInternalError
from .functions import broadcast_

__all__ = ["ElasticNotSupportedError", "ObjectState", "State", "TensorFlowKerasState",
           "TensorFlowState", "run", "run_fn"]

# Where a TensorFlow op error carries the core's HorovodInternalError: the native op's status
# message starts with it, a tf.numpy_function's names the Python exception (possibly with its
# module) at the start of a line of its own.
_INTERNAL_LINE = re.compile(r"^(?:[\w.]+\.)?HorovodInternalError: (.*)$", re.MULTILINE)


def internal_error(error):
    """The ``HorovodInternalError`` that ``error`` stands for (itself if it is one), or None:
    a TensorFlow op error raised by a collective whose peer was lost."""
    if isinstance(error, HorovodInternalError):
        return error
    if isinstance(error, tf.errors.OpError):
        found = _INTERNAL_LINE.search(error.message or "")
        if found:
            return HorovodInternalError(found.group(1).strip())
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


def _variables_of(obj):
    """The variables of a Keras model or optimizer (Keras 3: a property; Keras 2 optimizers:
    a method), or of a list of variables."""
    if isinstance(obj, (list, tuple)):
        return list(obj)
    variables = obj.variables
    return list(variables() if callable(variables) else variables)


def _named(variables):
    return [(getattr(v, "path", None) or v.name, tuple(v.shape),
             tf.as_dtype(v.dtype).base_dtype.name) for v in variables]


class _VariablesHandler(Handler):
    """A model, an optimizer or a list of variables: saved as NumPy copies of the values."""

    def __init__(self, value, what):
        self._what = what
        super().__init__(value)

    def save(self):
        self._saved = [np.array(v, copy=True) for v in _variables_of(self.value)]

    def restore(self):
        # An optimizer builds its slots lazily: variables created after the last save keep
        # their values, as in Horovod.
        for var, saved in zip(_variables_of(self.value), self._saved):
            var.assign(saved)

    def spec(self):
        return _named(_variables_of(self.value))

    def check(self, specs):
        return check_variables(self._what, specs)

    def sync(self):
        variables = _variables_of(self.value)
        if variables:
            broadcast_(variables, root_rank=0, name=f"elastic.{self._what}")


class _OptimizerHandler(_VariablesHandler):
    """A Keras optimizer, built for the model's trainable variables before a sync if it is
    not yet (a new worker's optimizer has no slots until its first step)."""

    def __init__(self, optimizer, model):
        self._model = model
        super().__init__(optimizer, "optimizer")

    def prepare(self):
        if getattr(self.value, "built", True) is False:
            self.value.build(self._model.trainable_variables)


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
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        optimizer = optimizer or getattr(model, "optimizer", None)
        handlers = {"model": _VariablesHandler(model, "model")}
        if optimizer is not None:
            handlers["optimizer"] = _OptimizerHandler(optimizer, model)
        super().__init__(handlers, get_rank=rank, **kwargs)
        if optimizer is None:
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
        handlers = {"variables": _VariablesHandler(variables, "variables")}
        super().__init__(handlers, get_rank=rank, **kwargs)
