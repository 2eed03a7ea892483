"""Horovod's ``horovod.keras.elastic`` / ``horovod.tensorflow.keras.elastic`` on spark_hvd.

``KerasState`` and the callbacks work in a fixed-size job; ``run`` needs elastic training,
which is not implemented yet, and raises
:class:`~spark_hvd.common.elastic.ElasticNotSupportedError` naming the alternatives (see
:mod:`spark_hvd.common.elastic`).
"""

import keras

from ..common.elastic import ElasticNotSupportedError, ObjectState, State
from ..tensorflow.elastic import TensorFlowKerasState, TensorFlowState, run

__all__ = ["CommitStateCallback", "ElasticNotSupportedError", "KerasState", "ObjectState",
           "State", "TensorFlowKerasState", "TensorFlowState", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]


class KerasState(TensorFlowKerasState):
    """State of a Keras model and its optimizer (Horovod's ``KerasState``).

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default ``model.optimizer``).
        kwargs: more state, exposed as attributes (plain picklable Python objects).
    """

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches and at the end of every epoch."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the last finished batch of the epoch (0 after an epoch)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` at the number of finished epochs, counted from the value it had
    when training began."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1
