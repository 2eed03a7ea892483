"""Collectives on NumPy arrays: spark_hvd without any deep-learning framework.

    import numpy as np
    import spark_hvd.numpy as hvd

    hvd.init()
    total = hvd.allreduce(np.ones(4, np.float32), op=hvd.Sum)

Every function takes ``name=`` (unnamed ops are numbered per kind, so ranks must issue them in
the same order) and ``process_set=``; ``*_async`` forms return a handle for
:func:`poll` / :func:`synchronize`.
"""

import ctypes

import numpy as np

from .common import *  # noqa: F401,F403  (the shared API: init, rank, ProcessSet, ...)
from .common import _ops
from .common._native import (BOOL, FLOAT16, FLOAT32, FLOAT64, INT8, INT16, INT32, INT64,
                             OP_ALLGATHER, OP_ALLREDUCE, OP_ALLTOALL, OP_BROADCAST,
                             OP_JOIN, OP_REDUCESCATTER, UINT8, UINT16)
from .common.objects import allgather_object, broadcast_object  # noqa: F401
from .common.process_sets import global_process_set, process_set_id

_DTYPES = {np.dtype(np.uint8): UINT8, np.dtype(np.int8): INT8, np.dtype(np.uint16): UINT16,
           np.dtype(np.int16): INT16, np.dtype(np.int32): INT32, np.dtype(np.int64): INT64,
           np.dtype(np.float16): FLOAT16, np.dtype(np.float32): FLOAT32,
           np.dtype(np.float64): FLOAT64, np.dtype(np.bool_): BOOL}


def _dtype_code(array):
    try:
        return _DTYPES[array.dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {array.dtype}; spark_hvd supports "
                         f"{', '.join(str(d) for d in _DTYPES)}") from None


def _contiguous(array):
    array = np.asarray(array)
    return np.ascontiguousarray(array) if not array.flags.c_contiguous else array


_addressof, _char_view = ctypes.addressof, ctypes.c_char.from_buffer


def _ptr(array):
    # ctypes' view of a writeable buffer is 3x cheaper than ``array.ctypes`` (a per-tensor cost).
    if array.flags.writeable and array.nbytes:
        return _addressof(_char_view(array))
    return array.ctypes.data


def _result_from_output(dtype):
    def finish(ids):
        data, shape, _ = _ops.wait_output(ids[0])
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy() if data else \
            np.zeros(shape, dtype=dtype)
    return finish


def allreduce_async(array, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts an allreduce of ``array``; the handle's result is a new array."""
    array = _contiguous(array)
    out = np.empty_like(array)
    return _allreduce_into(array, out, _ptr(array), _ptr(out), average, name, op,
                           prescale_factor, postscale_factor, process_set)


def allreduce_async_(array, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """In-place allreduce: ``array`` (C-contiguous) receives the result."""
    # The per-tensor hot path of gradient loops: everything inline (each call level costs).
    flags = array.flags
    if not (flags.c_contiguous and flags.writeable):
        raise ValueError("in-place allreduce needs a writeable C-contiguous array")
    ptr = _addressof(_char_view(array)) if array.nbytes else array.ctypes.data
    return _allreduce_into(array, array, ptr, ptr, average, name, op, prescale_factor,
                           postscale_factor, process_set)


def _allreduce_into(array, out, in_ptr, out_ptr, average, name, op, prescale, postscale,
                    process_set):
    reduce_op = _ops.resolve_reduce_op(op, average)
    ps = 0 if process_set is global_process_set else process_set_id(process_set)
    h = _ops.enqueue_allreduce(name if type(name) is str else _ops.auto_name("allreduce", name, ps),
                               _dtype_code(array), array.shape, in_ptr, out_ptr, reduce_op,
                               prescale, postscale, ps)
    return _ops.ResultHandle(h, out, array)


def allreduce(array, average=None, name=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Reduces ``array`` across the ranks of ``process_set`` (default op: Average) and returns
    the result as a new array, identical on every rank."""
    return allreduce_async(array, average, name, op, prescale_factor, postscale_factor,
                           process_set).wait()


def allreduce_(array, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """In-place :func:`allreduce`."""
    flags = array.flags if isinstance(array, np.ndarray) else None
    if flags is None or not (flags.c_contiguous and flags.writeable):
        return allreduce_async_(array, average, name, op, prescale_factor, postscale_factor,
                                process_set).wait()
    # The latency-bound hot path: no handle, enqueue and wait in one native call.
    reduce_op = _ops.resolve_reduce_op(op, average)
    ps = 0 if process_set is global_process_set else process_set_id(process_set)
    ptr = _addressof(_char_view(array)) if array.nbytes else array.ctypes.data
    _ops.allreduce_now(name if type(name) is str else _ops.auto_name("allreduce", name, ps),
                       _dtype_code(array), array.shape, ptr, ptr, reduce_op, prescale_factor,
                       postscale_factor, ps, array, named=name is not None)
    return array


def grouped_allreduce_async(arrays, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Allreduce of several arrays negotiated together and fused into one collective."""
    reduce_op = _ops.resolve_reduce_op(op, average)
    ps = process_set_id(process_set)
    group = _ops.auto_name("grouped_allreduce", name, ps)
    arrays = [_contiguous(a) for a in arrays]
    outs = [np.empty_like(a) for a in arrays]
    ops = [_ops.make_op(OP_ALLREDUCE, f"{group}.{i}", _dtype_code(a), a.shape, _ptr(a), _ptr(o),
                        reduce_op=reduce_op, prescale=prescale_factor,
                        postscale=postscale_factor, process_set=ps, group=group,
                        group_size=len(arrays))
           for i, (a, o) in enumerate(zip(arrays, outs))]
    ids = _ops.enqueue(ops) if ops else []

    def finish(ids):
        _ops.wait_all(ids)
        return outs
    return _ops.Handle(ids, finish, keepalive=(arrays, outs))


def grouped_allreduce(arrays, average=None, name=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """Synchronous :func:`grouped_allreduce_async`; returns a list of arrays."""
    return grouped_allreduce_async(arrays, average, name, op, prescale_factor, postscale_factor,
                                   process_set).wait()


def allgather_async(array, name=None, process_set=global_process_set):
    """Starts an allgather: arrays are concatenated along the first dimension, which may differ
    between ranks (all other dimensions must agree)."""
    array = _contiguous(array)
    if array.ndim == 0:
        array = array.reshape(1)
    ps = process_set_id(process_set)
    h = _ops.enqueue_one(OP_ALLGATHER, _ops.auto_name("allgather", name, ps), _dtype_code(array),
                         array.shape, _ptr(array), None, process_set=ps)
    return _ops.Handle([h], _result_from_output(array.dtype), keepalive=array)


def allgather(array, name=None, process_set=global_process_set):
    """Concatenation of every rank's ``array`` along the first dimension, in rank order."""
    return allgather_async(array, name, process_set).wait()


def broadcast_async(array, root_rank, name=None, process_set=global_process_set):
    """Starts a broadcast of the root's ``array``; the result is a new array."""
    array = _contiguous(array)
    out = array.copy()
    return _broadcast_into(array, out, root_rank, name, process_set)


def broadcast_async_(array, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast into ``array`` (C-contiguous)."""
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError("in-place broadcast needs a writeable C-contiguous array")
    return _broadcast_into(array, array, root_rank, name, process_set)


def _broadcast_into(array, out, root_rank, name, process_set):
    ps = process_set_id(process_set)
    h = _ops.enqueue_one(OP_BROADCAST, _ops.auto_name("broadcast", name, ps), _dtype_code(array),
                         array.shape, _ptr(array), _ptr(out), root_rank=int(root_rank),
                         process_set=ps)
    return _ops.ResultHandle(h, out, keepalive=array)


def broadcast(array, root_rank, name=None, process_set=global_process_set):
    """The root rank's ``array`` on every rank (``root_rank`` counts within ``process_set``)."""
    return broadcast_async(array, root_rank, name, process_set).wait()


def broadcast_(array, root_rank, name=None, process_set=global_process_set):
    """In-place :func:`broadcast`."""
    return broadcast_async_(array, root_rank, name, process_set).wait()


def alltoall_async(array, splits=None, name=None, process_set=global_process_set):
    """Starts an alltoall; the handle's result is ``(received array, received splits)``."""
    array = _contiguous(array)
    splits = () if splits is None else _ops.check_splits(np.asarray(splits).reshape(-1).tolist())
    ps = process_set_id(process_set)
    h = _ops.enqueue_one(OP_ALLTOALL, _ops.auto_name("alltoall", name, ps), _dtype_code(array),
                         array.shape, _ptr(array), None, process_set=ps, splits=splits)

    def finish(ids):
        data, shape, received = _ops.wait_output(ids[0])
        out = np.frombuffer(data, dtype=array.dtype).reshape(shape).copy() if data else \
            np.zeros(shape, dtype=array.dtype)
        return out, np.asarray(received, dtype=np.int64)
    return _ops.Handle([h], finish, keepalive=array)


def alltoall(array, splits=None, name=None, process_set=global_process_set):
    """Sends ``splits[i]`` rows of ``array`` (consecutive, in rank order) to rank i and returns
    ``(rows received from every rank concatenated, received splits)``. Without ``splits`` the
    first dimension is divided evenly."""
    return alltoall_async(array, splits, name, process_set).wait()


def reducescatter_async(array, op=None, name=None, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Starts a reducescatter; the result is this rank's block of the reduced array."""
    array = _contiguous(array)
    reduce_op = _ops.resolve_scatter_op(op)
    ps = process_set_id(process_set)
    h = _ops.enqueue_one(OP_REDUCESCATTER, _ops.auto_name("reducescatter", name, ps),
                         _dtype_code(array), array.shape, _ptr(array), None,
                         reduce_op=reduce_op, prescale=prescale_factor,
                         postscale=postscale_factor, process_set=ps)
    return _ops.Handle([h], _result_from_output(array.dtype), keepalive=array)


def reducescatter(array, op=None, name=None, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduces ``array`` across ranks (Average by default, or Sum) and returns this rank's
    slice of the first dimension; with ``n`` ranks and ``d`` rows the first ``d % n`` ranks get
    one row more than the others (Horovod's rule)."""
    return reducescatter_async(array, op, name, process_set, prescale_factor,
                               postscale_factor).wait()


def barrier(process_set=global_process_set):
    """Returns once every rank of ``process_set`` has called barrier."""
    _ops.barrier_now(process_set_id(process_set))


def join():
    """Declares this rank out of data. It keeps taking part in other ranks' allreduces
    (contributing zeros) until every rank has joined; returns the last rank that joined."""
    h = _ops.enqueue_one(OP_JOIN, "__join__", UINT8, (), None, None)
    return int(_ops.wait_ints(h, keepalive=None)[0])


def poll(handle):
    """True if the async op behind ``handle`` has finished."""
    return handle.poll()


def synchronize(handle):
    """Waits for an async op and returns its result (raises its error)."""
    return handle.wait()
