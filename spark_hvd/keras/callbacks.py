"""Keras 3 callbacks for data-parallel training (Horovod's, argument for argument).

Typical use::

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # same initial state everywhere
        hvd.callbacks.MetricAverageCallback(),              # epoch metrics averaged over ranks
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.01 * hvd.size(), warmup_epochs=3),
    ]
    if hvd.rank() == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint("ckpt-{epoch}.keras"))
    model.fit(x, y, callbacks=callbacks, verbose=1 if hvd.rank() == 0 else 0)
"""

import keras
import numpy as np

from .. import numpy as _np_ops
from ..common._ops import Average
from ..common.basics import rank, size as _size
from . import _backend

__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback",
           "MetricAverageCallback"]


def _optimizer_variables(optimizer):
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def _slot_owners(optimizer):
    """id(optimizer variable) -> id(model variable) it keeps state for. Keras 3 optimizers
    keep per-variable state in lists aligned with ``_trainable_variables`` (``momentums``,
    ``_velocities``, Adafactor's ``_r``/``_c``, ...); wrappers such as LossScaleOptimizer hold
    theirs in ``inner_optimizer``. State found nowhere else is treated as shared."""
    owners = {}
    opt = optimizer
    while opt is not None:
        variables = list(getattr(opt, "_trainable_variables", None) or [])
        own = {id(getattr(opt, a, None)) for a in ("_iterations", "_learning_rate")}
        per_variable = [value for attr, value in vars(opt).items()
                        if variables and attr not in ("_variables", "_trainable_variables")
                        and isinstance(value, list) and len(value) == len(variables)
                        and all(hasattr(s, "assign") for s in value)]
        for slots in per_variable:
            for slot, variable in zip(slots, variables):
                if id(slot) not in own:
                    owners[id(slot)] = id(variable)
        opt = getattr(opt, "inner_optimizer", None)
    return owners


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcasts the model's and the optimizer's variables from ``root_rank`` so every rank
    starts from the same state (random initialization or a checkpoint loaded on the root).

    It runs when training begins (building the optimizer first, so the first step already
    starts from the root's state) or, for a model that is only built by its first step, after
    the first batch (Horovod's behaviour); once per callback object.

    Args:
        root_rank: the rank whose values everyone takes.
        device: accepted for Horovod compatibility.
        local_variables: variables each rank keeps as they are (model parallelism: the local
            layers of ``PartialDistributedOptimizer``); the optimizer state that Keras keeps
            for them (momentum and the like) is left alone too.
    """

    def __init__(self, root_rank, device='', local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        if local_variables is not None and hasattr(local_variables, "assign"):
            local_variables = [local_variables]
        self.local_variables = list(local_variables or [])

    def register_local_var(self, var):
        """Leaves ``var`` (and its optimizer state) out of the broadcast, like
        ``local_variables``."""
        self.local_variables.append(var)

    def _broadcast(self):
        model = self.model
        backend = _backend.current()
        backend.sync_model_state(model)
        local = {id(v) for v in self.local_variables}
        variables = [v for v in model.variables if id(v) not in local]
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "built", True):
            slots = _optimizer_variables(optimizer)
            if local:
                owners = _slot_owners(optimizer)
                slots = [s for s in slots if owners.get(id(s)) not in local]
            variables += slots
        backend.broadcast_variables(variables, root_rank=self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        if self.broadcast_done or not self.model.built:
            return
        # Keras builds the optimizer on the first step; building it now lets the first step
        # start from the root's weights and optimizer state on every rank.
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        self._broadcast()

    def on_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """Averages the metrics of every epoch across ranks (``logs`` is updated in place), so
    callbacks after it (checkpointing, early stopping, logging) see the global values.
    Put it before them in the list. ``device`` is accepted for Horovod compatibility."""

    def __init__(self, device=''):
        super().__init__()
        self.device = device

    def _average_metrics_in_place(self, logs):
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and
                       np.issubdtype(np.asarray(v).dtype, np.number))
        if not names:
            return
        values = np.array([float(logs[k]) for k in names], dtype=np.float64)
        reduced = _np_ops.allreduce(values, op=Average)
        for name, value in zip(names, reduced.tolist()):
            logs[name] = value

    def on_epoch_end(self, epoch, logs=None):
        self._average_metrics_in_place(logs)


def _get_lr(optimizer):
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` between ``start_epoch``
    and ``end_epoch`` (Horovod's schedule callback).

    Args:
        initial_lr: the learning rate the multiplier applies to (usually scaled by size()).
        multiplier: a number (exponential decay: ``multiplier ** (epoch - start_epoch)``) or a
            function of the (fractional) epoch.
        start_epoch, end_epoch: the epochs the schedule covers (end excluded; None: to the
            end).
        staircase: change the rate at epoch starts only; otherwise every batch, with
            fractional epochs.
        momentum_correction: when the rate changes, scale the optimizer's momentum buffers by
            ``new_lr / old_lr`` (Goyal et al.; Horovod scales the momentum coefficient for
            one batch, which is the same update for SGD).
        steps_per_epoch: batches per epoch (detected from ``fit``'s parameters if omitted).
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        if not callable(multiplier):
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)
        else:
            self.multiplier = multiplier

    def _autodetect_steps_per_epoch(self):
        if self.params.get("steps"):
            return self.params["steps"]
        if self.params.get("samples") and self.params.get("batch_size"):
            return self.params["samples"] // self.params["batch_size"]
        raise ValueError(f"Could not autodetect the number of steps per epoch. Please specify "
                         f"the steps_per_epoch parameter to the {type(self).__name__}().")

    def _adjust_learning_rate(self, epoch):
        optimizer = self.model.optimizer
        _backend.current().sync_model_state(self.model)
        old_lr = _get_lr(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        try:
            optimizer.learning_rate = new_lr
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{type(self).__name__} sets the optimizer's learning rate, but "
                             f"it cannot be set ({e}); pass a float learning rate, not a "
                             "schedule") from None
        if self.momentum_correction and old_lr > 0 and new_lr != old_lr:
            momentums = getattr(optimizer, "momentums", None)
            if getattr(optimizer, "momentum", 0) and momentums:
                for m in momentums:
                    m.assign(m * (new_lr / old_lr))

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        if (self.current_epoch < self.start_epoch or
                (self.end_epoch is not None and self.current_epoch >= self.end_epoch)):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Warms the learning rate up from ``initial_lr / size()`` to ``initial_lr`` over
    ``warmup_epochs`` epochs, batch by batch (Goyal et al., "Accurate, Large Minibatch SGD"):
    large effective batches train badly with the full scaled rate from the first step.

    Args:
        initial_lr: the rate at the end of the warmup (usually the single-rank rate times
            size()).
        warmup_epochs: length of the warmup (default 5).
        momentum_correction: see :class:`LearningRateScheduleCallback`.
        steps_per_epoch: batches per epoch (detected from ``fit``'s parameters if omitted).
        verbose: 1 prints a line on rank 0 when the warmup ends.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            # Shift by one batch so the rate reaches initial_lr on the warmup's last batch.
            epoch += 1.0 / self.steps_per_epoch
            n = _size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_get_lr(self.model.optimizer):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``ModelCheckpoint`` that keeps only the best model by ``monitor`` (Horovod's, for the
    estimators, which set ``filepath`` before training). ``filepath`` may also be given here.
    """

    def __init__(self, monitor='val_loss', verbose=0, save_weights_only=False, mode='auto',
                 save_freq='epoch', filepath=None):
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=placeholder, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
        self.filepath = filepath

    def _save_model(self, *args, **kwargs):
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint has no filepath: set `callback.filepath` "
                             "(or pass filepath=) before training")
        return super()._save_model(*args, **kwargs)
