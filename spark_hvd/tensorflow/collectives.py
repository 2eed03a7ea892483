"""The collectives as TensorFlow ops, eager and inside ``tf.function`` (no gradients here; see
``spark_hvd.tensorflow.differentiable``).

Each op is a *kernel*: a Python function on NumPy views of the input tensors that hands their
memory to the native core (pointer, dtype code, shape), waits, and returns the results.

- Eagerly, the kernel runs at once. CPU tensors are viewed without a copy; the core writes
  results into aligned NumPy buffers that become TF tensors through DLPack, also without a
  copy (TF's own ``Empty`` op costs more than the collective for small tensors).
- In a graph (``tf.function``, ``tf.compat.v1``) allreduces (plain and grouped: every gradient
  path) become one ``SparkHvdAllreduce`` node of the op library that build.py compiles against
  the installed TensorFlow (native/tensorflow/): no Python in the step, and a gradient nothing
  else reads is reduced in place. The other collectives, and allreduces when the library is
  missing or ``SPARK_HVD_TF_OPS=0``, become one ``tf.numpy_function`` node running the kernel.
  Both kinds are stateful, so ``tf.function``'s automatic control dependencies keep the
  collectives in program order on every rank, and have their static output shapes set.

Names: an unnamed op gets Horovod's per-kind number when it runs eagerly. In a ``tf.function``
the name is fixed when the function is traced, from the outermost function's name and a
counter of that trace, so a rank that retraces (e.g. on a smaller last batch) still agrees with
the others. Grouped ops are negotiated together and fused by the core.

Errors are raised on every rank, with Horovod's classes. Ranks that disagree about an op
(shape, dtype, op, root...; found when the ranks negotiate it) raise
``tf.errors.FailedPreconditionError``: eagerly a :class:`MismatchError`, which is also a
:class:`CollectiveError`; in a graph the same class with the same message (the allreduce kernel
reports it, and a ``SparkHvdCheck`` node for the ``tf.numpy_function`` ones; without the op
library it is ``InvalidArgumentError``). Arguments refused on this rank raise
:class:`CollectiveError` (a ``ValueError``, ``RuntimeError`` and
``tf.errors.InvalidArgumentError`` at once), ``InvalidArgumentError`` from a graph. Adasum over
a number of ranks that is not a power of two raises ``NotImplementedError`` when the op is
called or traced, as in Horovod.
"""

import ctypes
import itertools
import os
import sys
import threading
import warnings
import weakref

import numpy as np
import tensorflow as tf

from ..common import _ops, basics
from ..common import _errors
from ..common._config import env_flag
from ..common._native import (BFLOAT16, BOOL, FLOAT16, FLOAT32, FLOAT64, INT8, INT16, INT32,
                              INT64, OP_ALLGATHER, OP_ALLREDUCE, OP_ALLTOALL,
                              OP_BROADCAST, OP_JOIN, OP_REDUCESCATTER, UINT8, UINT16)
from ..common._ops import Adasum, Average, Sum
from ..common._outputs import wait_output_into
from ..common.gradients import check_adasum_size
from ..common.process_sets import global_process_set, process_set_id

_CODES = {tf.uint8: UINT8, tf.int8: INT8, tf.uint16: UINT16, tf.int16: INT16, tf.int32: INT32,
          tf.int64: INT64, tf.float16: FLOAT16, tf.bfloat16: BFLOAT16, tf.float32: FLOAT32,
          tf.float64: FLOAT64, tf.bool: BOOL}
_NP_CODES = {np.dtype(d.as_numpy_dtype): code for d, code in _CODES.items()}

# The core wants a valid address even for zero bytes.
_EMPTY = ctypes.create_string_buffer(8)
_EMPTY_PTR = ctypes.addressof(_EMPTY)


class CollectiveError(_errors.CollectiveError, tf.errors.InvalidArgumentError):
    """A collective was called wrongly or ranks disagree about it (raised on every rank).

    It is a ``ValueError`` and a ``RuntimeError`` (like every spark_hvd adapter's) and also a
    ``tf.errors.InvalidArgumentError``, which is what the same mistake raises from inside a
    ``tf.function``: one ``except`` clause covers both modes.
    """

    def __init__(self, message):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)

    def __reduce__(self):
        return type(self), (self.message,)


class MismatchError(CollectiveError, tf.errors.FailedPreconditionError):
    """The ranks disagreed about a collective (shape, dtype, op, root...), found when they
    negotiated it: ``tf.errors.FailedPreconditionError`` as in Horovod, eagerly and in graphs.
    Still a :class:`CollectiveError` (``ValueError``, ``RuntimeError`` and
    ``tf.errors.InvalidArgumentError``), so handlers written for spark_hvd's errors catch it.
    """

    def __init__(self, message):
        tf.errors.OpError.__init__(self, None, None, message, tf.errors.FAILED_PRECONDITION)


def _raise_as_collective_error(e, negotiated=False):
    """Re-raises a ValueError as a CollectiveError: a MismatchError when the core reported it
    while waiting (``negotiated``: the ranks disagreed), else the plain class (this rank's
    arguments were refused)."""
    if isinstance(e, ValueError) and not isinstance(e, (MismatchError, NotImplementedError)):
        if negotiated:
            raise MismatchError(str(e)).with_traceback(e.__traceback__) from None
        if not isinstance(e, CollectiveError):
            raise CollectiveError(str(e)).with_traceback(e.__traceback__) from None
    raise e


# -- checks and naming ----------------------------------------------------------------------

def dtype_code(dtype):
    """The core's code for a TF dtype; a clear ValueError for unsupported ones."""
    code = _CODES.get(tf.as_dtype(dtype))
    if code is None:
        raise ValueError(f"Tensor type {tf.as_dtype(dtype).name} is not supported; spark_hvd "
                         "supports " + ", ".join(d.name for d in _CODES))
    return code


def reduce_op(op, average=None, default=Average):
    """Horovod's ``op=`` / deprecated ``average=`` rules."""
    return _ops.resolve_reduce_op(op, average, default)


def scatter_op(op):
    """Average or Sum (reducescatter's only ops); any other is a CollectiveError."""
    return _ops.resolve_scatter_op(op)


_graph_counters = weakref.WeakKeyDictionary()


def _outermost_function_graph():
    graph = tf.compat.v1.get_default_graph()
    if not getattr(graph, "building_function", False):
        return None
    while getattr(getattr(graph, "outer_graph", None), "building_function", False):
        graph = graph.outer_graph
    return graph


def op_name(kind, name, set_id):
    """The name every rank gives this op (see the module docstring)."""
    if name is not None:
        return str(name)
    if not tf.executing_eagerly():
        graph = _outermost_function_graph()
        if graph is not None:
            n = next(_graph_counters.setdefault(graph, itertools.count()))
            scope = f"set{set_id}.{graph.name}" if set_id else graph.name
            return f"{kind}.{scope}.{n}"
    # Eager, or a tf.compat.v1 graph: its construction order is the same on every rank.
    return _ops.auto_name(kind, None, set_id)


def member_index(process_set):
    """This rank's index within ``process_set``."""
    if process_set is None or process_set is global_process_set:
        return basics.rank()
    return process_set.rank()


def member_count(process_set):
    """Number of ranks in ``process_set``."""
    if process_set is None or process_set is global_process_set:
        return basics.size()
    return process_set.size()


# -- buffers --------------------------------------------------------------------------------

def _ptr(array):
    return array.ctypes.data if array.size else _EMPTY_PTR


def _contiguous(array):
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


class _BufferPool:
    """Result buffers reused once nothing refers to their last result any more. A fresh
    multi-MB array every step is memory the core's first write page-faults in (about 3 us per
    4 KiB page: 5 ms of system time per step for an 11.6 MB model's gradients)."""

    MIN_BYTES = 64 * 1024
    PER_SIZE = 8  # buffers kept per size (a step may reduce several same-sized tensors)

    def __init__(self):
        self._buffers = {}  # nbytes -> [raw uint8 arrays]
        self._lock = threading.Lock()

    def get(self, nbytes):
        if nbytes < self.MIN_BYTES:
            return np.empty(nbytes + 64, np.uint8)
        with self._lock:
            kept = self._buffers.setdefault(nbytes, [])
            for raw in kept:
                # Referenced by the list, the loop variable and getrefcount's argument only:
                # no view of it (a result TF still holds) is alive.
                if sys.getrefcount(raw) == 3:
                    return raw
            raw = np.empty(nbytes + 64, np.uint8)
            if len(kept) < self.PER_SIZE:
                kept.append(raw)
            return raw


_buffers = _BufferPool()


def _alloc(shape, dtype):
    """A 64-byte aligned NumPy array (TF's alignment, so TF can adopt the memory as is);
    returned twice: the result object and the buffer the core writes."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = _buffers.get(nbytes)
    offset = (-raw.ctypes.data) % 64
    a = raw[offset:offset + nbytes].view(dtype).reshape(shape)
    return a, a


_BF16 = np.dtype(tf.bfloat16.as_numpy_dtype)


def _adopt(array):
    """An EagerTensor on ``array``'s memory, without a copy (DLPack keeps the array alive)."""
    if array.dtype == _BF16:  # DLPack has no bfloat16: adopt the bits, reinterpret them
        return tf.bitcast(tf.experimental.dlpack.from_dlpack(array.view(np.uint16).__dlpack__()),
                          tf.bfloat16)
    return tf.experimental.dlpack.from_dlpack(array.__dlpack__())


def _enqueue(records):
    try:
        return _ops.enqueue(records)
    except ValueError as e:
        _raise_as_collective_error(e)


def _wait_all(ids, keepalive):
    try:
        _ops.wait_all(ids, keepalive)
    except ValueError as e:
        _raise_as_collective_error(e, negotiated=True)


def _collect_outputs(ids, arrays, alloc, want_ints=0):
    """Copies every core-allocated result into memory from ``alloc``; collects (and releases)
    every handle even when one failed, then raises the first error."""
    _ops.wait_done(ids, keepalive=arrays)
    outs, ints, error = [], [], None
    for hid, a in zip(ids, arrays):
        def allocate(shape, nbytes, dtype=a.dtype):
            obj, view = alloc(shape, dtype)
            return obj, _ptr(view)
        try:
            obj, received = wait_output_into(hid, allocate, want_ints=want_ints)
            outs.append(obj)
            ints.append(received)
        except Exception as e:  # noqa: BLE001 - re-raised below
            error = error or e
    if error is not None:
        _raise_as_collective_error(error, negotiated=True)
    return outs, ints


# -- kernels: lists of NumPy arrays in, results out -----------------------------------------

class _Kernel:
    """A collective in two steps: ``start(arrays, alloc)`` enqueues it and returns ``(handle
    ids, pending)``; ``finish(pending)`` waits for the handles and returns the outputs. Called
    as a function the steps run back to back (eagerly, and in graphs without the op library);
    in a graph with the op library a SparkHvdWait node waits between them (run_kernel)."""

    def __init__(self, start, finish):
        self.start, self.finish = start, finish

    def __call__(self, arrays, alloc):
        return self.finish(self.start(arrays, alloc)[1])


def _finish_in_place(pending):
    ids, arrays, outs = pending
    _wait_all(ids, (arrays, outs))
    return [obj for obj, _ in outs]


def _allreduce_kernel(names, group, op, prescale, postscale, set_id):
    def start(arrays, alloc):
        arrays = [_contiguous(a) for a in arrays]
        outs = [alloc(a.shape, a.dtype) for a in arrays]
        records = [_ops.make_op(OP_ALLREDUCE, n, _NP_CODES[a.dtype], a.shape, _ptr(a),
                                _ptr(view), reduce_op=op, prescale=prescale,
                                postscale=postscale, process_set=set_id, group=group,
                                group_size=len(arrays) if group else 0)
                   for n, a, (_, view) in zip(names, arrays, outs)]
        ids = _enqueue(records)
        return ids, (ids, arrays, outs)
    return _Kernel(start, _finish_in_place)


def _gather_kernel(kind, names, group, set_id, op=Sum, prescale=1.0, postscale=1.0):
    def start(arrays, alloc):
        arrays = [_contiguous(a) for a in arrays]
        arrays = [a.reshape(1) if a.ndim == 0 and kind == OP_ALLGATHER else a for a in arrays]
        records = [_ops.make_op(kind, n, _NP_CODES[a.dtype], a.shape, _ptr(a), None,
                                reduce_op=op, prescale=prescale, postscale=postscale,
                                process_set=set_id, group=group,
                                group_size=len(arrays) if group else 0)
                   for n, a in zip(names, arrays)]
        ids = _enqueue(records)
        return ids, (ids, arrays, alloc)

    def finish(pending):
        ids, arrays, alloc = pending
        return _collect_outputs(ids, arrays, alloc)[0]
    return _Kernel(start, finish)


def _broadcast_kernel(names, root_rank, set_id):
    def start(arrays, alloc):
        arrays = [_contiguous(a) for a in arrays]
        outs = [alloc(a.shape, a.dtype) for a in arrays]
        records = [_ops.make_op(OP_BROADCAST, n, _NP_CODES[a.dtype], a.shape, _ptr(a),
                                _ptr(view), root_rank=root_rank, process_set=set_id)
                   for n, a, (_, view) in zip(names, arrays, outs)]
        ids = _enqueue(records)
        return ids, (ids, arrays, outs)
    return _Kernel(start, _finish_in_place)


def _alltoall_kernel(name, set_id, want):
    def start(arrays, alloc):
        a = _contiguous(arrays[0])
        splits = () if len(arrays) == 1 else tuple(int(s) for s in np.reshape(arrays[1], -1))
        record = _ops.make_op(OP_ALLTOALL, name, _NP_CODES[a.dtype], a.shape, _ptr(a), None,
                              process_set=set_id, splits=splits)
        ids = _enqueue([record])
        return ids, (ids, a, alloc)

    def finish(pending):
        ids, a, alloc = pending
        outs, ints = _collect_outputs(ids, [a], alloc, want_ints=want)
        received, view = alloc((len(ints[0]),), np.int32)
        view[...] = ints[0]
        return [outs[0], received]
    return _Kernel(start, finish)


# -- the native graph op (optional) ---------------------------------------------------------

_GRAPH_OPS_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "_core", "libspark_hvd_tf.so")
_graph_ops = None  # the loaded op module; False once found unavailable


def graph_ops():
    """The ``SparkHvdAllreduce`` op library, or None: graphs then use ``tf.numpy_function``.

    None when ``SPARK_HVD_TF_OPS=0``, when it was not built, or when it does not load (a
    warning says why). It is built on TensorFlow's C API, so one build serves TensorFlow 2.16
    and later."""
    global _graph_ops
    if _graph_ops is None:
        _graph_ops = False
        if not env_flag("TF_OPS", True):
            pass
        elif not os.path.exists(_GRAPH_OPS_PATH):
            # Works, 2-4 ms slower per step for a model of 10 MB of gradients.
            warnings.warn(f"spark_hvd: {_GRAPH_OPS_PATH} was not built, so TensorFlow graphs "
                          "allreduce through tf.numpy_function (slower). Build it with `python "
                          "build.py` (or reinstall spark_hvd); SPARK_HVD_TF_OPS=0 silences this.")
        else:
            # The library reads SPARK_HVD_TF_SYNC_KERNELS itself: the value as resolved here
            # (HOROVOD_TF_SYNC_KERNELS too), before it loads.
            os.environ["SPARK_HVD_TF_SYNC_KERNELS"] = "1" if env_flag("TF_SYNC_KERNELS") else "0"
            try:
                _graph_ops = tf.load_op_library(_GRAPH_OPS_PATH)
                if not hasattr(_graph_ops, "spark_hvd_allreduce"):
                    _graph_ops = False
                    raise ImportError("it has no SparkHvdAllreduce op")
            except Exception as e:  # noqa: BLE001 - any load failure means: use the fallback
                warnings.warn(f"spark_hvd: cannot load {_GRAPH_OPS_PATH} ({e}); TensorFlow graphs "
                              "use tf.numpy_function instead (TensorFlow "
                              f"{tf.__version__}; it needs 2.16 or later; `python build.py` rebuilds it).")
    return _graph_ops or None


# -- running a kernel eagerly or as a graph node --------------------------------------------

def _eager_array(t):
    a = t._numpy() if hasattr(t, "_numpy") else t  # a view of a CPU tensor's memory
    return a if isinstance(a, np.ndarray) else np.asarray(a)


def run_kernel(kernel, tensors, out_dtypes, out_shapes):
    """Runs ``kernel`` on ``tensors`` now (eager) or adds it to the graph; returns a list."""
    if tf.executing_eagerly():
        outs = kernel([_eager_array(t) for t in tensors], _alloc)
        return [_adopt(o) for o in outs]

    ops = graph_ops()
    if ops is not None and isinstance(kernel, _Kernel):
        outs = _two_step_graph(ops, kernel, tensors, out_dtypes)
    else:  # a mismatch then surfaces as TensorFlow makes it: InvalidArgumentError
        def graph_kernel(*arrays):
            return kernel([np.asarray(a) for a in arrays], _alloc)  # scalars arrive unboxed
        outs = tf.numpy_function(graph_kernel, list(tensors), list(out_dtypes), stateful=True)
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    for o, shape in zip(outs, out_shapes):
        o.set_shape(shape)
    return outs


_pending = {}  # key -> a started op's pending state, from its start node to its finish node
_pending_keys = itertools.count()


def _two_step_graph(ops, kernel, tensors, out_dtypes):
    """``kernel`` as three graph nodes, so that no executor thread waits for the other ranks:
    a tf.numpy_function that enqueues the op, a SparkHvdWait node that waits for it on the op
    library's own thread, and a tf.numpy_function that collects the results. A single node
    blocking until the others arrive could hang a tf.compat.v1 graph that holds more
    independent collectives than the inter-op pool has threads, each rank starting them in its
    own order (Horovod's grouped IndexedSlices test did).

    The collecting node reports a MismatchError (the ranks disagreed) as (failed, message) to a
    SparkHvdCheck node, which every output depends on, so that the graph fails with
    FailedPrecondition as eagerly and in Horovod (TensorFlow would turn the exception into
    InvalidArgument). A run cancelled between the two nodes leaves its entry in ``_pending``."""
    def start(*arrays):
        # Copies: the op outlives this node, after which TensorFlow may reuse its inputs.
        ids, pending = kernel.start([np.array(a) for a in arrays], _alloc)
        key = next(_pending_keys)
        _pending[key] = pending
        return np.int64(key), np.asarray(ids, np.int64)
    key, ids = tf.numpy_function(start, list(tensors), [tf.int64, tf.int64], stateful=True)
    key = ops.spark_hvd_wait(ids, key)
    empty = [np.zeros(0, tf.as_dtype(d).as_numpy_dtype) for d in out_dtypes]

    def finish(key):
        try:
            outs = kernel.finish(_pending.pop(int(key)))
        except MismatchError as e:
            return empty + [np.bool_(True), np.frombuffer(e.message.encode(), np.uint8)]
        return list(outs) + [np.bool_(False), np.zeros(0, np.uint8)]
    # The message as UTF-8 bytes: the op library reads tensors through TensorFlow's C API,
    # which does not describe a string tensor's memory.
    *outs, failed, message = tf.numpy_function(
        finish, [key], list(out_dtypes) + [tf.bool, tf.uint8], stateful=True)
    with tf.control_dependencies([ops.spark_hvd_check(failed, message)]):
        return [tf.identity(o) for o in outs]


def _tensors(values):
    out = []
    for v in values:
        t = tf.convert_to_tensor(v)
        dtype_code(t.dtype)
        out.append(t)
    return out


# -- the ops (lists in, lists out; not differentiable) --------------------------------------

def _op_names(kind, name, set_id, grouped, count):
    """(group name or None, tensor names): a grouped op negotiates ``count`` tensors named
    ``<group>.<i>`` together; an ungrouped one is one named op."""
    if not grouped:
        return None, [op_name(kind, name, set_id)]
    group = op_name(f"grouped_{kind}", name, set_id)
    return group, [f"{group}.{i}" for i in range(count)]


def allreduce_list(tensors, name, op, prescale_factor, postscale_factor, process_set, grouped):
    """Allreduce of each tensor; ``grouped`` negotiates them together."""
    tensors = _tensors(tensors)
    if not tensors:
        return []
    try:
        check_adasum_size(op, member_count(process_set))
    except NotImplementedError as e:
        if tf.executing_eagerly():
            raise
        # While tracing, AutoGraph passes only builtin exception types on (others become a
        # StagingError): Horovod's NotImplementedError, as such.
        raise NotImplementedError(str(e)) from None
    set_id = process_set_id(process_set)
    group, names = _op_names("allreduce", name, set_id, grouped, len(tensors))
    ops = None if tf.executing_eagerly() else graph_ops()
    if ops is not None:
        return list(ops.spark_hvd_allreduce(
            tensors, tensor_names=names, group=group or "", reduce_op=int(op),
            prescale=repr(float(prescale_factor)), postscale=repr(float(postscale_factor)),
            process_set=int(set_id)))
    kernel = _allreduce_kernel(names, group, op, float(prescale_factor), float(postscale_factor),
                               set_id)
    return run_kernel(kernel, tensors, [t.dtype for t in tensors], [t.shape for t in tensors])


def _gathered_shape(shape):
    if shape.rank is None:
        return tf.TensorShape(None)
    if shape.rank == 0:
        return tf.TensorShape([None])
    return tf.TensorShape([None]).concatenate(shape[1:])


def allgather_list(tensors, name, process_set, grouped):
    """Allgather of each tensor along the first dimension."""
    tensors = _tensors(tensors)
    if not tensors:
        return []
    set_id = process_set_id(process_set)
    group, names = _op_names("allgather", name, set_id, grouped, len(tensors))
    kernel = _gather_kernel(OP_ALLGATHER, names, group, set_id)
    return run_kernel(kernel, tensors, [t.dtype for t in tensors],
                      [_gathered_shape(t.shape) for t in tensors])


def broadcast_list(tensors, root_rank, name, process_set):
    """Broadcast of each tensor from ``root_rank`` (submitted together, one graph node)."""
    tensors = _tensors(tensors)
    if not tensors:
        return []
    set_id = process_set_id(process_set)
    base = op_name("broadcast", name, set_id)
    names = [base] if len(tensors) == 1 else [f"{base}.{i}" for i in range(len(tensors))]
    kernel = _broadcast_kernel(names, int(root_rank), set_id)
    return run_kernel(kernel, tensors, [t.dtype for t in tensors], [t.shape for t in tensors])


def alltoall_pair(tensor, splits, name, process_set):
    """``(received, received_splits)``; ``splits`` may be None, a list or a tensor."""
    tensor = _tensors([tensor])[0]
    set_id = process_set_id(process_set)
    inputs = [tensor]
    if splits is not None:
        inputs.append(tf.cast(tf.reshape(tf.convert_to_tensor(splits), [-1]), tf.int64))
    n = member_count(process_set)
    kernel = _alltoall_kernel(op_name("alltoall", name, set_id), set_id, max(n, 1))
    return run_kernel(kernel, inputs, [tensor.dtype, tf.int32],
                      [_gathered_shape(tensor.shape), tf.TensorShape([n])])


def _scattered_shape(shape, process_set):
    if shape.rank is None or shape.rank == 0:
        return tf.TensorShape(None)
    rows = shape[0]
    if rows is not None:
        n, me = member_count(process_set), member_index(process_set)
        rows = rows // n + (1 if me < rows % n else 0)
    return tf.TensorShape([rows]).concatenate(shape[1:])


def reducescatter_list(tensors, name, op, process_set, prescale_factor, postscale_factor,
                       grouped):
    """Reducescatter of each tensor (this rank's block of the first dimension)."""
    tensors = _tensors(tensors)
    if not tensors:
        return []
    set_id = process_set_id(process_set)
    group, names = _op_names("reducescatter", name, set_id, grouped, len(tensors))
    kernel = _gather_kernel(OP_REDUCESCATTER, names, group, set_id, op=op,
                            prescale=float(prescale_factor), postscale=float(postscale_factor))
    return run_kernel(kernel, tensors, [t.dtype for t in tensors],
                      [_scattered_shape(t.shape, process_set) for t in tensors])


# -- join and barrier -----------------------------------------------------------------------

def _join_kernel(arrays, alloc):
    h = _ops.enqueue_one(OP_JOIN, "__join__", UINT8, (), None, None)
    try:
        last = int(_ops.wait_ints(h, keepalive=None)[0])
    except ValueError as e:
        _raise_as_collective_error(e)
    obj, view = alloc((), np.int32)
    view[...] = last
    return [obj]


@tf.autograph.experimental.do_not_convert
def join():
    """Declares that this rank has run out of data. Until every rank has joined it keeps
    taking part in the other ranks' allreduces (contributing zeros). Returns the rank that
    joined last (an int32 scalar tensor)."""
    return run_kernel(_join_kernel, [], [tf.int32], [tf.TensorShape([])])[0]


@tf.autograph.experimental.do_not_convert
def barrier(process_set=global_process_set):
    """Returns once every rank of ``process_set`` has called barrier (in a ``tf.compat.v1``
    graph: returns the op to run)."""
    set_id = process_set_id(process_set)

    def kernel(arrays, alloc):
        try:
            _ops.barrier_now(set_id)
        except ValueError as e:
            _raise_as_collective_error(e)
        obj, view = alloc((), np.bool_)
        view[...] = True
        return [obj]
    out = run_kernel(kernel, [], [tf.bool], [tf.TensorShape([])])[0]
    return None if tf.executing_eagerly() or tf.inside_function() else out.op
