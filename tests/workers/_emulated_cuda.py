"""spark_hvd.numpy's collectives on "CUDA" buffers of the emulated CUDA runtime
(tests/fake_cuda, loaded by the core through $SPARK_HVD_CUDART_LIBRARY): NumPy arrays handed to
the core as tensors on a CUDA device, ready on a stream of the stand-in's. Everything else is
spark_hvd.numpy's (``hvd.rank()``, ``hvd.HorovodInternalError``, ...).

Each rank uses device ``rank % FAKE_CUDA_DEVICE_COUNT`` (the global rank: simulated hosts on one
machine share its hostname, so local ranks would share "GPUs"), or $SPARK_HVD_TEST_DEVICE
(ranks sharing one)."""

import ctypes
import os

import numpy as np

import spark_hvd.numpy as _numpy
from spark_hvd.common import _gpu, _ops, _outputs
from spark_hvd.common._native import OP_ALLREDUCE
from spark_hvd.numpy import _DTYPES

runtime = ctypes.CDLL(os.environ["SPARK_HVD_CUDART_LIBRARY"])
stream = ctypes.c_void_p()
runtime.cudaStreamCreateWithFlags(ctypes.byref(stream), 1)
device = None


def __getattr__(name):
    return getattr(_numpy, name)


def init():
    global device
    _numpy.init()
    chosen = os.environ.get("SPARK_HVD_TEST_DEVICE")
    device = int(chosen) if chosen else _numpy.rank() % int(
        os.environ.get("FAKE_CUDA_DEVICE_COUNT", "4"))
    runtime.cudaSetDevice(device)
    _gpu.status()  # loads the libraries as the torch adapter does before its first CUDA tensor


def place():
    return (1, device, stream.value)


def ptr(a):
    return a.ctypes.data


def synchronize():
    runtime.cudaStreamSynchronize(stream)


def enqueue(kind, name, a, **kwargs):
    """Enqueues op ``kind`` on ``a`` (its result in the core's memory on the device)."""
    return _ops.enqueue_one(kind, name, _DTYPES[a.dtype], a.shape, ptr(a), 0, place=place(),
                            **kwargs)


def allreduce_async(a, name, op=_ops.Sum, prescale_factor=1.0, postscale_factor=1.0,
                    out=None, process_set=0):
    """(handle, output): ``output`` (``out``, or a new array) holds the result once
    ``_ops.wait(handle)`` returned. ``process_set``: its id."""
    out = np.empty_like(a) if out is None else out
    h = _ops.enqueue_one(OP_ALLREDUCE, name, _DTYPES[a.dtype], a.shape, ptr(a), ptr(out),
                         reduce_op=op, prescale=prescale_factor, postscale=postscale_factor,
                         process_set=process_set, place=place())
    return h, out


def allreduce(a, name, op=_ops.Sum, prescale_factor=1.0, postscale_factor=1.0):
    h, out = allreduce_async(a, name, op, prescale_factor, postscale_factor)
    _ops.wait(h, (a, out))
    return out


def device_result(h, dtype, want_ints=0):
    """A result the core holds on the device, copied into a new array on our stream."""
    def allocate(shape, nbytes):
        out = np.empty(shape, dtype=dtype)
        return out, ptr(out)
    out, ints = _outputs.wait_output_into(h, allocate, want_ints=want_ints, stream=stream.value)
    synchronize()
    return out, ints
