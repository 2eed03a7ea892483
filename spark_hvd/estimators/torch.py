"""TorchEstimator → TorchModel: train a ``torch.nn.Module`` on a Spark DataFrame.

    import torch
    from spark_hvd.estimators import Store, TorchEstimator

    model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    estimator = TorchEstimator(
        num_proc=2, store=Store.create("/tmp/store"), model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        loss=torch.nn.functional.cross_entropy,
        feature_cols=["features"], label_cols=["label"], batch_size=64, epochs=5,
        validation=0.1, random_seed=1)
    torch_model = estimator.fit(train_df)              # a Spark ML Model (Transformer)
    torch_model.transform(test_df)                     # adds "label__output"
    torch_model.getHistory()["val_loss"]               # one value per epoch

Every rank builds the model from the pickled one, rank 0's weights (and optimizer state) are
broadcast, gradients are averaged by ``spark_hvd.torch.DistributedOptimizer`` while backward
runs, metrics are averaged across ranks every epoch, and rank 0 checkpoints every epoch to
``runs/<run_id>/checkpoints/`` in the Store.
"""

from __future__ import annotations

import inspect

import cloudpickle

from . import _params
from ._base import DistributedEstimator, DistributedModel
from .rank._torch import _rebuild_optimizer, bytes_io, train_on_rank
from ._predictions import TorchPredictor

__all__ = ["TorchEstimator", "TorchModel"]

_TORCH_ESTIMATOR_PARAMS = dict(_params.COMMON_ESTIMATOR_PARAMS)
_TORCH_ESTIMATOR_PARAMS.update({
    "loss_constructors": ("functions that each return a loss function (instead of loss), one "
                          "per label", None, None),
    "train_minibatch_fn": ("custom training step: fn(model, optimizer, transform_outputs, "
                           "loss_fn, inputs, labels, sample_weights) -> (outputs, loss)", None,
                           None),
})


def _serialize_optimizer(optimizer):
    """An optimizer as (class, defaults, state_dict): rebuilt on the ranks on the rank's own
    copy of the model's parameters."""
    import torch
    if optimizer is None:
        return None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer built on the model's "
                         f"parameters, got {type(optimizer).__name__}")
    return cloudpickle.dumps((type(optimizer), dict(optimizer.defaults),
                              optimizer.state_dict()))


class TorchEstimator(DistributedEstimator):
    """Spark ML Estimator that trains a PyTorch model on spark_hvd ranks.

    Params (each also has ``getX``/``setX``, e.g. ``setEpochs(5)``): see
    ``spark_hvd.estimators._params.COMMON_ESTIMATOR_PARAMS`` for the shared ones; Torch adds
    ``loss_constructors`` and ``train_minibatch_fn``. ``model`` is a ``torch.nn.Module`` whose
    ``forward`` takes one tensor per feature column (reshaped by ``input_shapes``);
    ``optimizer`` a ``torch.optim.Optimizer`` built on its parameters; ``loss`` a function
    ``loss(output, label)`` (e.g. ``torch.nn.functional.mse_loss``) or ``nn.Module`` loss, or
    a list of them for several labels (weighted by ``loss_weights``, default 1/number of
    labels, as in Horovod; with ``sample_weight_col`` the batch loss is the mean of each row's
    loss times its weight, Horovod's formula); ``metrics`` functions
    ``metric(output, label) -> tensor``; ``callbacks`` objects with any of the methods
    ``on_train_begin(model=, optimizer=)``, ``on_epoch_begin(epoch)``,
    ``on_epoch_end(epoch, metrics)`` (the rank-averaged metrics) and ``on_train_end()``, called
    on every rank. ``fit`` returns a :class:`TorchModel`.
    """

    _run_prefix = "torch"
    _fit_in_memory = True   # lost ranks: hvd.elastic.run on run_elastic (rank/_fit_elastic)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def _framework_config(self) -> dict:
        import torch
        model = self.getModel()
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"TorchEstimator: model must be a torch.nn.Module, got "
                             f"{type(model).__name__}")
        if self.getOptimizer() is None:
            raise ValueError("TorchEstimator: optimizer is not set (e.g. "
                             "torch.optim.SGD(model.parameters(), lr=0.01))")
        loss, constructors = self.getLoss(), self.getLossConstructors()
        if (loss is None) == (constructors is None):
            raise ValueError("TorchEstimator: set exactly one of loss and loss_constructors")
        minibatch = self.getTrainMinibatchFn()
        if minibatch is not None and len(inspect.signature(minibatch).parameters) != 7:
            raise ValueError("TorchEstimator: train_minibatch_fn must take (model, optimizer, "
                             "transform_outputs, loss_fn, inputs, labels, sample_weights)")
        return {"model": cloudpickle.dumps(model),
                "optimizer": _serialize_optimizer(self.getOptimizer()),
                "loss": cloudpickle.dumps(loss), "loss_constructors":
                cloudpickle.dumps(constructors), "train_minibatch_fn": minibatch}

    def _remote_trainer(self):
        return train_on_rank

    def _create_model(self, result, metadata, run_id):
        import torch
        model = cloudpickle.loads(cloudpickle.dumps(self.getModel()))
        model.load_state_dict(torch.load(bytes_io(result["model_state"]), weights_only=True))
        model.eval()
        optimizer = _rebuild_optimizer(_serialize_optimizer(self.getOptimizer()), model)
        if result.get("optimizer_state") is not None:
            optimizer.load_state_dict(torch.load(bytes_io(result["optimizer_state"]),
                                                 map_location="cpu", weights_only=False))
        return TorchModel(model=model, feature_cols=self.getFeatureCols(),
                          label_cols=self.getLabelCols(), input_shapes=self.getInputShapes(),
                          run_id=run_id, history=result["history"],
                          training_metadata=metadata, optimizer=optimizer,
                          loss=self.getLoss(), loss_constructors=self.getLossConstructors())


class TorchModel(DistributedModel):
    """The Transformer a TorchEstimator returns. ``transform(df)`` adds one prediction column
    per model output (``<label>__output``, or ``setOutputCols``); ``getModel()`` is the trained
    ``torch.nn.Module``; ``getHistory()`` the per-epoch metrics ({"loss": [...],
    "val_loss": [...], ...}); ``getOptimizer()`` the optimizer with its trained state, on the
    trained model's parameters (a new one per call, as in Horovod); ``getLoss()`` and
    ``getLossConstructors()`` what the estimator trained with. Horovod's constructor keywords
    ``feature_columns``, ``label_columns`` and ``_metadata`` are accepted."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def getOptimizer(self):
        """The optimizer, rebuilt on :meth:`getModel`'s parameters with the trained state
        (None if none was given)."""
        optimizer = self.getOrDefault(self.optimizer)
        model = self.getModel()
        if optimizer is None or model is None:
            return optimizer
        rebuilt = type(optimizer)(model.parameters(), **optimizer.defaults)
        rebuilt.load_state_dict(optimizer.state_dict())
        return rebuilt

    def _predictor_factory(self):
        return TorchPredictor(cloudpickle.dumps(self.getModel()))


_TORCH_MODEL_PARAMS = dict(_params.COMMON_MODEL_PARAMS)
_TORCH_MODEL_PARAMS.update({
    "optimizer": ("the optimizer with its trained state (getOptimizer() binds it to the "
                  "model)", None, None),
    "loss": ("the loss the model was trained with", None, None),
    "loss_constructors": ("the loss constructors the model was trained with", None, None),
})

declare = _params.declare
declare(TorchEstimator, _TORCH_ESTIMATOR_PARAMS)
declare(TorchModel, _TORCH_MODEL_PARAMS)
