"""Framework-neutral plumbing for collectives: naming, reduce-op resolution, enqueueing raw
buffers into the native core and collecting results. The NumPy, torch and TensorFlow adapters
only convert their tensors to (pointer, dtype code, shape) and back.

Layering of ``spark_hvd.common``, each module importing only those above it:
``_native`` (the C ABI) <- ``_ops`` (this module: enqueue and wait) <- ``process_sets`` <-
``basics`` (init and shutdown, which start and stop the layers below).
"""

import ctypes
import itertools
import numbers
import struct
import warnings
from collections import defaultdict

from ._errors import CollectiveError
from ._native import (OP_ALLREDUCE, OP_BARRIER, REDUCE_OPS, UINT8, check, lib, raise_last_error,
                      require_init)

# Reduce ops: the core's codes (SHVD_REDUCE_* in spark_hvd.h), read from it at load.
Average, Sum, Adasum, Min, Max, Product = (
    REDUCE_OPS[n] for n in ("Average", "Sum", "Adasum", "Min", "Max", "Product"))
_REDUCE_OP_NAMES = {code: name for name, code in REDUCE_OPS.items()}

_name_counters = defaultdict(itertools.count)


def reset_auto_names():
    """Every ``init()`` numbers unnamed ops from 0 again: the ranks of a new connection
    (an elastic round joined by new processes too) all start from the same count."""
    _name_counters.clear()


def auto_name(kind, name, process_set_id=0):
    """Horovod's rule: unnamed ops are numbered per kind, so every rank must issue its unnamed
    ops in the same order. Counting per process set as well keeps the ranks of one set in step
    when other sets run unnamed ops the set's members never see."""
    if name is not None:
        return str(name)
    n = next(_name_counters[(kind, process_set_id)])
    return f"{kind}.noname.{n}" if not process_set_id else f"{kind}.set{process_set_id}.noname.{n}"


def resolve_reduce_op(op, average, default=Average):
    """Horovod's argument rules for ``op=`` and the deprecated ``average=``."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    if op is None:
        return default
    if op not in _REDUCE_OP_NAMES:
        raise ValueError(f"unknown reduce op {op!r}; use Average, Sum, Min, Max or Product")
    return op


def resolve_scatter_op(op, average=None, default=Average):
    """``resolve_reduce_op`` for reducescatter, which reduces with Average or Sum only: any
    other op is a :class:`CollectiveError` (a ``RuntimeError`` as Horovod's refusal was, and a
    ``ValueError``) raised on the calling rank before anything is enqueued."""
    op = resolve_reduce_op(op, average, default)
    if op not in (Average, Sum):
        raise CollectiveError(f"reducescatter supports op=Average and op=Sum only, not "
                              f"op={_REDUCE_OP_NAMES[op]}")
    return op


def check_splits(splits):
    """Alltoall ``splits`` (any sequence of integers) as a tuple of ints. Other values are a
    ``ValueError`` (Horovod wants an int32 tensor), never silently truncated."""
    values = tuple(splits)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
    if bad:
        raise ValueError(f"alltoall splits must be integers, got {bad[0]!r} "
                         f"({type(bad[0]).__name__}); pass an int32 tensor or a list of ints")
    return tuple(int(v) for v in values)


# One Struct per (name length, group length, shape+splits length): a record is then a single
# pack call, the per-tensor hot path of every adapter.
_RECORD_FORMATS = {}


def _record_format(key):
    """The Struct for a record of key = (name length, group length, shape+splits length)."""
    fmt = _RECORD_FORMATS.get(key)
    if fmt is None:
        if len(_RECORD_FORMATS) > 4096:
            _RECORD_FORMATS.clear()
        fmt = _RECORD_FORMATS[key] = struct.Struct("<8i2q2d4iq{}s{}s{}q".format(*key))
    return fmt


HOST = (0, 0, 0)  # (device kind, device, stream) of a host buffer


def make_op(kind, name, dtype, shape, input_ptr, output_ptr, reduce_op=Sum, prescale=1.0,
            postscale=1.0, root_rank=0, process_set=0, splits=(), group=None, group_size=0,
            place=HOST):
    """Serialises one op description for ``shvd_enqueue_packed`` (layout in spark_hvd.h).
    ``place``: ``(1, device, stream)`` for buffers on CUDA device ``device``, ready for work
    enqueued on ``stream`` (a ``cudaStream_t`` as an int)."""
    name_b = name.encode()
    group_b = group.encode() if group else b""
    ndim, nsplits = len(shape), len(splits)
    fmt = _record_format((len(name_b), len(group_b), ndim + nsplits))
    return fmt.pack(kind, dtype, reduce_op, root_rank, process_set, ndim, nsplits, group_size,
                    input_ptr or 0, output_ptr or 0, prescale, postscale, len(name_b),
                    len(group_b), *place, name_b, group_b, *shape, *splits)


def _allreduce_record(name, dtype, shape, input_ptr, output_ptr, reduce_op, prescale, postscale,
                      process_set, place=HOST):
    name_b = name.encode() if type(name) is str else str(name).encode()
    ndim = len(shape)
    key = (len(name_b), 0, ndim)
    return (_RECORD_FORMATS.get(key) or _record_format(key)).pack(
        OP_ALLREDUCE, dtype, reduce_op, 0, process_set, ndim, 0, 0, input_ptr, output_ptr,
        prescale, postscale, len(name_b), 0, *place, name_b, b"", *shape)


def enqueue_allreduce(name, dtype, shape, input_ptr, output_ptr, reduce_op, prescale, postscale,
                      process_set, place=HOST):
    """:func:`enqueue_one` for a single allreduce with positional arguments: the per-tensor hot
    path of every adapter (gradient hooks, ``allreduce_async_``), about twice as fast."""
    record = _allreduce_record(name, dtype, shape, input_ptr, output_ptr, reduce_op, prescale,
                               postscale, process_set, place)
    handle = _enqueue_native(record, len(record))
    if handle == -1:
        _enqueue_failed()
    if _orphans:
        _tend_orphans()
    return handle


_SYNC_RECORDS = {}  # allreduce_now's records by their arguments


def allreduce_now(name, dtype, shape, input_ptr, output_ptr, reduce_op, prescale, postscale,
                  process_set, keepalive, place=HOST, named=True):
    """A synchronous allreduce of one buffer (arguments as :func:`enqueue_allreduce`): enqueues
    it and waits in one native call, which also tells the engine to send it at once (no burst
    to end; see ``shvd_enqueue_record_wait``). ``keepalive``: the buffers, kept until the op
    completed when a signal handler interrupts the wait. ``named``: the user named the op (an
    unnamed op's generated name is never seen again, so its record is not kept). Raises the
    op's error."""
    # A latency-bound loop repeats the same call (same buffer, name, shape): its record is
    # packed once (a lookup costs about a third of a pack).
    key = (name, dtype, shape, input_ptr, output_ptr, reduce_op, prescale, postscale,
           process_set, place)
    record = _SYNC_RECORDS.get(key) if named else None
    if record is None:
        record = _allreduce_record(name, dtype, shape, input_ptr, output_ptr, reduce_op,
                                   prescale, postscale, process_set, place)
        if named:
            if len(_SYNC_RECORDS) >= 1024:
                _SYNC_RECORDS.clear()
            _SYNC_RECORDS[key] = record
    rc = 0
    try:
        rc = _enqueue_wait_native(record, len(record), _SLICE)
        if rc > 0:  # still running after the first slice: wait in slices as wait() does
            wait(rc, keepalive)
            return
    except BaseException:
        if rc > 0:  # a signal handler raised: the core may still use the buffers
            _adopt((rc,), keepalive)
        raise
    _finish_now(rc)


def _finish_now(rc):
    """The end of a synchronous op (``shvd_enqueue_record_wait``'s return code)."""
    if _orphans:
        _tend_orphans()
    if rc == -1:
        _enqueue_failed()
    if rc == -2:
        raise_last_error()


_BARRIER_RECORDS = {}  # barrier_now's records by process set


def barrier_now(process_set=0):
    """Returns once every member of ``process_set`` called it. Named "barrier" on every call,
    as in Horovod (so concurrent barriers of one set on one rank are an error there too): it
    is answered from the response cache after the first time, and on one host agreed through
    shared memory by the calling thread, like a small allreduce."""
    record = _BARRIER_RECORDS.get(process_set)
    if record is None:
        record = _BARRIER_RECORDS[process_set] = make_op(
            OP_BARRIER, "barrier", UINT8, (), None, None, process_set=process_set)
    rc = _enqueue_wait_native(record, len(record), _SLICE)
    if rc > 0:
        wait(rc, keepalive=None)
        return
    _finish_now(rc)


_enqueue_native = lib.shvd_enqueue_record
_enqueue_wait_native = lib.shvd_enqueue_record_wait


def _enqueue_record(record):
    handle = _enqueue_native(record, len(record))
    if handle == -1:
        _enqueue_failed()
    if _orphans:
        _tend_orphans()
    return handle


def _enqueue_failed():
    require_init()  # "not initialized" is a ValueError, as in Horovod
    raise_last_error()


def enqueue(records):
    """Enqueues serialised ops atomically; returns their native handles."""
    n = len(records)
    handles = (ctypes.c_int64 * n)()
    data = b"".join(records)
    if lib.shvd_enqueue_packed(data, len(data), n, handles) == -1:
        _enqueue_failed()
    if _orphans:
        _tend_orphans()
    return list(handles)


def enqueue_one(kind, name, dtype, shape, input_ptr, output_ptr, **kwargs):
    return _enqueue_record(make_op(kind, name, dtype, shape, input_ptr, output_ptr, **kwargs))


def poll(handle_id):
    return check(lib.shvd_poll(handle_id)) == 1


# -- the buffers of ops in flight -------------------------------------------------------------
#
# The core reads an op's input and writes its output until the op completes, whatever the
# caller does meanwhile (Horovod's guarantee). Handles hold those buffers (``keepalive``); a
# handle dropped before its op completed (a discarded ``allreduce_async``, a wait a signal
# handler interrupted) hands its native ids and buffers to ``_orphans``, which keeps them until
# the core is done with them. Orphans are swept (completed ones released, their buffers
# dropped) while ops are enqueued, and dropped at shutdown once the engine has stopped.

_orphans = {}  # native handle id -> the buffers its op uses (a group's ids share one object)
_sweep_countdown = [0]  # enqueues until the next sweep


def _adopt(ids, keepalive):
    """Keeps ``keepalive`` until every op of ``ids`` completed, then releases the ids."""
    for handle_id in ids:
        _orphans[handle_id] = keepalive


def _tend_orphans():
    # A sweep costs O(orphans): the next one comes after an eighth as many enqueues, so each
    # enqueue pays O(1) on average and a completed orphan's buffers go within that many ops.
    _sweep_countdown[0] -= 1
    if _sweep_countdown[0] <= 0:
        sweep_orphans()
        _sweep_countdown[0] = len(_orphans) // 8 + 1


def sweep_orphans():
    """Releases the orphaned ops that completed and drops their buffers."""
    ids = list(_orphans)
    if not ids:
        return
    pending_ids = (ctypes.c_int64 * len(ids))(*ids)
    pending = lib.shvd_release_completed(pending_ids, len(ids))
    if pending < 0:
        return  # no engine: shutdown drops them once it has stopped
    still = set(pending_ids[:pending])
    for handle_id in ids:
        if handle_id not in still:
            _orphans.pop(handle_id, None)  # pop: another thread may sweep at the same time


def drop_orphans():
    """Called once the engine has stopped (shutdown): nothing uses the buffers any more."""
    _orphans.clear()
    _sweep_countdown[0] = 0


# -- waiting ----------------------------------------------------------------------------------
#
# Python runs signal handlers (Ctrl-C's KeyboardInterrupt, SIGALRM, pytest-timeout) only on the
# main thread, between bytecodes: never while a ctypes call blocks. So every wait blocks in the
# core for at most WAIT_SLICE_MS at a time and loops; an op that completes within the first
# slice costs one native call, as an unbounded wait did. When a handler raises, the op stays in
# flight: its buffers are kept until it completes (see above) and the exception propagates.

WAIT_SLICE_MS = 50
# The slice as a ready ctypes value: converting a Python int argument costs about twice as
# much (~150 ns per call, measured), on the per-tensor hot path.
_SLICE = ctypes.c_int32(WAIT_SLICE_MS)

# The default ``keepalive`` of the waits on raw ids: the caller did not say which buffers the
# op uses, so a wait a signal handler interrupts first waits for the op to complete (the
# caller's buffers may die with its frame), then raises. ``None``: the op uses no buffers.
UNKNOWN_BUFFERS = object()

_wait_release_one_for = lib.shvd_wait_release_one_for
_wait_release_for = lib.shvd_wait_release_for
_wait_for = lib.shvd_wait_for


def _id_array(ids):
    return (ctypes.c_int64 * len(ids))(*ids)


def _interrupted(ids, keepalive, wait_again):
    """A signal handler raised while waiting for ``ids`` (the caller re-raises it)."""
    if keepalive is UNKNOWN_BUFFERS:
        while True:
            try:
                if wait_again() != 1:
                    return
            except BaseException:  # noqa: BLE001 - a further signal: the op must finish first
                pass
    _adopt(ids, keepalive)


def _await(id_array, n):
    """Waits (in slices) until every op of ``id_array`` completed, without releasing them.
    A signal handler's exception propagates with the ops in flight."""
    while _wait_for(id_array, n, _SLICE) == 1:
        pass


def wait(handle_id, keepalive=UNKNOWN_BUFFERS):
    """Blocks until the op completes; raises its error. The handle is released either way.
    ``keepalive``: the buffers the op uses (see :data:`UNKNOWN_BUFFERS`)."""
    try:
        rc = _wait_release_one_for(handle_id, _SLICE)
        while rc == 1:
            rc = _wait_release_one_for(handle_id, _SLICE)
    except BaseException:
        _interrupted((handle_id,), keepalive,
                     lambda: _wait_release_one_for(handle_id, _SLICE))
        raise
    if rc == -1:
        raise_last_error()


def wait_all(handle_ids, keepalive=UNKNOWN_BUFFERS):
    """Waits for (and releases) every handle; raises the first error. ``keepalive`` as in
    :func:`wait`."""
    n = len(handle_ids)
    if not n:
        return
    ids = _id_array(handle_ids)
    try:
        rc = _wait_release_for(ids, n, _SLICE)
        while rc == 1:
            rc = _wait_release_for(ids, n, _SLICE)
    except BaseException:
        _interrupted(handle_ids, keepalive, lambda: _wait_release_for(ids, n, _SLICE))
        raise
    if rc == -1:
        raise_last_error()


def wait_done(handle_ids, keepalive=UNKNOWN_BUFFERS):
    """Waits until every op completed, releasing nothing (their results are read next).
    ``keepalive`` as in :func:`wait`."""
    n = len(handle_ids)
    if not n:
        return
    ids = _id_array(handle_ids)
    try:
        _await(ids, n)
    except BaseException:
        _interrupted(handle_ids, keepalive, lambda: _wait_for(ids, n, _SLICE))
        raise


def wait_output(handle_id, keepalive=UNKNOWN_BUFFERS):
    """Waits, then returns (bytes of the core-allocated result, shape, ints) and releases.
    ``keepalive`` as in :func:`wait`."""
    wait_done((handle_id,), keepalive)
    try:
        check(lib.shvd_wait(handle_id))  # completed: returns at once, with the op's error
        ptr, nbytes = ctypes.c_void_p(), ctypes.c_int64()
        check(lib.shvd_output(handle_id, ctypes.byref(ptr), ctypes.byref(nbytes)))
        data = ctypes.string_at(ptr, nbytes.value) if nbytes.value else b""
        shape_buf = (ctypes.c_int64 * 32)()
        ndim = check(lib.shvd_output_shape(handle_id, shape_buf, 32))
        ints_buf = (ctypes.c_int64 * 4096)()
        nints = check(lib.shvd_output_ints(handle_id, ints_buf, 4096))
        return data, tuple(shape_buf[:ndim]), list(ints_buf[:nints])
    finally:
        lib.shvd_release(handle_id)


def wait_ints(handle_id, keepalive=UNKNOWN_BUFFERS):
    return wait_output(handle_id, keepalive)[2]


class ResultHandle:
    """A pending collective on one tensor whose result is known up front (in-place ops and
    preallocated outputs): the per-tensor hot path, without the closure a :class:`Handle`
    needs. Same interface as :class:`Handle`. ``result`` is kept alive with ``keepalive``
    until the op completed, even when the handle is dropped first."""

    __slots__ = ("_id", "_result", "_keepalive", "_error")

    def __init__(self, handle_id, result, keepalive=None):
        self._id = handle_id
        self._result = result
        self._keepalive = keepalive  # buffers the core reads or writes until completion
        self._error = None

    def poll(self):
        """True once the op has finished (successfully or not)."""
        return self._id is None or poll(self._id)

    def wait(self):
        """Blocks until the op finished; returns its result or raises its error. A signal
        handler's exception propagates with the op still in flight (wait again later)."""
        handle_id = self._id
        if handle_id is not None:
            rc = _wait_release_one_for(handle_id, _SLICE)
            while rc == 1:
                rc = _wait_release_one_for(handle_id, _SLICE)
            self._id = None
            self._keepalive = None  # only now: the core used these buffers until completion
            if rc == -1:
                try:
                    raise_last_error()
                except BaseException as e:
                    self._error = e
        if self._error is not None:
            raise self._error
        return self._result

    def __del__(self):
        if self._id is not None:  # dropped before its op completed
            _adopt((self._id,), (self._keepalive, self._result))


class Handle:
    """A pending collective: ``poll()`` says whether it finished, ``wait()`` returns its result.

    ``finish`` turns the completed native ops into the user-facing result (for example copying
    a core-allocated allgather result into a new array); it runs once, after every op completed,
    and a failure is raised again by every later ``wait()``. ``keepalive`` holds every buffer
    the core reads or writes; it is kept until the ops completed, even when the handle is
    dropped first.
    """

    __slots__ = ("_ids", "_finish", "_keepalive", "_done", "_result", "_error")

    def __init__(self, ids, finish, keepalive=None):
        self._ids = ids
        self._finish = finish
        self._keepalive = keepalive
        self._done = False
        self._result = None
        self._error = None

    def poll(self):
        """True once the op has finished (successfully or not)."""
        return self._done or all(poll(h) for h in self._ids)

    def wait(self):
        """Blocks until the op finished; returns its result or raises its error. A signal
        handler's exception propagates with the ops still in flight (wait again later)."""
        if not self._done:
            if self._ids:
                _await(_id_array(self._ids), len(self._ids))
            try:
                self._result = self._finish(self._ids)
            except BaseException as e:
                self._error = e
            finally:
                self._done = True
                self._keepalive = None
        if self._error is not None:
            raise self._error
        return self._result

    def __del__(self):
        if not self._done and self._ids:  # dropped before its ops completed
            _adopt(self._ids, self._keepalive)
