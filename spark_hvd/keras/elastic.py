"""Horovod's ``horovod.keras.elastic`` / ``horovod.tensorflow.keras.elastic`` on spark_hvd:
``KerasState`` (see :mod:`spark_hvd.common._elastic_states`), ``run`` and the callbacks that
commit the state and keep its ``epoch`` and ``batch`` during ``model.fit``, on every Keras
backend (the variables travel as the backend's collectives do, see ``_backend``).

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(data, steps_per_epoch=steps, epochs=epochs - state.epoch, callbacks=[
            hvd.elastic.UpdateEpochStateCallback(state),
            hvd.elastic.UpdateBatchStateCallback(state),
            hvd.elastic.CommitStateCallback(state)])
"""

import functools

import keras

from ..common._elastic_states import SyncedState, model_handlers
from ..common.basics import rank
from ..common.elastic import ElasticNotSupportedError, ObjectState, State, run_fn
from . import _backend

__all__ = ["CommitStateCallback", "ElasticNotSupportedError", "KerasState", "ObjectState",
           "State", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
if _backend.name() == "tensorflow":
    __all__ += ["TensorFlowKerasState", "TensorFlowState"]


def __getattr__(attr):
    # The TensorFlow states (Horovod exports them here too), loaded only when asked for.
    if attr in ("TensorFlowKerasState", "TensorFlowState"):
        from ..tensorflow import elastic
        return getattr(elastic, attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def run(func):
    """Horovod's elastic decorator: ``func(state, ...)`` runs until it returns, syncing
    ``state`` first and again after every reset. A lost peer inside ``model.fit``'s compiled
    step (which TensorFlow and JAX report as their own error types) counts as
    ``HorovodInternalError``."""
    backend = _backend.current()

    @functools.wraps(func)
    def raising_internal_errors(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised unless it stands for a lost peer
            internal = backend.internal_error(e)
            if internal is None or internal is e:
                raise
            raise internal from e
    return run_fn(raising_internal_errors, reset=None)


class KerasState(SyncedState):
    """State of a Keras model and its optimizer (Horovod's ``KerasState``).

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default ``model.optimizer``).
        kwargs: more state, exposed as attributes (plain picklable Python objects).
    """

    def __init__(self, model, optimizer=None, **kwargs):
        backend = _backend.current()

        def broadcast(variables, name):
            backend.broadcast_variables(variables, 0, name=name)

        handlers = model_handlers(model, optimizer, broadcast,
                                  lambda v: keras.backend.standardize_dtype(v.dtype),
                                  before_save=lambda: backend.sync_model_state(model))
        super().__init__(handlers, get_rank=rank, **kwargs)
        if "optimizer" not in handlers:
            self.optimizer = None


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches and at the end of every epoch,
    through :meth:`commit` (override it to add work to each commit, as in Horovod)."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        # Every rank starts counting again after a reset, so the ranks commit together.
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.commit()

    def commit(self):
        """Commits the state (``state.commit()``)."""
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the index of the last finished batch of the epoch (0 after an
    epoch), as Horovod's. With ``steps_per_epoch`` set, the first epoch after a reset shows
    ``steps - state.batch`` steps in ``params['steps']``, as Horovod's; Keras 3 still runs the
    full ``steps_per_epoch`` (a callback cannot shorten an epoch there)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params and self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params["steps"]
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` at the number of finished epochs, across resets.

    Works with both ways of resuming ``fit`` after a reset: ``fit(epochs=E - state.epoch)``
    (Keras counts epochs from 0) and ``fit(initial_epoch=state.epoch, epochs=E)`` (Keras counts
    from ``state.epoch``): the offset between Keras's epoch and ``state.epoch`` is taken at the
    first epoch of each ``fit``. Horovod's added ``state.epoch`` to Keras's epoch in both cases,
    counting the epochs before the reset twice with ``initial_epoch`` (Horovod #2844).
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch
        self._offset = None

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch
        self._offset = None

    def on_epoch_begin(self, epoch, logs=None):
        if self._offset is None:
            self._offset = self.state.epoch - epoch

    def on_epoch_end(self, epoch, logs=None):
        offset = self._offset if self._offset is not None else self.initial_epoch
        self.state.epoch = offset + epoch + 1
