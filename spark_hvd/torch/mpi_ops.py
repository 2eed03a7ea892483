"""Alias kept for scripts written against Horovod's module layout
(``from horovod.torch.mpi_ops import allreduce_async_``); the operations live in
``spark_hvd.torch.collectives`` and ``spark_hvd.torch.differentiable`` and use no MPI."""

from . import *  # noqa: F401,F403
from . import __all__  # noqa: F401
