"""Horovod's module path for the Keras Estimator: ``import horovod.spark.keras as hvd_spark``
becomes ``import spark_hvd.spark.keras as hvd_spark``. The classes live in
:mod:`spark_hvd.estimators.keras`."""

from spark_hvd.estimators.keras import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
