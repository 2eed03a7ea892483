"""Horovod's ``horovod.tensorflow.elastic`` (``hvd.elastic``) on spark_hvd.

``TensorFlowKerasState``, ``TensorFlowState`` and ``ObjectState`` work in a fixed-size job
(``sync()`` makes every rank's variables and objects rank 0's; ``commit()`` / ``restore()``
keep and bring back a copy in host memory). ``run`` needs elastic training, which is not
implemented yet: it raises :class:`~spark_hvd.common.elastic.ElasticNotSupportedError` naming
the alternatives (see :mod:`spark_hvd.common.elastic`).
"""

import numpy as np
import tensorflow as tf

from ..common.basics import rank
from ..common.elastic import (ElasticNotSupportedError, HandledState, ObjectState, State,
                              StateHandler, run_fn)
from .functions import broadcast_object, broadcast_variables

__all__ = ["ElasticNotSupportedError", "ObjectState", "State", "TensorFlowKerasState",
           "TensorFlowState", "run", "run_fn"]


def run(func):
    """Horovod's elastic decorator: refused (elastic training is not implemented yet)."""
    return run_fn(func, reset=None)


def _variables_of(obj):
    """The variables of a Keras model or optimizer (Keras 3: a property; Keras 2 optimizers:
    a method), or of a list of variables."""
    if isinstance(obj, (list, tuple)):
        return list(obj)
    variables = obj.variables
    return list(variables() if callable(variables) else variables)


class _VariablesHandler(StateHandler):
    """A model, an optimizer or a list of variables: saved as NumPy copies of the values."""

    def save(self):
        self._saved = [np.array(v, copy=True) for v in _variables_of(self.value)]

    def restore(self):
        # An optimizer builds its slots lazily: variables created after the last save keep
        # their values, as in Horovod.
        for var, saved in zip(_variables_of(self.value), self._saved):
            var.assign(saved)

    def sync(self):
        broadcast_variables(_variables_of(self.value), root_rank=0)


class TensorFlowKerasState(HandledState):
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
        optimizer = optimizer or model.optimizer
        handlers = {"model": _VariablesHandler(model)}
        if optimizer is not None:
            handlers["optimizer"] = _VariablesHandler(optimizer)
        super().__init__(handlers, bcast_object=broadcast_object, get_rank=rank, **kwargs)
        if optimizer is None:
            self.optimizer = None


class TensorFlowState(HandledState):
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
        handlers = {"variables": _VariablesHandler(variables)}
        super().__init__(handlers, bcast_object=broadcast_object, get_rank=rank, **kwargs)
