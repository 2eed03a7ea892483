"""broadcast_object / allgather_object, shared by every framework adapter: objects are pickled
into uint8 NumPy arrays and moved with the core's collectives. Pickled with cloudpickle, as
Horovod does, so lambdas, closures and classes defined in a function travel too."""

import pickle

import cloudpickle
import numpy as np

from . import _ops, basics
from ._native import OP_ALLGATHER, OP_BROADCAST, UINT8, INT64
from .process_sets import global_process_set, process_set_id


def _broadcast_bytes(array, root_rank, name, set_id):
    out = array if array.flags.writeable else array.copy()
    h = _ops.enqueue_one(OP_BROADCAST, name, UINT8 if array.dtype == np.uint8 else INT64,
                         array.shape, array.ctypes.data, out.ctypes.data, root_rank=root_rank,
                         process_set=set_id)
    _ops.wait(h, keepalive=(array, out))
    return out


def _allgather_array(array, name, set_id):
    code = UINT8 if array.dtype == np.uint8 else INT64
    h = _ops.enqueue_one(OP_ALLGATHER, name, code, array.shape, array.ctypes.data, None,
                         process_set=set_id)
    data, shape, _ = _ops.wait_output(h, keepalive=array)
    return np.frombuffer(data, dtype=array.dtype).reshape(shape)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Returns the root rank's ``obj`` (any object cloudpickle can pickle) on every rank of
    ``process_set``. ``root_rank`` is a global rank (Horovod's rule) and must be a member of
    ``process_set``."""
    set_id = process_set_id(process_set)
    name = _ops.auto_name("broadcast_object", name, set_id)
    if basics.rank() == root_rank:
        payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)
    else:
        payload = None
    length = np.array([0 if payload is None else payload.size], dtype=np.int64)
    length = _broadcast_bytes(length, root_rank, f"{name}.size", set_id)
    if payload is None:
        payload = np.zeros(int(length[0]), dtype=np.uint8)
    payload = _broadcast_bytes(payload, root_rank, f"{name}.data", set_id)
    return pickle.loads(payload.tobytes())


def allgather_object(obj, name=None, process_set=global_process_set):
    """Returns the list of every rank's ``obj`` (cloudpickled), in rank order."""
    set_id = process_set_id(process_set)
    name = _ops.auto_name("allgather_object", name, set_id)
    payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)
    sizes = _allgather_array(np.array([payload.size], dtype=np.int64), f"{name}.sizes", set_id)
    data = _allgather_array(payload, f"{name}.data", set_id)
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(data[offset:offset + n].tobytes()))
        offset += n
    return out
