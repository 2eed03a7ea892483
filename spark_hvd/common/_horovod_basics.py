"""The ``_basics`` object of Horovod's ``mpi_ops`` modules (``hvd.mpi_ops._basics``).

Horovod's test suites and a few scripts read the process-set table through it
(``hvd.mpi_ops._basics._get_process_set_ids_and_ranks()``); its other attributes are the
functions of :mod:`spark_hvd.common.basics`. One instance serves the torch and TensorFlow
modules.
"""

import ctypes

from . import basics
from ._native import check, lib


class HorovodBasics:
    """Horovod's ``HorovodBasics`` surface on spark_hvd: ``rank()``, ``size()``, ... delegate to
    :mod:`spark_hvd.common.basics`."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return getattr(basics, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") \
                from None

    @staticmethod
    def _get_process_set_ids_and_ranks():
        """``{process_set_id: [global ranks]}`` of every registered process set, the global set
        (id 0) included, as the core knows them on this rank."""
        basics._require_init()
        count = check(lib.shvd_process_set_ids(None, 0))
        ids = (ctypes.c_int32 * max(count, 1))()
        count = min(count, check(lib.shvd_process_set_ids(ids, count)))
        table = {}
        for set_id in ids[:count]:
            size = check(lib.shvd_process_set_size(set_id))
            ranks = (ctypes.c_int32 * max(size, 1))()
            size = check(lib.shvd_process_set_ranks(set_id, ranks, size))
            table[int(set_id)] = [int(r) for r in ranks[:size]]
        return table


_basics = HorovodBasics()
