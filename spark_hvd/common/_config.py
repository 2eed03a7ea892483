"""Configuration from the environment. Every ``SPARK_HVD_*`` variable also accepts Horovod's
``HOROVOD_*`` name so existing job configs keep working; ours wins when both are set.

:data:`HOROVOD_VARIABLES` lists every ``HOROVOD_*`` variable Horovod 0.28.1 documents and what
spark_hvd does with it; :func:`warn_unsupported_env` (run by ``init()``) warns once per process
about each one that is set but not implemented, so none is silently ignored.
"""

import logging
import os
import sys

from . import _bootstrap_contract as contract

DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024
# 25 s + the last probe tick (< 1 s) + the abort stays within the 30 s bound the docs promise.
DEFAULT_PEER_TIMEOUT_SECONDS = 25.0
# Long enough that a thread about to submit the op another rank waits for is not mistaken for a
# deadlock; short next to the stall inspector's 60 s (native/controller/deadlock.h).
DEFAULT_DEADLOCK_CHECK_SECONDS = 2.0
# The stall inspector's shutdown time in elastic jobs (README "Elastic training").
DEFAULT_ELASTIC_STALL_SHUTDOWN_SECONDS = 60.0


def env(name, default=None):
    """Value of ``SPARK_HVD_<name>``, else ``HOROVOD_<name>``, else ``default``."""
    value = contract.setting(name)
    return default if value is None else value


def env_float(name, default):
    value = env(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"SPARK_HVD_{name}={value!r} is not a number") from None


def env_int(name, default):
    value = env_float(name, default)
    return None if value is None else int(value)  # default None: "not set"


def env_flag(name, default=False):
    value = env(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def env_switch(name):
    """1 or 0 for a flag set true or false, -1 (automatic) when it is not set."""
    return -1 if env(name) is None else int(env_flag(name))


# SPARK_HVD_OVERLAP: run collectives while the training thread still submits (1), or collect a
# step's ops until a result is awaited (0, best when ranks outnumber half the CPUs), or decide
# from the host (auto).
_OVERLAP = {"auto": -1, "1": 1, "true": 1, "on": 1, "yes": 1, "0": 0, "false": 0, "off": 0,
            "no": 0}


_SHARED_GPU = {"host": 0, "": 0, "nccl": 1}


# HOROVOD_CPU_OPERATIONS, with Horovod's values in any case (it compares them with
# strcasecmp): MPI moves CPU collectives' data through MPI (a job bootstrapped through MPI
# only, see _mpi), gloo, Horovod's MPI-free one, is spark_hvd's own transport (the default).
CPU_OPERATIONS_DEFAULT, CPU_OPERATIONS_MPI = "default", "mpi"
_CPU_OPERATIONS = {"gloo": CPU_OPERATIONS_DEFAULT, "mpi": CPU_OPERATIONS_MPI}


def cpu_operations():
    """``CPU_OPERATIONS`` as :data:`CPU_OPERATIONS_DEFAULT` or :data:`CPU_OPERATIONS_MPI`;
    ValueError for a value Horovod does not know or spark_hvd does not do (CCL)."""
    value = env("CPU_OPERATIONS")
    if value is None or not value.strip():
        return CPU_OPERATIONS_DEFAULT
    key = value.strip().lower()
    name = contract.set_name("CPU_OPERATIONS")
    if key == "ccl":
        raise ValueError(f"{name}={value}: oneCCL is not supported; use MPI (collectives "
                         "through MPI, in jobs started by mpirun or init(comm=...)) or gloo "
                         "(spark_hvd's own transport, the default)")
    if key not in _CPU_OPERATIONS:
        raise ValueError(f"{name}={value!r} is not a CPU operations backend: use MPI "
                         "(collectives through MPI, in jobs started by mpirun or "
                         "init(comm=...)) or gloo (spark_hvd's own transport, the default)")
    return _CPU_OPERATIONS[key]


class Config:
    """Engine settings read once at ``init()``."""

    def __init__(self):
        configure_logging()
        warn_unsupported_env()
        self.fusion_threshold = env_int("FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD)
        self.cycle_time_ms = env_float("CYCLE_TIME", 0.5)
        self.cache_capacity = env_int("CACHE_CAPACITY", 1024)
        if env_flag("STALL_CHECK_DISABLE"):
            self.stall_warning_seconds = 0.0
        else:
            self.stall_warning_seconds = env_float("STALL_CHECK_TIME_SECONDS", 60.0)
        # Elastic jobs end a stall (a frozen rank) by default, so the driver can re-form without
        # it: off elsewhere, as in Horovod.
        self.stall_shutdown_seconds = env_float(
            "STALL_SHUTDOWN_TIME_SECONDS",
            DEFAULT_ELASTIC_STALL_SHUTDOWN_SECONDS if env_flag("ELASTIC") else 0.0)
        # Every rank blocked this long in collectives none can complete ends the job (0: off).
        self.deadlock_check_seconds = env_float("DEADLOCK_CHECK_SECONDS",
                                                DEFAULT_DEADLOCK_CHECK_SECONDS)
        self.ring_threshold = env_int("RING_THRESHOLD", 0)
        timeline = env("TIMELINE", "")
        # DYNAMIC (Horovod's value): no timeline at start; start_timeline() / stop_timeline()
        # control it at run time.
        self.timeline_dynamic = timeline.strip().upper() == TIMELINE_DYNAMIC
        self.timeline = "" if self.timeline_dynamic else timeline
        self.timeline_mark_cycles = env_flag("TIMELINE_MARK_CYCLES")
        self.dynamic_process_sets = env_flag("DYNAMIC_PROCESS_SETS")
        # Hierarchical collectives on sets that span hosts: 1 forces them on, 0 off, unset -1
        # lets the core choose (see the README's "Hierarchical collectives").
        self.hierarchical_allreduce = env_switch("HIERARCHICAL_ALLREDUCE")
        self.hierarchical_allgather = env_switch("HIERARCHICAL_ALLGATHER")
        self.log_level = log_level()
        self.shared_memory = not env_flag("SHM_DISABLE")
        # Shared-memory allreduce tuning; 0 and None leave the core's defaults.
        self.shm_chunk_bytes = env_int("SHM_CHUNK_BYTES", 0)
        self.shm_single_copy = env_flag("SHM_SINGLE_COPY", True)
        self.shm_single_copy_min_bytes = env_int("SHM_SINGLE_COPY_MIN_BYTES", None)
        # Transport buffers: each direction of a shared-memory pipe (0: the core's 4 MiB), and
        # the TCP data sockets' send/receive buffers (None: the core's 4 MiB; 0: the kernel's
        # autotuning).
        self.shm_pipe_bytes = env_int("SHM_PIPE_BYTES", 0)
        # Cached allreduces agreed through shared memory when every rank shares one host.
        self.shm_negotiation = env_flag("SHM_NEGOTIATION", True)
        self.tcp_buffer_bytes = env_int("TCP_BUFFER_BYTES", None)
        # A peer host silent this long (down, or its link cut: no FIN, no RST ever comes) is
        # lost and every rank's ops fail; 0 leaves the kernel's defaults (minutes to hours).
        self.peer_timeout = env_float("PEER_TIMEOUT_SECONDS", DEFAULT_PEER_TIMEOUT_SECONDS)
        # Gradients in memory every local member maps, reduced in place (torch).
        self.shared_gradients = env_flag("SHARED_GRADIENTS", True)
        # Horovod's gloo timeout bounds its connection set-up, as our start timeout does.
        self.start_timeout = contract.start_timeout()
        overlap = str(env("OVERLAP", "auto")).strip().lower()
        if overlap not in _OVERLAP:
            raise ValueError(f"SPARK_HVD_OVERLAP must be auto, 1 or 0, got {overlap!r}")
        self.overlap = _OVERLAP[overlap]
        # Ranks of a set that share one GPU (NCCL refuses them): 0 host memory, 1 NCCL with a
        # host identity per rank (the core's SHVD_SHARED_GPU_* codes).
        shared_gpu = str(env("SHARED_GPU", "host")).strip()
        if shared_gpu.lower() not in _SHARED_GPU:
            raise ValueError(f"SPARK_HVD_SHARED_GPU={shared_gpu} is not a choice: use 'host' "
                             "(ranks sharing a GPU reduce CUDA tensors through host memory) or "
                             "'nccl' (through NCCL's network transport)")
        self.shared_gpu = _SHARED_GPU[shared_gpu.lower()]
        self.cpu_operations = cpu_operations()
        self._read_autotune()
        for name, value in (("FUSION_THRESHOLD", self.fusion_threshold),
                            ("CACHE_CAPACITY", self.cache_capacity),
                            ("SHM_CHUNK_BYTES", self.shm_chunk_bytes),
                            ("SHM_SINGLE_COPY_MIN_BYTES", self.shm_single_copy_min_bytes),
                            ("SHM_PIPE_BYTES", self.shm_pipe_bytes),
                            ("TCP_BUFFER_BYTES", self.tcp_buffer_bytes),
                            ("PEER_TIMEOUT_SECONDS", self.peer_timeout),
                            ("DEADLOCK_CHECK_SECONDS", self.deadlock_check_seconds)):
            if value is not None and value < 0:
                raise ValueError(f"SPARK_HVD_{name} must be >= 0, got {value}")
        if self.cycle_time_ms < 0:
            raise ValueError(f"SPARK_HVD_CYCLE_TIME must be >= 0 ms, got {self.cycle_time_ms}")

    def _read_autotune(self):
        """HOROVOD_AUTOTUNE and its settings (native/controller/autotune.h). A tunable setting
        the user gave explicitly is fixed, as in Horovod."""
        self.autotune = env_flag("AUTOTUNE")
        self.autotune_log = env("AUTOTUNE_LOG", "") or ""
        self.autotune_warmup_samples = env_int("AUTOTUNE_WARMUP_SAMPLES", 3)
        self.autotune_steps_per_sample = env_int("AUTOTUNE_STEPS_PER_SAMPLE", 10)
        self.autotune_bayes_opt_max_samples = env_int("AUTOTUNE_BAYES_OPT_MAX_SAMPLES", 20)
        self.autotune_gaussian_process_noise = env_float("AUTOTUNE_GAUSSIAN_PROCESS_NOISE", 0.8)
        self.autotune_fixed = [name for name in AUTOTUNE_FIXED_BITS if env(name) is not None]
        if not self.autotune:
            return
        for name in AUTOTUNE_BOUNDS:
            value = getattr(self, name.lower())
            bound = autotune_bound_broken(name, value)
            if bound:
                raise ValueError(f"{contract.set_name(name)} must be {bound}, got {value}")
        # Rank 0 writes the log; every rank checks its folder so that all fail alike.
        folder = os.path.dirname(os.path.abspath(self.autotune_log)) if self.autotune_log else ""
        if folder and not os.path.isdir(folder):
            raise ValueError(f"{contract.set_name('AUTOTUNE_LOG')}={self.autotune_log}: the "
                             f"folder {folder} does not exist")

    def autotune_fixed_bits(self):
        """The native core's bits for the settings autotuning leaves alone."""
        bits = 0
        for name in self.autotune_fixed:
            bits |= AUTOTUNE_FIXED_BITS[name]
        return bits


# The autotuner's own settings and the values it accepts ("op", bound), in the order they are
# checked: the one table for Config (SPARK_HVD_AUTOTUNE_*) and spark-hvd-run's --autotune-*
# flags (the setting's name in lower case is both Config's attribute and the flag's). The
# core takes them as validated (native/controller/autotune.h).
AUTOTUNE_BOUNDS = {"AUTOTUNE_WARMUP_SAMPLES": (">=", 0), "AUTOTUNE_STEPS_PER_SAMPLE": (">=", 1),
                   "AUTOTUNE_BAYES_OPT_MAX_SAMPLES": (">=", 1),
                   "AUTOTUNE_GAUSSIAN_PROCESS_NOISE": (">", 0)}


def autotune_bound_broken(name, value):
    """The bound of autotune setting ``name`` that ``value`` breaks (``">= 1"``), or None
    (NaN breaks every bound)."""
    op, bound = AUTOTUNE_BOUNDS[name]
    ok = value >= bound if op == ">=" else value > bound
    return None if ok else f"{op} {bound}"


# Settings autotuning would tune; one given explicitly stays fixed (SHVD_AUTOTUNE_FIX_* of
# native/include/spark_hvd.h).
AUTOTUNE_FIXED_BITS = {"FUSION_THRESHOLD": 1, "CYCLE_TIME": 2, "CACHE_CAPACITY": 4,
                       "HIERARCHICAL_ALLREDUCE": 8, "HIERARCHICAL_ALLGATHER": 16}

TIMELINE_DYNAMIC = "DYNAMIC"

# ---- logging ------------------------------------------------------------------------------------

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")  # Horovod's names
DEFAULT_LOG_LEVEL = "WARNING"
_PYTHON_LEVELS = {"TRACE": 5, "DEBUG": logging.DEBUG, "INFO": logging.INFO,
                  "WARNING": logging.WARNING, "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}
logger = logging.getLogger("spark_hvd")


def log_level():
    """``SPARK_HVD_LOG_LEVEL`` / ``HOROVOD_LOG_LEVEL`` (one of :data:`LOG_LEVELS`, any case;
    default WARNING). The native core reads the same variables."""
    value = str(env("LOG_LEVEL", DEFAULT_LOG_LEVEL)).strip().upper()
    if value not in LOG_LEVELS:
        _warn_once("LOG_LEVEL", f"SPARK_HVD_LOG_LEVEL / HOROVOD_LOG_LEVEL={value!r} is not one "
                   f"of {', '.join(LOG_LEVELS)}; using {DEFAULT_LOG_LEVEL}")
        return DEFAULT_LOG_LEVEL
    return value


def python_log_level(name):
    """The :mod:`logging` level of one of :data:`LOG_LEVELS`."""
    return _PYTHON_LEVELS[name]


def configure_logging():
    """Sets the ``spark_hvd`` logger's level from the environment. Unless the application gave
    that logger handlers of its own, its records go to stderr as ``spark_hvd LEVEL: message``
    (and not also to the root logger's handlers)."""
    logger.setLevel(_PYTHON_LEVELS[log_level()])
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("spark_hvd %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


_warned = set()


def _warn_once(key, message):
    if key in _warned:
        return
    _warned.add(key)
    if not logger.handlers:
        configure_logging()
    logger.warning(message)


# ---- Horovod's variables ----------------------------------------------------------------------

HONOURED = "honoured"
NO_EFFECT = "accepted, no effect"
WARNED = "warned"
BOOTSTRAP = "bootstrap"


class HorovodVariable:
    """What spark_hvd does with one ``HOROVOD_<name>`` variable.

    ``status``: HONOURED (read, also as ``SPARK_HVD_<name>``), NO_EFFECT (nothing to do here;
    ``reason`` says why, no warning), WARNED (not implemented: a warning once per process when
    set), BOOTSTRAP (set by a launcher and read where the job's environment is discovered).
    ``flag``: a WARNED switch warns only when on (``=0`` asks for what spark_hvd does anyway);
    ``accepted``: values of a WARNED setting that already describe spark_hvd (no warning).
    """

    def __init__(self, status, reason, flag=False, accepted=()):
        self.status = status
        self.reason = reason
        self.flag = flag
        self.accepted = accepted


_INSTALLER = ("an option of Horovod's installer (pip install horovod); spark_hvd builds with "
              "build.py")
_NOT_MPI = ("mpi4py initialises MPI (its thread level is mpi4py.rc.thread_level), and Adasum "
            "runs on spark_hvd's own transport even with HOROVOD_CPU_OPERATIONS=MPI")
_OUR_TRANSPORT = ("spark_hvd always negotiates through its own controller (Horovod's gloo "
                  "slot; gloo_enabled() is True); HOROVOD_CPU_OPERATIONS=MPI moves the data "
                  "of CPU collectives through MPI")
_TORUS = ("torus allreduce is not implemented; HOROVOD_HIERARCHICAL_ALLREDUCE gives the "
          "same two-level allreduce (within each host, then across hosts)")

# Every HOROVOD_* variable of Horovod 0.28.1's documentation (docs/*.rst) and
# horovod/common/common.h, except HOROVOD_MPI / HOROVOD_GLOO / HOROVOD_CCL, which are values of
# HOROVOD_CONTROLLER and HOROVOD_CPU_OPERATIONS there, not variables.
HOROVOD_VARIABLES = {
    # Engine settings, read by Config at init().
    "FUSION_THRESHOLD": HorovodVariable(HONOURED, "fusion buffer size in bytes"),
    "CYCLE_TIME": HorovodVariable(HONOURED, "burst window in milliseconds"),
    "CACHE_CAPACITY": HorovodVariable(HONOURED, "response cache entries (0 disables it)"),
    "STALL_CHECK_DISABLE": HorovodVariable(HONOURED, "no stall warnings"),
    "STALL_CHECK_TIME_SECONDS": HorovodVariable(HONOURED, "stall warning after this long"),
    "STALL_SHUTDOWN_TIME_SECONDS": HorovodVariable(HONOURED, "stop the job after a stall "
                                                   "this long"),
    "TIMELINE": HorovodVariable(HONOURED, "timeline file of rank 0, or DYNAMIC: none at start, "
                                "hvd.start_timeline() / hvd.stop_timeline() control it"),
    "TIMELINE_MARK_CYCLES": HorovodVariable(HONOURED, "cycle markers in the timeline"),
    "DYNAMIC_PROCESS_SETS": HorovodVariable(HONOURED, "add_process_set / remove_process_set "
                                            "(also init(process_sets='dynamic'))"),
    "START_TIMEOUT": HorovodVariable(HONOURED, "seconds the ranks wait for each other at start"),
    "GLOO_TIMEOUT_SECONDS": HorovodVariable(HONOURED, "the start timeout when START_TIMEOUT is "
                                            "not set (launcher: --gloo-timeout-seconds)"),
    "LOG_LEVEL": HorovodVariable(HONOURED, "level of the launcher's, the Python side's and the "
                                 "native core's messages"),
    "SPARK_START_TIMEOUT": HorovodVariable(HONOURED, "spark_hvd.spark.run's start timeout"),
    "GLOO_IFACE": HorovodVariable(HONOURED, "every rank's listener binds to, and advertises, its "
                                  "host's address on this interface (as NETWORK_INTERFACE)"),
    "NETWORK_INTERFACE": HorovodVariable(HONOURED, "interface (or comma list) every rank's "
                                         "listener binds to and advertises"),
    "HIERARCHICAL_ALLREDUCE": HorovodVariable(HONOURED, "1 / 0 force hierarchical allreduce on "
                                              "/ off where a set spans hosts; unset: automatic"),
    "HIERARCHICAL_ALLGATHER": HorovodVariable(HONOURED, "1 / 0 force hierarchical allgather on "
                                              "/ off where a set spans hosts; unset: automatic"),
    "AUTOTUNE": HorovodVariable(HONOURED, "tune the fusion threshold, cycle time, response "
                                "cache and hierarchical switches while training runs"),
    "AUTOTUNE_LOG": HorovodVariable(HONOURED, "CSV of the autotune samples (rank 0)"),
    "AUTOTUNE_WARMUP_SAMPLES": HorovodVariable(HONOURED, "autotune samples discarded first"),
    "AUTOTUNE_STEPS_PER_SAMPLE": HorovodVariable(HONOURED, "steps per autotune sample"),
    "AUTOTUNE_BAYES_OPT_MAX_SAMPLES": HorovodVariable(HONOURED, "autotune samples before the "
                                                      "best setting is kept"),
    "AUTOTUNE_GAUSSIAN_PROCESS_NOISE": HorovodVariable(HONOURED, "noise of the autotune model"),
    # Nothing to do in spark_hvd: said why, no warning.
    "LOG_HIDE_TIME": HorovodVariable(NO_EFFECT, "spark_hvd's log lines carry no time stamp "
                                     "(the launcher's --prefix-timestamp adds one)"),
    "MPI_THREADS_DISABLE": HorovodVariable(NO_EFFECT, _NOT_MPI),
    "ADASUM_MPI_CHUNK_SIZE": HorovodVariable(NO_EFFECT, _NOT_MPI),
    "NUM_NCCL_STREAMS": HorovodVariable(NO_EFFECT, "the core runs NCCL on one stream per device"),
    "BATCH_D2D_MEMCOPIES": HorovodVariable(
        NO_EFFECT, "fused CUDA tensors are copied into the GPU fusion buffer one "
        "cudaMemcpyAsync each"),
    "ENABLE_ASYNC_COMPLETION": HorovodVariable(
        NO_EFFECT, "CUDA collectives always complete off the engine thread (a finalizer thread "
        "waits for their event)"),
    "DISABLE_NVTX_RANGES": HorovodVariable(NO_EFFECT, "spark_hvd emits no NVTX ranges"),
    "CCL_CACHE": HorovodVariable(NO_EFFECT, "oneCCL is not supported"),
    "SPARK_USE_LOCAL_RANK_GPU_INDEX": HorovodVariable(
        NO_EFFECT, "spark_hvd.spark.run always orders a task's CUDA_VISIBLE_DEVICES so that "
        "device hvd.local_rank() % torch.cuda.device_count() is one of its own "
        "(hvd.local_rank() itself when each task has one GPU)"),
    # Not implemented: a warning once per process when set.
    "TORUS_ALLREDUCE": HorovodVariable(WARNED, _TORUS, flag=True),
    "ELASTIC": HorovodVariable(HONOURED, "set by the elastic launcher in every worker: init() "
                               "joins the driver's rounds; DistributedOptimizer keeps its hooks "
                               "at size 1"),
    "ELASTIC_TIMEOUT": HorovodVariable(HONOURED, "seconds an elastic job may spend re-forming "
                                       "(--elastic-timeout; default 600)"),
    "THREAD_AFFINITY": HorovodVariable(WARNED, "pinning the background thread to cores is not "
                                       "implemented; use taskset or numactl"),
    "DISABLE_GROUP_FUSION": HorovodVariable(WARNED, "grouped ops may still be fused with other "
                                            "ops", flag=True),
    "ENABLE_XLA_OPS": HorovodVariable(WARNED, "there are no XLA ops; compile Keras models with "
                                      "jit_compile=False", flag=True),
    "CONTROLLER": HorovodVariable(WARNED, _OUR_TRANSPORT, accepted=("gloo",)),
    "CPU_OPERATIONS": HorovodVariable(HONOURED, "MPI: CPU collectives move their data through "
                                      "MPI (jobs started by mpirun or init(comm=...)); gloo: "
                                      "spark_hvd's own transport (the default)"),
    # Set by horovodrun / Horovod's Gloo launcher for each rank; read when the job is discovered.
    **{name: HorovodVariable(BOOTSTRAP, "set by horovodrun for each rank")
       for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
                    "HOSTNAME", "GLOO_RENDEZVOUS_ADDR", "GLOO_RENDEZVOUS_PORT")},
    # Options of Horovod's installer, meaningless once installed.
    **{name: HorovodVariable(NO_EFFECT, _INSTALLER)
       for name in ("WITH_PYTORCH", "WITH_TENSORFLOW", "WITH_MXNET", "WITH_MPI", "WITH_GLOO",
                    "WITHOUT_PYTORCH", "WITHOUT_TENSORFLOW", "WITHOUT_MXNET", "WITHOUT_MPI",
                    "WITHOUT_GLOO", "GPU", "GPU_OPERATIONS", "GPU_ALLREDUCE", "GPU_ALLGATHER",
                    "GPU_BROADCAST", "GPU_ALLTOALL", "GPU_REDUCESCATTER", "ALLOW_MIXED_GPU_IMPL",
                    "BUILD_ARCH_FLAGS", "BUILD_CUDA_CC_LIST", "CMAKE", "CUDA_HOME", "ROCM_HOME",
                    "NCCL_HOME", "NCCL_INCLUDE", "NCCL_LIB", "NCCL_LINK", "DEBUG")},
}


def warn_unsupported_env():
    """Warns (once per process and variable, through the ``spark_hvd`` logger) about every
    WARNED variable of :data:`HOROVOD_VARIABLES` that is set, as ``HOROVOD_<name>`` or
    ``SPARK_HVD_<name>``, to something spark_hvd does not do."""
    for name, var in HOROVOD_VARIABLES.items():
        if var.status != WARNED or name in _warned:
            continue
        value = env(name)
        if value is None:
            continue
        if var.flag and not env_flag(name):
            continue
        if value.strip().lower() in var.accepted:
            continue
        _warn_once(name, f"{contract.set_name(name)}={value} is set but {var.reason}; it is "
                         "ignored")
