"""Horovod's module path for the PyTorch Lightning Estimator: ``import horovod.spark.lightning as
hvd_spark`` becomes ``import spark_hvd.spark.lightning as hvd_spark``; ``hvd_spark.TorchEstimator``
and ``hvd_spark.TorchModel`` are :class:`spark_hvd.estimators.lightning.LightningEstimator` and
``LightningModel``."""

from spark_hvd.estimators.lightning import LightningEstimator, LightningModel

TorchEstimator = LightningEstimator
TorchModel = LightningModel

__all__ = ["TorchEstimator", "TorchModel", "LightningEstimator", "LightningModel"]
