"""Horovod's module path ``horovod.spark.runner``: ``run`` and ``run_elastic``."""

from spark_hvd.spark import run, run_elastic

__all__ = ["run", "run_elastic"]
