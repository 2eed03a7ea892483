"""Gradients in memory that the other ranks on this host can map.

A DistributedOptimizer whose ranks share a host asks torch's CPU allocator (wrapped once per
process by libspark_hvd_torch.so) to serve blocks of exactly its gradients' sizes from the
core's shared arenas. Autograd then writes each gradient straight into such a block, and the
core's shared-memory allreduce reduces it in place: every rank reads its slice of every rank's
gradient where it lies and writes the sum into all of them, with no copies through the shared
segment (about half the engine's memory traffic; the torch mlp of ``benchmarks/scaling.py``:
1.4 ms of engine CPU per training step instead of 3.3-4.7 ms, vector kernels included).

Nothing changes for the script: ``zero_grad()`` returns a gradient's block to a cache from which
the next backward takes it again. Other tensors that happen to have a gradient's size come from
the arenas too; they behave like any tensor. The arenas' memory is held until the process exits.
A forked child (DataLoader workers) allocates from torch's memory as usual.
``SPARK_HVD_SHARED_GRADIENTS=0`` turns this off (gradients are then copied through the shared
segment), as does a process whose ranks cannot map each other's memory (the core checks that
when it sets up shared memory, and falls back on every rank alike).
"""

import ctypes
import functools
import os

import torch

from ..common import basics
from ..common._native import lib as core

_LIBRARY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_core",
                        "libspark_hvd_torch.so")


@functools.cache
def _library():
    """libspark_hvd_torch.so with its signatures, installed as torch's CPU allocator (None when it
    is not built or torch kept another allocator). Loaded and installed once per process."""
    if not os.path.exists(_LIBRARY):
        return None
    so = ctypes.CDLL(_LIBRARY)
    so.shvd_torch_install_allocator.restype = ctypes.c_int32
    so.shvd_torch_install_allocator.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    so.shvd_torch_serve_size.restype = ctypes.c_int32
    so.shvd_torch_serve_size.argtypes = [ctypes.c_int64]
    alloc = ctypes.cast(core.shvd_shared_alloc, ctypes.c_void_p)
    free = ctypes.cast(core.shvd_shared_free, ctypes.c_void_p)
    return so if so.shvd_torch_install_allocator(alloc, free) == 0 else None


def enable(params, process_set):
    """Serves the gradients of ``params`` (CPU tensors) from the shared arenas when the ranks of
    ``process_set`` talk over shared memory. Returns whether it did."""
    config = basics.config()
    if (config is None or not config.shared_gradients or process_set.size() < 2
            or not core.shvd_shared_memory_enabled()):
        return False
    sizes = {p.numel() * p.element_size() for p in params
             if p.device.type == "cpu" and p.layout == torch.strided and p.numel() > 0}
    so = _library() if sizes else None
    if so is None:
        return False
    for size in sorted(sizes):
        so.shvd_torch_serve_size(size)
    return True
