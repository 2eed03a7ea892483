"""Alias kept for scripts written against Horovod's module layout
(``from horovod.torch.mpi_ops import allreduce_async_``, ``... import HorovodAllreduce``); the
operations live in ``spark_hvd.torch.collectives`` and ``spark_hvd.torch.differentiable`` and
use no MPI. ``_basics`` is Horovod's object of that name (``hvd.mpi_ops._basics``)."""

from . import *  # noqa: F401,F403
from ..common._horovod_basics import _basics  # noqa: F401
from . import __all__ as _package_all
from .differentiable import (HorovodAllgather, HorovodAllreduce, HorovodAlltoall,  # noqa: F401
                             HorovodBroadcast, HorovodGroupedAllgather, HorovodGroupedAllreduce,
                             HorovodGroupedReducescatter, HorovodReducescatter)

__all__ = list(_package_all) + [
    "HorovodAllgather", "HorovodAllreduce", "HorovodAlltoall", "HorovodBroadcast",
    "HorovodGroupedAllgather", "HorovodGroupedAllreduce", "HorovodGroupedReducescatter",
    "HorovodReducescatter"]
