"""The Python face of the native core, shared by every framework adapter."""

from .basics import (ccl_built, config, cross_rank, cross_size, cuda_built, ddl_built,
                     gloo_built, gloo_enabled, init, is_homogeneous, is_initialized, local_rank,
                     local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                     rocm_built, shared_memory_enabled, shutdown, size, start_timeline,
                     stop_timeline, tcp_built)
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ._ops import Adasum, Average, Max, Min, Product, Sum
from .process_sets import (ProcessSet, add_process_set, global_process_set,
                           remove_process_set)
