"""Gradients in memory that the other ranks on this host can map.

A DistributedOptimizer whose ranks share a host asks torch's CPU allocator (wrapped once per
process by libspark_hvd_torch_<major>_<minor>.so, the build for the running torch's minor) to
serve blocks of exactly its gradients' sizes from the
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
when it sets up shared memory, and falls back on every rank alike). The allocator subclasses
torch's C++ class c10::Allocator, so it is built once per torch minor; under a torch without a
build here, gradients are copied through the shared segment too, and the ``spark_hvd`` logger
says so once (INFO).
"""

import ctypes
import functools
import glob
import logging
import os

import torch

from ..common import basics
from ..common._native import lib as core

_CORE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_core")
_log = logging.getLogger("spark_hvd")


def library_path(version=None):
    """The allocator library for torch ``version`` (default: the running torch's), which may
    not exist."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return os.path.join(_CORE_DIR, f"libspark_hvd_torch_{major}_{minor}.so")


def built_minors():
    """The torch minors ("2.13", ...) that this installation has an allocator for."""
    names = glob.glob(os.path.join(_CORE_DIR, "libspark_hvd_torch_*_*.so"))
    return sorted(".".join(os.path.basename(n)[len("libspark_hvd_torch_"):-3].split("_"))
                  for n in names)


@functools.cache
def _library():
    """The allocator library for this torch with its signatures, installed as torch's CPU
    allocator (None when there is no build for this torch's minor or torch kept another
    allocator). Loaded and installed once per process."""
    path = library_path()
    if not os.path.exists(path):
        _log.info("spark_hvd: no shared-gradient allocator for torch %s (built for: %s); "
                  "gradients are copied through the shared segment", torch.__version__,
                  ", ".join(built_minors()) or "none")
        return None
    so = ctypes.CDLL(path)
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
