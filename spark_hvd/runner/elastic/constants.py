"""Horovod's ``horovod.runner.elastic.constants``."""

from spark_hvd.launch.elastic.policy import RESET_LIMIT_EXCEEDED_MESSAGE  # noqa: F401
