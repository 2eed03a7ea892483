"""Process sets: subsets of ranks that run collectives among themselves.

Horovod's semantics: static sets are given to ``init(process_sets=...)``; with
``init(process_sets="dynamic")`` or ``SPARK_HVD_DYNAMIC_PROCESS_SETS=1`` every rank may call
:func:`add_process_set` / :func:`remove_process_set` collectively at run time. Every op takes
``process_set=``.

Layering: this module uses ``_native`` and ``_ops`` and never ``basics``; ``basics.init()``
hands it the static sets, the job's size and the configuration (:func:`_started`) and
``basics.shutdown()`` forgets them (:func:`_stopped`).
"""

import ctypes
import itertools

from . import _ops
from ._native import OP_ADD_PROCESS_SET, OP_REMOVE_PROCESS_SET, check, lib, require_init


class ProcessSet:
    """A set of global ranks. ``process_set_id`` is assigned when the set is registered."""

    def __init__(self, ranks_or_comm):
        self.mpi_comm = None  # Horovod's attribute: the communicator the set was made from
        if hasattr(ranks_or_comm, "Get_group"):  # an mpi4py communicator
            self.mpi_comm = ranks_or_comm
            world = ranks_or_comm.Get_group()
            from mpi4py import MPI
            ranks = MPI.Group.Translate_ranks(world, range(world.Get_size()),
                                              MPI.COMM_WORLD.Get_group())
        else:
            ranks = ranks_or_comm
        self.ranks = sorted(int(r) for r in ranks)
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"process set ranks {list(ranks_or_comm)} contain duplicates")
        self.process_set_id = None

    def _require_registered(self):
        require_init()
        if self.process_set_id is None:
            raise ValueError(f"{self!r} is not registered: pass it to init(process_sets=...) or "
                             "add_process_set()")

    def size(self):
        """Number of ranks in the set."""
        self._require_registered()
        return check(lib.shvd_process_set_size(self.process_set_id))

    def rank(self):
        """This process's rank within the set, or -1 if it is not a member."""
        self._require_registered()
        mine = _my_rank()
        return self.ranks.index(mine) if mine in self.ranks else -1

    def included(self):
        """True if this process is a member."""
        self._require_registered()
        return _my_rank() in self.ranks

    def __eq__(self, other):
        return isinstance(other, ProcessSet) and self.ranks == other.ranks and \
            self.process_set_id == other.process_set_id

    def __hash__(self):
        return hash((tuple(self.ranks), self.process_set_id))

    def __repr__(self):
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")  # Horovod's form


def _my_rank():
    return check(lib.shvd_rank())


class _GlobalProcessSet(ProcessSet):
    def __init__(self):
        self.ranks = []  # every rank of the job while initialized
        self.process_set_id = 0
        self.mpi_comm = None


global_process_set = _GlobalProcessSet()
_registered = {}
# The engine configuration of the running job (basics.init's Config); None when not running.
_job = {"config": None}


def _static_ranks(process_sets):
    sets = list(process_sets or [])
    out = []
    for ps in sets:
        ranks = ps.ranks if isinstance(ps, ProcessSet) else sorted(ps)
        if ranks in out:
            raise ValueError(f"process set {ranks} is given twice in init(process_sets=...)")
        out.append(ranks)
    return out


def _started(process_sets, size, config):
    """Called by ``basics.init()`` once the core runs a job of ``size`` ranks: the global set
    covers them, and the :class:`ProcessSet` objects among the static ``process_sets`` get
    their ids (the core numbered the static sets 1, 2, ... in order)."""
    global_process_set.ranks = list(range(size))
    _job["config"] = config
    for i, ps in enumerate(process_sets or [], start=1):
        if not isinstance(ps, ProcessSet):
            continue
        bad = [r for r in ps.ranks if not 0 <= r < size]
        if bad:
            raise ValueError(f"process set {ps.ranks} names ranks {bad} outside [0, {size})")
        ps.process_set_id = i
        _registered[i] = ps


def _stopped():
    """Called by ``basics.shutdown()``: every registered set is unregistered."""
    for ps in _registered.values():
        ps.process_set_id = None
    _registered.clear()
    global_process_set.ranks = []
    _job["config"] = None


def process_set_id(process_set):
    """The native id for ``process_set`` (None means the global set)."""
    if process_set is None or process_set is global_process_set:
        return 0  # the hot path: no checks needed for the global set
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")
    process_set._require_registered()
    return process_set.process_set_id


_dynamic_counter = itertools.count()


def _negotiate(op, ranks=(), set_id=0):
    require_init()
    if not _job["config"].dynamic_process_sets:
        raise ValueError("dynamic process sets are disabled: call init(process_sets='dynamic') "
                         "or set SPARK_HVD_DYNAMIC_PROCESS_SETS=1 (or "
                         "HOROVOD_DYNAMIC_PROCESS_SETS=1) before init() to add or remove "
                         "process sets at run time")
    name = f"__process_set__.{next(_dynamic_counter)}"
    handle = _ops.enqueue_one(op, name, 0, (), None, None, splits=tuple(ranks),
                              root_rank=set_id)
    return _ops.wait_ints(handle, keepalive=None)[0]  # no buffers: a signal interrupts at once


def add_process_set(process_set):
    """Registers a new process set on every rank (a collective: all ranks must call it in the
    same order). Returns the registered :class:`ProcessSet`."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps!r} is already registered")
    require_init()
    size = check(lib.shvd_size())
    bad = [r for r in ps.ranks if not 0 <= r < size]
    if bad:
        raise ValueError(f"process set {ps.ranks} names ranks {bad} outside [0, {size})")
    ranks_arr = (ctypes.c_int32 * max(1, len(ps.ranks)))(*ps.ranks)
    if lib.shvd_process_set_find(ranks_arr, len(ps.ranks)) >= 0:
        raise ValueError(f"a process set with ranks {ps.ranks} already exists")
    ps.process_set_id = _negotiate(OP_ADD_PROCESS_SET, ranks=ps.ranks)
    _registered[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set):
    """Unregisters ``process_set`` on every rank (collective). Returns True if it existed."""
    if not isinstance(process_set, ProcessSet) or process_set.process_set_id in (None, 0):
        return False
    set_id = process_set.process_set_id
    _negotiate(OP_REMOVE_PROCESS_SET, set_id=set_id)
    _registered.pop(set_id, None)
    process_set.process_set_id = None
    return True
