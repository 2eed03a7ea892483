"""Alias of ``spark_hvd.tensorflow`` for scripts that import ``horovod.tensorflow.mpi_ops``
(or reach it as ``hvd.mpi_ops``), with Horovod's ``_basics`` object, through which Horovod's
tests read the process-set table."""

from . import *  # noqa: F401,F403
from . import __all__  # noqa: F401
from ..common._horovod_basics import _basics  # noqa: F401
