"""The core's GPU path: finding the CUDA runtime and NCCL for it, and what it did.

The core loads both at run time (``shvd_gpu_load``), so one build serves machines with and
without GPUs. The libraries are looked for, in order: ``SPARK_HVD_CUDART_LIBRARY`` /
``SPARK_HVD_NCCL_LIBRARY`` (paths), the copies already loaded in this process (a framework
imported before, such as torch, brings its own: using the same copy keeps one CUDA runtime and
one NCCL per process), NVIDIA's wheels on ``sys.path`` (``nvidia/*/lib``), then the loader's
search path.
"""

import ctypes
import glob
import os
import sys

from ._native import lib

_status = None
# Frameworks whose import may load a CUDA runtime or NCCL into the process, and which of them
# were imported when the libraries were last looked for: a search that found less than NCCL is
# repeated only after one more of them was imported (the torch adapter asks per CUDA tensor).
_FRAMEWORKS = ("torch", "tensorflow", "cupy", "jax")
_searched_with = None
_python_staged_bytes = 0  # CUDA bytes an adapter copied through host memory itself


def _loaded_in_process(stem):
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if os.path.basename(path).startswith(stem + ".so"):
                    return path
    except OSError:
        pass
    return None


def _in_wheels(stem):
    for root in sys.path:
        if not root or not os.path.isdir(os.path.join(root, "nvidia")):
            continue
        found = sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", stem + ".so*")) +
                       glob.glob(os.path.join(root, "nvidia", "*", "*", "lib", stem + ".so*")),
                       reverse=True)
        if found:
            return found[0]
    return None


def _find(stem, env):
    return os.environ.get(env) or _loaded_in_process(stem) or _in_wheels(stem)


def status():
    """0: no CUDA runtime; 1: CUDA runtime but no NCCL (CUDA tensors go through host memory);
    2: NCCL. Loads the libraries on the first call, and again, while NCCL was not found, once
    a framework imported since may have brought them."""
    global _status, _searched_with
    frameworks = tuple(name in sys.modules for name in _FRAMEWORKS)
    if _status != 2 and frameworks != _searched_with:
        cudart = _find("libcudart", "SPARK_HVD_CUDART_LIBRARY")
        nccl = _find("libnccl", "SPARK_HVD_NCCL_LIBRARY")
        _status = int(lib.shvd_gpu_load(cudart.encode() if cudart else None,
                                        nccl.encode() if nccl else None))
        _searched_with = frameworks
    return _status


def report():
    """What the last :func:`status` found, in words."""
    status()
    return lib.shvd_gpu_report().decode(errors="replace")


def count_python_staged(nbytes):
    """An adapter staged ``nbytes`` of a CUDA tensor through host memory (no CUDA runtime)."""
    global _python_staged_bytes
    _python_staged_bytes += int(nbytes)


def counters():
    """``{"nccl_collectives", "host_staged_bytes", "nccl_version",
    "nccl_hierarchical_allreduces"}`` of this process: the collectives the core ran through
    NCCL, the bytes of CUDA tensors copied through host memory (by the core, where NCCL could not
    run a collective, or by an adapter when no CUDA runtime was found), the NCCL version in use
    (0: none), and the allreduces (counted in the first) that ran hierarchically: NCCL within
    each host, then across hosts, then within the host again.

    Where the NCCL ops' latency went, summed over ``latency_ops`` of them (nanoseconds):
    ``latency_negotiation_ns`` from the enqueue to the engine executing the op (queue and
    negotiation), ``latency_launch_ns`` from there to its GPU work being enqueued (events, fusion
    copies, NCCL's launch), ``latency_gpu_ns`` from there to the core seeing it done (the GPU's
    time and the finalizer's polling). The rest of a caller's time is its wake-up and the
    framework's layers (benchmarks/gpu_latency.py prints the breakdown)."""
    out = (ctypes.c_int64 * 8)()
    lib.shvd_gpu_counters(out, 8)
    return {"nccl_collectives": int(out[0]),
            "host_staged_bytes": int(out[1]) + _python_staged_bytes,
            "nccl_version": int(out[2]),
            "nccl_hierarchical_allreduces": int(out[3]),
            "latency_ops": int(out[4]),
            "latency_negotiation_ns": int(out[5]),
            "latency_launch_ns": int(out[6]),
            "latency_gpu_ns": int(out[7])}
