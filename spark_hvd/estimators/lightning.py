"""LightningEstimator → LightningModel: train a PyTorch Lightning ``LightningModule`` on a Spark
DataFrame (Horovod's ``horovod.spark.lightning.TorchEstimator``).

    import lightning as L
    from spark_hvd.estimators import Store
    from spark_hvd.estimators.lightning import LightningEstimator

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)
        def forward(self, features):
            return self.fc(features).squeeze(-1)
        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self(batch["features"]), batch["label"])
            self.log("train_loss", loss, on_epoch=True)
            return loss
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", torch.nn.functional.mse_loss(self(batch["features"]),
                                                              batch["label"]))
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.05)

    estimator = LightningEstimator(num_proc=2, store=Store.create("/tmp/store"),
                                   model=Regressor(), feature_cols=["features"],
                                   label_cols=["label"], batch_size=32, epochs=5,
                                   validation=0.1)
    lightning_model = estimator.fit(train_df)      # a Spark ML Model (Transformer)
    lightning_model.transform(test_df)             # adds "label__output"
    lightning_model.getHistory()["val_loss"]       # one value per epoch

Every rank runs a Lightning ``Trainer`` with spark_hvd's strategy
(:mod:`spark_hvd.lightning`): Lightning's loop, callbacks, loggers and checkpointing run on
every rank, gradients are averaged by ``spark_hvd.torch.DistributedOptimizer``. Batches reach
``training_step`` as ``{column: tensor}`` dicts of the feature, label and sample-weight
columns (Horovod's format).
"""

from __future__ import annotations

import copy
import importlib.util
import warnings

import cloudpickle

from . import _params
from ._base import DistributedEstimator
from .rank._lightning import train_on_rank
from .rank._torch import bytes_io
from .torch import TorchModel

__all__ = ["LightningEstimator", "LightningModel"]

_LIGHTNING_PARAMS = dict(_params.COMMON_ESTIMATOR_PARAMS)
_LIGHTNING_PARAMS.update({
    "model": ("the LightningModule to train (lightning or pytorch_lightning)", None, None),
    "callbacks": ("Lightning callbacks, run on every rank", None, []),
    "trainer_args": ("dict of Trainer arguments, added to or replacing the ones the "
                     "estimator gives the Trainer", None, None),
    "logger": ("a Lightning logger (or a list of them; False: none); default a "
               "TensorBoardLogger (CSVLogger without tensorboard) whose files are copied to "
               "runs/<run_id>/logs/lightning_logs/ in the Store every epoch", None, None),
    "log_every_n_steps": ("how often Lightning logs within an epoch",
                          _params.TypeConverters.toInt, 50),
    "num_gpus": ("GPUs per process: 0 or 1 (default 1 when the rank sees CUDA and use_gpu, "
                 "else 0)", _params._to_optional_int, None),
    "data_module": ("a LightningDataModule, or a class built on each rank with Horovod's "
                    "data-module keywords (train_dir, val_dir, cur_shard, shard_count, "
                    "schema_fields, train_batch_size, ...; plus store, metadata, config); "
                    "default: the rank's shard reader", None, None),
    "loader_num_epochs": ("passed to a data_module class as num_reader_epochs (Horovod)",
                          None, None),
    "terminate_on_nan": ("stop with an error when the training loss is not finite",
                         _params.TypeConverters.toBoolean, False),
    "profiler": ("a Lightning profiler (or 'simple' / 'advanced' / 'pytorch'); its files go "
                 "with the logs", None, None),
    "checkpoint_callback": ("a Lightning ModelCheckpoint; the best model it saved (the last "
                            "one without monitor) is the model fit returns", None, None),
    "gradient_clip_val": ("Trainer's gradient_clip_val (applied to the averaged gradients)",
                          None, None),
    "limit_train_batches": ("Trainer's limit_train_batches (a count or a fraction)", None,
                            None),
    "limit_val_batches": ("Trainer's limit_val_batches (a count or a fraction)", None, None),
    "val_check_interval": ("Trainer's val_check_interval", None, None),
    "debug_data_loader": ("passed to a data_module class (Horovod)", None, False),
    "train_async_data_loader_queue_size": ("passed to a data_module class (Horovod)", None,
                                           None),
    "val_async_data_loader_queue_size": ("passed to a data_module class (Horovod)", None,
                                         None),
})

# Passed from the Params to the ranks as they are.
_RANK_PARAMS = ("trainer_args", "logger", "log_every_n_steps", "num_gpus", "data_module",
                "loader_num_epochs", "terminate_on_nan", "profiler", "checkpoint_callback",
                "gradient_clip_val", "limit_train_batches", "limit_val_batches",
                "val_check_interval", "reader_pool_type", "debug_data_loader",
                "train_async_data_loader_queue_size", "val_async_data_loader_queue_size",
                "transformation_edit_fields", "transformation_removed_fields")

_MISSING = ("LightningEstimator needs PyTorch Lightning: neither `lightning` nor "
            "`pytorch_lightning` can be imported; install it with `pip install lightning`")


def _lightning_installed() -> bool:
    for name in ("lightning", "pytorch_lightning"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            pass
    return False


class LightningEstimator(DistributedEstimator):
    """Spark ML Estimator that trains a LightningModule on spark_hvd ranks, each running a
    Lightning ``Trainer`` (Horovod's ``horovod.spark.lightning.TorchEstimator``).

    Params (each also has ``getX``/``setX``): the shared ones of
    ``spark_hvd.estimators._params.COMMON_ESTIMATOR_PARAMS`` (``num_proc``, ``store``,
    ``feature_cols``, ``label_cols``, ``batch_size``, ``epochs``, ``validation``, ``run_id``,
    ...) and Horovod's Lightning ones: ``trainer_args``, ``callbacks`` (Lightning callbacks,
    every rank), ``logger``, ``log_every_n_steps``, ``num_gpus``, ``data_module``,
    ``profiler``, ``checkpoint_callback``, ``terminate_on_nan``, ``gradient_clip_val``,
    ``limit_train_batches``, ``limit_val_batches``, ``val_check_interval``, ...
    ``backward_passes_per_step`` is Lightning's ``accumulate_grad_batches``;
    ``gradient_compression`` and ``scale_learning_rate`` go to the strategy.

    The model brings its own optimizer (``configure_optimizers``), loss (``training_step``)
    and metrics (``self.log``): ``optimizer``, ``loss``, ``loss_weights`` are refused, as in
    Horovod. ``fit`` returns a :class:`LightningModel`; its history holds, per epoch, the
    ``trainer.callback_metrics`` averaged over the ranks.
    """

    _run_prefix = "lightning"

    def __init__(self, **kwargs):
        if not _lightning_installed():
            raise ImportError(_MISSING)
        super().__init__(**kwargs)

    def _check_params(self, df) -> None:
        super()._check_params(df)
        from spark_hvd.lightning import package_of
        name = type(self).__name__
        model = self.getModel()
        if package_of(model) is None:
            raise ValueError(f"{name}: model must be a LightningModule (lightning or "
                             f"pytorch_lightning), got {type(model).__name__}; for a "
                             f"torch.nn.Module with an optimizer and a loss use "
                             f"TorchEstimator")
        for param, instead in (("optimizer", "LightningModule.configure_optimizers"),
                               ("loss", "LightningModule.training_step"),
                               ("loss_weights", "LightningModule.training_step")):
            if self.getOrDefault(param):
                raise ValueError(f"{name}: {param} cannot be set with a LightningModule; "
                                 f"implement {instead} instead")
        if self.getMetrics():
            warnings.warn(f"{name}: metrics are not used with a LightningModule; log them "
                          f"with self.log in training_step / validation_step", UserWarning)
        if self.getNumGpus() not in (None, 0, 1):
            raise ValueError(f"{name}: num_gpus must be 0 or 1 (one process per GPU), got "
                             f"{self.getNumGpus()}")
        trainer_args = self.getTrainerArgs()
        if trainer_args is not None and not isinstance(trainer_args, dict):
            raise ValueError(f"{name}: trainer_args must be a dict of Trainer arguments, got "
                             f"{type(trainer_args).__name__}")
        reserved = {"strategy", "callbacks"} & set(trainer_args or {})
        if reserved:
            raise ValueError(f"{name}: trainer_args cannot set {sorted(reserved)}: the "
                             f"estimator's strategy runs the ranks; pass callbacks as "
                             f"callbacks=")

    def _framework_config(self) -> dict:
        from spark_hvd.lightning import package_of
        config = {name: self.getOrDefault(name) for name in _RANK_PARAMS}
        # A data_module class gets the user's function as it is (Horovod's Petastorm
        # TransformSpec takes it), not the batch transform the shard reader applies.
        config.update(model=cloudpickle.dumps(self.getModel()),
                      lightning_package=package_of(self.getModel()),
                      user_transformation_fn=self.getTransformationFn())
        return config

    def _remote_trainer(self):
        return train_on_rank

    def _create_model(self, result, metadata, run_id):
        import torch
        # The driver's module, never attached to a Trainer, with the trained weights.
        trained = copy.deepcopy(self.getModel())
        trained.load_state_dict(torch.load(bytes_io(result["model_state"]), weights_only=True))
        trained.eval()
        columns = {"feature_cols": self.getFeatureCols(), "label_cols": self.getLabelCols(),
                   "input_shapes": self.getInputShapes()}
        return LightningModel(model=trained, run_id=run_id, history=result["history"],
                              training_metadata=metadata, **columns)


class LightningModel(TorchModel):
    """The Transformer a LightningEstimator returns (Horovod's
    ``horovod.spark.lightning.TorchModel``): ``transform(df)`` adds one prediction column per
    output of the module's ``forward`` (``<label>__output``, or ``setOutputCols``);
    ``getModel()`` is the trained LightningModule; ``getHistory()`` the per-epoch metrics."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)


_params.declare(LightningEstimator, _LIGHTNING_PARAMS)

# Horovod's spelling of the num_gpus accessors.
LightningEstimator.getNumGPUs = LightningEstimator.getNumGpus
LightningEstimator.setNumGPUs = LightningEstimator.setNumGpus
