"""Horovod's module path for the estimators' backend: ``from horovod.spark.common.backend
import SparkBackend`` becomes ``from spark_hvd.spark.common.backend import SparkBackend``."""

from spark_hvd.estimators._base import SparkBackend

__all__ = ["SparkBackend"]
