"""MPI as the data path of CPU collectives (``HOROVOD_CPU_OPERATIONS=MPI``).

The native core moves collectives' data over its own TCP/shared-memory transport. In a job
bootstrapped through MPI (``mpirun``, or ``init(comm=...)`` with an mpi4py communicator or a list
of ``MPI_COMM_WORLD`` ranks), ``HOROVOD_CPU_OPERATIONS=MPI`` makes it run allreduce, allgather,
broadcast, alltoall and reducescatter through MPI instead, on a communicator of each process
set's members; negotiation stays the core's own. The MPI calls live in a plugin that the core
loads at init, using the libmpi mpi4py already loaded and initialised: one per MPI ABI
(``_core/libspark_hvd_mpi_openmpi.so`` for Open MPI's libmpi.so.40,
``_core/libspark_hvd_mpi_mpich.so`` for MPICH's libmpich.so.12), built where that MPI's headers
are installed, and chosen by the MPI that mpi4py loaded, as mpi4py's wheels do.

Here: whether the plugin is built and loads (``mpi_built()``), the checks before init (every
rank asks for the same thing, MPI can take calls from the core's thread), the options the core
gets, ``init(comm=[ranks])``'s communicator, and the plugin's counters (tests prove with them
that data went through MPI).
"""

import ctypes
import functools
import os

from . import _bootstrap_contract as contract
from . import _config

# shvd_init_options.cpu_operations (SHVD_CPU_OPERATIONS_* of spark_hvd.h).
_NATIVE_CODES = {_config.CPU_OPERATIONS_DEFAULT: 0, _config.CPU_OPERATIONS_MPI: 1}
PLUGIN_PATTERN = "libspark_hvd_mpi_{abi}.so"
ABIS = ("openmpi", "mpich")
COUNT_NAMES = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")

# Whether the running job's CPU collectives go through MPI, and MPI's thread level then
# (mpi4py's MPI.THREAD_* value); set by options_for_init, cleared by stopped().
_state = {"enabled": False, "thread_level": None, "comm": None}


def mpi_abi():
    """"openmpi" or "mpich": the ABI of the MPI that mpi4py loads (Intel MPI and MVAPICH are
    MPICH's), or None when mpi4py is not importable or names another MPI."""
    try:
        from mpi4py import MPI
        version = MPI.Get_library_version()
    except Exception:  # no mpi4py, or no MPI library for it
        return None
    if "Open MPI" in version:
        return "openmpi"
    if any(name in version for name in ("MPICH", "Intel(R) MPI", "MVAPICH")):
        return "mpich"
    return None


def plugin_path(abi=None):
    """Where build.py puts the plugin for ``abi`` (default: mpi4py's MPI's; Open MPI's when
    that is unknown): next to the core."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(here, "_core", PLUGIN_PATTERN.format(abi=abi or mpi_abi() or ABIS[0]))


@functools.lru_cache(maxsize=None)
def _plugin():
    """The plugin loaded with ctypes (the same object the core dlopens), or the reason it
    cannot be: (library or None, reason or None)."""
    path = plugin_path()
    if not os.path.exists(path):
        return None, (f"spark_hvd's MPI plugin is not built ({path} is missing: build.py builds "
                      "one per MPI whose headers are installed, e.g. Debian's libopenmpi-dev or "
                      "libmpich-dev)")
    try:
        lib = ctypes.CDLL(path)
        lib.shvd_mpi_plugin_counts.restype = ctypes.c_int32
        lib.shvd_mpi_plugin_counts.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int32]
    except (OSError, AttributeError) as e:
        return None, f"spark_hvd's MPI plugin {path} does not load: {e}"
    return lib, None


def plugin_built():
    """True when the MPI plugin was built and loads (``mpi_built()``)."""
    return _plugin()[0] is not None


def plugin_problem():
    """Why the plugin cannot be used (None when it can)."""
    return _plugin()[1]


def enabled():
    """True while the running job's CPU collectives go through MPI (``mpi_enabled()``)."""
    return _state["enabled"]


def threads_supported():
    """True when MPI runs at MPI_THREAD_MULTIPLE in a job whose collectives go through MPI."""
    from mpi4py import MPI
    return _state["thread_level"] == MPI.THREAD_MULTIPLE


def collective_counts():
    """Collectives this process ran through MPI, by kind (``COUNT_NAMES``), since it started;
    all zero when the plugin is not built."""
    lib = _plugin()[0]
    if lib is None:
        return dict.fromkeys(COUNT_NAMES, 0)
    out = (ctypes.c_int64 * len(COUNT_NAMES))()
    lib.shvd_mpi_plugin_counts(out, len(COUNT_NAMES))
    return dict(zip(COUNT_NAMES, out))


def comm_from_ranks(ranks):
    """``init(comm=[ranks])`` as Horovod has it: the communicator of those ranks of
    ``MPI_COMM_WORLD``, in that order (rank i of the job is ``ranks[i]``). Collective over
    those ranks only; a process not among them gets a ValueError."""
    try:
        ranks = [int(r) for r in ranks]
    except (TypeError, ValueError):
        raise ValueError(f"init(comm={ranks!r}): a list of MPI_COMM_WORLD ranks was expected") \
            from None
    try:
        from mpi4py import MPI
    except ImportError:
        raise ValueError("init(comm=[ranks]) names ranks of MPI_COMM_WORLD and needs mpi4py "
                         "in a job started by mpirun") from None
    world = MPI.COMM_WORLD
    bad = [r for r in ranks if not 0 <= r < world.Get_size()]
    if not ranks or bad or len(set(ranks)) != len(ranks):
        raise ValueError(f"init(comm={ranks}): expected distinct ranks of MPI_COMM_WORLD "
                         f"(0..{world.Get_size() - 1})")
    if world.Get_rank() not in ranks:
        raise ValueError(f"init(comm={ranks}): this process is rank {world.Get_rank()} of "
                         "MPI_COMM_WORLD, not one of them; only those ranks call init with it")
    group = world.Get_group().Incl(ranks)
    try:
        return world.Create_group(group)
    finally:
        group.Free()


def options_for_init(config, comm):
    """The MPI backend's fields of the core's init options, for a job whose rendezvous is the
    mpi4py communicator ``comm`` (None: not bootstrapped through MPI). Every rank of ``comm``
    calls it: they agree on ``CPU_OPERATIONS`` and on what MPI operations need, or each raises
    the same error. Raises ValueError for MPI operations outside an MPI job."""
    wanted = config.cpu_operations
    if comm is None:
        if wanted == _config.CPU_OPERATIONS_MPI:
            raise ValueError(
                f"{contract.set_name('CPU_OPERATIONS')}=MPI needs a job bootstrapped "
                "through MPI (started by mpirun, or init(comm=...) with an mpi4py communicator "
                "or a list of MPI_COMM_WORLD ranks); unset it to use spark_hvd's own transport")
        return _native_options(_config.CPU_OPERATIONS_DEFAULT, None)
    problem = None
    level = None
    if wanted == _config.CPU_OPERATIONS_MPI:
        from mpi4py import MPI
        level = MPI.Query_thread()
        problem = _plugin()[1]
        if problem is None and level not in (MPI.THREAD_MULTIPLE, MPI.THREAD_SERIALIZED):
            names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
                     MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED"}
            problem = (f"MPI was initialised with {names.get(level, level)}, but MPI operations "
                       "run on spark_hvd's background thread and need MPI_THREAD_MULTIPLE (or "
                       "SERIALIZED): leave mpi4py.rc.thread_level at 'multiple' (its default) "
                       "before importing mpi4py.MPI")
    answers = comm.allgather((wanted, problem))
    choices = {a[0] for a in answers}
    if len(choices) > 1:
        by_rank = ", ".join(f"rank {r}: {a[0]}" for r, a in enumerate(answers))
        raise ValueError("HOROVOD_CPU_OPERATIONS differs between ranks "
                         f"({by_rank}); set it alike on every rank (mpirun -x passes it on)")
    problems = [(r, a[1]) for r, a in enumerate(answers) if a[1]]
    if problems:
        rank, why = problems[0]
        raise RuntimeError(f"HOROVOD_CPU_OPERATIONS=MPI: rank {rank}: {why}")
    if wanted == _config.CPU_OPERATIONS_MPI:
        _state.update(thread_level=level, comm=comm)
    return _native_options(wanted, comm)


def _native_options(wanted, comm):
    return {"cpu_operations": _NATIVE_CODES[wanted],
            "mpi_comm": comm.py2f() if comm is not None and
            wanted == _config.CPU_OPERATIONS_MPI else 0,
            "mpi_plugin": plugin_path().encode() if wanted == _config.CPU_OPERATIONS_MPI
            else b""}


def started(options):
    """The core initialised with ``options`` (from options_for_init)."""
    _state["enabled"] = options["cpu_operations"] == _NATIVE_CODES[_config.CPU_OPERATIONS_MPI]


def stopped():
    """The core shut down: MPI operations are no longer in use."""
    _state.update(enabled=False, thread_level=None, comm=None)
