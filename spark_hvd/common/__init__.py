"""The Python face of the native core, shared by every framework adapter.

Names load lazily, so tools that only need a submodule (the launcher uses the rendezvous) do not
load the native library.
"""

import importlib

_EXPORTS = {
    "basics": ["ccl_built", "config", "cross_rank", "cross_size", "cuda_built", "ddl_built",
               "gloo_built", "gloo_enabled", "init", "is_homogeneous", "is_initialized",
               "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
               "nccl_built", "rank", "rocm_built", "shared_memory_enabled", "shutdown", "size",
               "start_timeline", "stop_timeline", "tcp_built", "tuned_parameters",
               "gpu_counters"],
    "exceptions": ["HorovodInternalError", "HostsUpdatedInterrupt"],
    "_ops": ["Adasum", "Average", "Max", "Min", "Product", "Sum"],
    "objects": ["allgather_object", "broadcast_object"],
    "process_sets": ["ProcessSet", "add_process_set", "global_process_set",
                     "remove_process_set"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
