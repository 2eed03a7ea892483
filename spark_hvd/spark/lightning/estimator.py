"""Horovod's ``horovod.spark.lightning.estimator`` module path."""

from spark_hvd.spark.lightning import LightningEstimator, LightningModel, TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel", "LightningEstimator", "LightningModel"]
