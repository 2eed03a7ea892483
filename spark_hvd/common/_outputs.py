"""Collecting core-allocated results (allgather, alltoall, reducescatter) into framework memory
with exactly one copy: the adapter allocates a tensor of the result's shape and the bytes are
moved straight into it (``_ops.wait_output`` goes through an intermediate ``bytes`` object)."""

import ctypes

from ._native import check, lib

_MAX_DIMS = 32


def wait_output_into(handle_id, allocate, want_ints=0, stream=None):
    """Waits for ``handle_id``, then ``allocate(shape, nbytes)`` must return ``(obj, pointer)``
    for a writable buffer of ``nbytes`` bytes, into which the result is copied. Returns
    ``(obj, ints)`` where ``ints`` holds up to ``want_ints`` values of the op's integer output
    (alltoall's received splits). The handle is released either way. A result the core holds
    on a GPU (CUDA inputs) is copied device to device on ``stream`` (a ``cudaStream_t`` as an
    int), into a buffer ``allocate`` made on that device."""
    try:
        check(lib.shvd_wait(handle_id))
        ptr, nbytes = ctypes.c_void_p(), ctypes.c_int64()
        check(lib.shvd_output(handle_id, ctypes.byref(ptr), ctypes.byref(nbytes)))
        shape_buf = (ctypes.c_int64 * _MAX_DIMS)()
        ndim = check(lib.shvd_output_shape(handle_id, shape_buf, _MAX_DIMS))
        obj, dst = allocate(tuple(shape_buf[:ndim]), nbytes.value)
        if lib.shvd_output_device(handle_id) >= 0:
            check(lib.shvd_output_copy(handle_id, dst, stream or None))
        elif nbytes.value:
            ctypes.memmove(dst, ptr, nbytes.value)
        ints = []
        if want_ints:
            ints_buf = (ctypes.c_int64 * want_ints)()
            n = check(lib.shvd_output_ints(handle_id, ints_buf, want_ints))
            ints = list(ints_buf[:n])
        return obj, ints
    finally:
        lib.shvd_release(handle_id)
