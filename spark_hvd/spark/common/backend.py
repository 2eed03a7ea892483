"""Horovod's module path for the estimators' backends: ``from horovod.spark.common.backend
import SparkBackend`` becomes ``from spark_hvd.spark.common.backend import SparkBackend``;
``Backend`` is the base class of a custom backend."""

from spark_hvd.estimators._base import Backend, SparkBackend

__all__ = ["Backend", "SparkBackend"]
