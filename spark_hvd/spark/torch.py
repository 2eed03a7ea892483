"""Horovod's module path for the PyTorch Estimator: ``import horovod.spark.torch as hvd_spark``
becomes ``import spark_hvd.spark.torch as hvd_spark``. The classes live in
:mod:`spark_hvd.estimators.torch`."""

from spark_hvd.estimators.torch import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
