"""Alias of ``spark_hvd.tensorflow`` for scripts that import ``horovod.tensorflow.mpi_ops``."""

from . import *  # noqa: F401,F403
from . import __all__  # noqa: F401
