"""Job lifecycle and topology queries shared by every framework adapter
(``spark_hvd.torch``, ``spark_hvd.tensorflow``, ``spark_hvd.keras``, ``spark_hvd.numpy``).

The top of ``spark_hvd.common``'s layering (``_native`` <- ``_ops`` <- ``process_sets`` <-
``basics``): :func:`init` and :func:`shutdown` start and stop the layers below, which never
import this module.
"""

import atexit
import ctypes
import shutil
import threading

from . import _bootstrap, _config, _elastic_agent, _mpi, _ops
from . import process_sets as _process_sets
from ._native import check, lib, require_init

_lock = threading.Lock()
# "process_sets": the static sets of the process's first init(), which every re-init of an
# elastic job registers again (those whose ranks all exist in the new round).
_state = {"generation": 0, "config": None, "placement": None, "process_sets": None}


def init(comm=None, process_sets=None):
    """Starts spark_hvd in this process and connects it to the other ranks of the job.

    Args:
        comm: optional mpi4py communicator whose processes form the job, or (as in Horovod)
            a list of ``MPI_COMM_WORLD`` ranks whose communicator does (only those ranks call
            ``init``); by default the job is described by the environment set by
            ``spark-hvd-run``, ``mpirun`` or ``spark_hvd.spark.run``, and a process started on
            its own is a job of size 1. With ``HOROVOD_CPU_OPERATIONS=MPI`` the CPU
            collectives of a job bootstrapped through MPI move their data through MPI.
        process_sets: static process sets (:class:`ProcessSet` objects or lists of ranks) that
            are registered on every rank, in order; or ``"dynamic"`` (Horovod's value) to
            allow :func:`add_process_set` / :func:`remove_process_set` at run time, as
            ``SPARK_HVD_DYNAMIC_PROCESS_SETS=1`` (or ``HOROVOD_DYNAMIC_PROCESS_SETS=1``) does.

    Calling ``init`` again after :func:`shutdown` starts a fresh job connection. In an elastic
    job (started by ``spark-hvd-run --min-np/--host-discovery-script`` or ``spark_hvd.run(...,
    min_num_proc=...)``) ``init`` joins the driver's next round instead: rank and size are the
    round's, and the static process sets of the first ``init`` are registered again (those
    whose ranks all exist in the round; a set naming a rank beyond the new size stays
    unregistered and raises when used).
    """
    with _lock:
        if lib.shvd_is_initialized():
            return
        config = _config.Config()
        if comm is not None and isinstance(comm, (list, tuple)):
            comm = _mpi.comm_from_ranks(comm)
        if isinstance(process_sets, str):
            if process_sets != "dynamic":
                raise ValueError(f"init(process_sets={process_sets!r}): pass 'dynamic' or a "
                                 "list of process sets")
            config.dynamic_process_sets = True
            process_sets = None
        if _state["process_sets"] is None or process_sets is not None:
            _state["process_sets"] = list(process_sets or [])
        if comm is None and _elastic_agent.active():
            process_sets = _state["process_sets"]

            def sets_for_size(size):
                return [ranks for ranks in _process_sets._static_ranks(process_sets)
                        if max(ranks, default=-1) < size]

            placement, static = _elastic_agent.get().start_round(config, sets_for_size)
            process_sets = [ps for ps in process_sets
                            if max(getattr(ps, "ranks", ps), default=-1) < placement.size]
        else:
            static = _process_sets._static_ranks(process_sets)
            placement = _bootstrap.start(config, comm=comm, process_sets=static,
                                         generation=_state["generation"])
        _state.update(generation=_state["generation"] + 1, config=config, placement=placement)
        _ops.reset_auto_names()
        _process_sets._started(process_sets, placement.size, config)
        _config.logger.debug("initialized rank %d of %d (local rank %s of %s, cross rank %s of "
                             "%s)", placement.rank, placement.size, placement.local_rank,
                             placement.local_size, placement.cross_rank, placement.cross_size)


def shutdown():
    """Stops the engine after every rank called shutdown (pending ops on other ranks fail)."""
    with _lock:
        lib.shvd_shutdown()
        # Only now, with the engine stopped, may the buffers of ops whose handles were dropped
        # go (ops still in flight failed with "shut down before this collective completed").
        _ops.drop_orphans()
        _process_sets._stopped()
        _mpi.stopped()
        agent = _elastic_agent.get_or_none()
        if agent is not None:
            agent.ended_round()


def _elastic_reset():
    """What ``hvd.elastic.run`` does between rounds: stop this round's core and join the
    next (in an elastic job; elsewhere a plain re-init of the same job)."""
    shutdown()
    init()


atexit.register(shutdown)


def generation():
    """How many times this process called ``init()`` successfully: what a framework object
    compares to tell work of an earlier core (before an elastic reset) from the current."""
    return _state["generation"]


def is_initialized():
    """True between :func:`init` and :func:`shutdown`."""
    return bool(lib.shvd_is_initialized())


_require_init = require_init  # the name used here and by _horovod_basics


def _query(fn):
    _require_init()
    return check(fn())


def rank():
    """This process's rank in the job, 0 .. size()-1."""
    return _query(lib.shvd_rank)


def size():
    """Number of processes in the job."""
    return _query(lib.shvd_size)


def local_rank():
    """Rank among the processes on this host (use it to pick this process's GPU)."""
    return _query(lib.shvd_local_rank)


def local_size():
    """Number of processes on this host."""
    return _query(lib.shvd_local_size)


def cross_rank():
    """Index of this host among the job's hosts."""
    return _query(lib.shvd_cross_rank)


def cross_size():
    """Number of hosts in the job."""
    return _query(lib.shvd_cross_size)


def is_homogeneous():
    """True when every host runs the same number of processes."""
    _require_init()
    return size() == local_size() * cross_size()


def config():
    """The engine configuration read from the environment at init (None before init)."""
    return _state["config"]


# Build and transport queries. "gloo" is Horovod's name for its MPI-free controller; our
# TCP/shared-memory transport answers for it so scripts that branch on it keep working.

def tcp_built():
    """The embedded TCP transport is always built."""
    return True


def shared_memory_enabled():
    """True when this rank exchanges data with same-host peers over shared memory."""
    _require_init()
    return bool(lib.shvd_shared_memory_enabled())


_TUNED_FIELDS = ("generation", "fusion_threshold", "cycle_time_ms", "cache_enabled",
                 "hierarchical_allreduce", "hierarchical_allgather", "tuning")


def tuned_parameters():
    """The run-time settings this rank's latest collective ran with, as a dict:
    ``fusion_threshold`` (bytes), ``cycle_time_ms``, ``cache_enabled``,
    ``hierarchical_allreduce`` / ``hierarchical_allgather`` (-1: chosen per collective, 0 off,
    1 on), ``tuning`` (autotuning still samples) and ``generation`` (how many settings the
    autotuner had applied by then; 0: the configured ones). Every rank switches at the same
    collective, so ranks that read this after the same step read the same values."""
    _require_init()
    out = (ctypes.c_double * len(_TUNED_FIELDS))()
    check(lib.shvd_tuned_parameters(out, len(_TUNED_FIELDS)))
    values = dict(zip(_TUNED_FIELDS, out))
    for key in ("generation", "fusion_threshold", "hierarchical_allreduce",
                "hierarchical_allgather"):
        values[key] = int(values[key])
    values["cache_enabled"] = bool(values["cache_enabled"])
    values["tuning"] = bool(values["tuning"])
    return values


def gloo_built():
    """True: the embedded TCP/shared-memory transport (Horovod's "gloo" slot) is always built."""
    return True


def gloo_enabled():
    """True while initialized: every job uses the embedded transport."""
    return is_initialized()


def mpi_built():
    """True when spark_hvd's MPI plugin was built (where MPI's headers were installed) and
    loads: CPU collectives can then run through MPI (``HOROVOD_CPU_OPERATIONS=MPI``)."""
    return _mpi.plugin_built()


def mpi_enabled():
    """True while this job's CPU collectives move their data through MPI
    (``HOROVOD_CPU_OPERATIONS=MPI`` in a job bootstrapped through MPI); negotiation is always
    spark_hvd's own. False before init and with the default transport."""
    return is_initialized() and _mpi.enabled()


def mpi_threads_supported():
    """Whether MPI runs at MPI_THREAD_MULTIPLE, so that the script may make MPI calls of its
    own (mpi4py) while spark_hvd's collectives run through MPI. As in Horovod, a ValueError
    unless :func:`mpi_enabled`."""
    if not mpi_enabled():
        raise ValueError("spark_hvd's MPI operations are not enabled (HOROVOD_CPU_OPERATIONS="
                         "MPI in a job started by mpirun or init(comm=...))")
    return _mpi.threads_supported()


def nccl_built():
    """True when the core can run collectives of CUDA tensors through NCCL in this process:
    the CUDA runtime and NCCL (2.7 or later) were found and loaded (see
    ``spark_hvd.common._gpu`` for where they are looked for). Needs no GPU to be True."""
    from . import _gpu
    return _gpu.status() == 2


def ddl_built():
    """False: IBM DDL is not supported."""
    return False


def ccl_built():
    """False: oneCCL is not supported."""
    return False


def cuda_built():
    """True when the core takes CUDA tensors itself (the CUDA runtime was found): they are
    reduced through NCCL where :func:`nccl_built`, else through host memory by the core."""
    from . import _gpu
    return _gpu.status() >= 1


def gpu_counters():
    """What the GPU path did in this process: ``nccl_collectives`` (collectives run through
    NCCL), ``host_staged_bytes`` (bytes of CUDA tensors copied through host memory),
    ``nccl_version`` (0: no NCCL) and ``nccl_hierarchical_allreduces`` (those allreduces that ran
    hierarchically: NCCL within each host, across hosts, within the host again)."""
    from . import _gpu
    return _gpu.counters()


def rocm_built():
    """False: the core has no ROCm-aware transport in this build."""
    return False


def mpirun_available():
    """True when an ``mpirun`` executable is on PATH."""
    return shutil.which("mpirun") is not None


def start_timeline(file_path, mark_cycles=False):
    """Starts writing a Chrome trace of every tensor's phases to ``file_path`` (rank 0 writes it;
    open it in chrome://tracing or https://ui.perfetto.dev); ``mark_cycles`` adds a marker at
    the start of every engine cycle.

    Every rank calls it. ``SPARK_HVD_TIMELINE=DYNAMIC`` (or ``HOROVOD_TIMELINE=DYNAMIC``) starts
    the job without a timeline for this function to start later; unlike Horovod, it also works
    without that setting, and while a timeline runs it closes that one and starts the new file.
    """
    _require_init()
    check(lib.shvd_start_timeline(str(file_path).encode(), 1 if mark_cycles else 0))


def stop_timeline():
    """Stops the timeline started by :func:`start_timeline` or ``SPARK_HVD_TIMELINE`` and
    closes its file (a valid JSON trace); stopping when none runs does nothing.

    The trace is rank 0's view: requests other ranks send before rank 0 stops are recorded,
    so follow it with a ``barrier()`` when later ops must be left out."""
    _require_init()
    check(lib.shvd_stop_timeline())
