"""Configuration from the environment. Every ``SPARK_HVD_*`` variable also accepts Horovod's
``HOROVOD_*`` name so existing job configs keep working; ours wins when both are set.

:data:`SETTINGS` is the one table of the variables a user may set: name, default, meaning. The
readers take their defaults from it, and the documentation's configuration reference is
generated from it (``docs/_ext``), so neither can drift. :data:`HOROVOD_VARIABLES` lists every
``HOROVOD_*`` variable Horovod 0.28.1 documents and what spark_hvd does with it (an honoured
one's meaning is its :data:`SETTINGS` row); :func:`warn_unsupported_env` (run by ``init()``)
warns once per process about each one that is set but not implemented, so none is silently
ignored.
"""

import logging
import os
import sys

from . import _bootstrap_contract as contract



class Setting:
    """One variable a user may set, as ``SPARK_HVD_<name>`` (or ``HOROVOD_<name>``).

    ``default``: what the reader uses when it is not set (None: unset, or the native core's own
    default, which ``shown`` then gives); ``meaning``: what it does (Markdown, for the
    configuration reference); ``section``: the reference's heading; ``horovod``: Horovod 0.28.1
    has a ``HOROVOD_<name>`` of the same meaning; ``see``: the documentation page (and anchor)
    that explains it, relative to ``docs/``.
    """

    def __init__(self, default, meaning, section, shown=None, horovod=False, see=None):
        self.default = default
        self.meaning = meaning
        self.section = section
        self.shown = shown
        self.horovod = horovod
        self.see = see

    def shown_default(self):
        """The default as the documentation shows it ("" when there is none)."""
        if self.shown is not None:
            return self.shown
        if self.default is None:
            return ""
        if isinstance(self.default, bool):
            return str(int(self.default))
        if isinstance(self.default, float) and self.default.is_integer():
            return str(int(self.default))
        return str(self.default)


_ENGINE, _CHECKS, _TIMELINE, _TRANSPORT = ("engine", "stall and deadlock checks", "timeline",
                                           "transports")
_HIER, _AUTOTUNE, _GPU, _FRAMEWORKS = ("hierarchical collectives", "autotuning", "GPUs",
                                       "frameworks")
_START, _ELASTIC, _SPARK, _BUILD = ("start-up and logging", "elastic training", "Spark",
                                    "building")

# The one table of the variables users set (names without the SPARK_HVD_ / HOROVOD_ prefix),
# in the order the configuration reference lists them. Readers take their defaults from here.
SETTINGS = {
    "FUSION_THRESHOLD": Setting(
        128 * 1024 * 1024, "bytes of small allreduces fused into one collective (0 disables "
        "fusion)", _ENGINE, horovod=True),
    "CYCLE_TIME": Setting(
        0.5, "ms burst window: ops a rank submits in quick succession (a step's gradients) are "
        "collected and negotiated together; a burst ends when a result is awaited or polled, "
        "when the user pauses for a window, and at the latest after 10 windows (100 when not "
        "overlapping)", _ENGINE, horovod=True, see="concepts.md#the-background-engine"),
    "OVERLAP": Setting(
        "auto", "`1`: run collectives while the training thread is still submitting (spare "
        "cores overlap them with its work); `0`: collect a step's ops until a result is awaited "
        "(no engine wake-ups competing for the cores); `auto`: `0` when ranks on a host × 2 "
        "threads exceed its CPUs, else `1`, and `1` in a job across hosts (its collectives "
        "wait on the wire between hosts, which backward does not use)", _ENGINE),
    "CACHE_CAPACITY": Setting(1024, "response-cache entries (0 disables)", _ENGINE,
                              horovod=True),
    "DYNAMIC_PROCESS_SETS": Setting(
        False, "allow `add_process_set` / `remove_process_set` (also "
        "`init(process_sets=\"dynamic\")`)", _ENGINE, horovod=True),
    "STALL_CHECK_TIME_SECONDS": Setting(
        60.0, "warn when some ranks submitted a tensor and others did not for this long",
        _CHECKS, horovod=True),
    "STALL_SHUTDOWN_TIME_SECONDS": Setting(
        0.0, "if > 0, abort the job after a stall this long, or after a collective in which no "
        "byte moved this long (a frozen peer); acts after the later of this and the check time. "
        "Elastic jobs default to 60", _CHECKS, horovod=True,
        see="multi-host.md#when-a-host-or-a-link-is-lost-the-failure-bounds"),
    "STALL_CHECK_DISABLE": Setting(False, "turn the stall inspector off", _CHECKS,
                                   horovod=True),
    "DEADLOCK_CHECK_SECONDS": Setting(
        2.0, "a rank whose user threads have waited this long for results, with nothing new "
        "submitted or executed, tells rank 0 what it waits for; when every rank has, and none of "
        "those collectives has been submitted by every member it needs, the job ends with "
        "`HorovodInternalError` naming each rank's pending ops (no stall timeout needed). A "
        "program whose second thread submits, more than this long later, an op that the other "
        "ranks wait for can raise it; `0` turns the check off", _CHECKS),
    "TIMELINE": Setting(
        "", "write a Chrome trace to this file (rank 0); `DYNAMIC`: none at start, "
        "`hvd.start_timeline()` / `hvd.stop_timeline()` control it", _TIMELINE, horovod=True,
        see="timeline.md"),
    "TIMELINE_MARK_CYCLES": Setting(False, "also mark engine cycles in the timeline",
                                    _TIMELINE, horovod=True),
    "SHM_DISABLE": Setting(False, "use TCP even between ranks on one host", _TRANSPORT),
    "RING_THRESHOLD": Setting(
        None, "bytes above which TCP allreduce uses the ring instead of recursive doubling",
        _TRANSPORT, shown="65536"),
    "SHM_CHUNK_BYTES": Setting(
        None, "chunk size of the shared-memory allreduce pipeline; the single-copy path, which "
        "needs no slots, uses twice this (rank 0's value is used by all)", _TRANSPORT,
        shown="524288"),
    "SHM_SINGLE_COPY": Setting(
        True, "`0`: never read peers' memory directly (`process_vm_readv`); always go through "
        "the shared segment (rank 0's value is used by all)", _TRANSPORT,
        see="concepts.md#transports"),
    "SHM_SINGLE_COPY_MIN_BYTES": Setting(
        None, "allreduces from this size read peers' tensors directly (rank 0's value is used "
        "by all)", _TRANSPORT, shown="16777216"),
    "SHM_NEGOTIATION": Setting(
        True, "when every rank shares one host, agree on cached allreduces through shared "
        "memory instead of the rank-0 coordinator (0: always the coordinator; rank 0's value "
        "applies)", _TRANSPORT),
    "SHM_PIPE_BYTES": Setting(None, "capacity of each shared-memory pipe direction",
                              _TRANSPORT, shown="4194304"),
    "TCP_BUFFER_BYTES": Setting(
        None, "socket buffer size of TCP links (0 = kernel autotuning)", _TRANSPORT,
        shown="4194304"),
    "NETWORK_INTERFACE": Setting(
        None, "interface name (or comma list) every rank's listener binds to and advertises, "
        "resolved on each rank's host; also `HOROVOD_GLOO_IFACE`", _TRANSPORT, horovod=True,
        see="multi-host.md#network-interfaces"),
    "GLOO_IFACE": Setting(
        None, "Horovod's per-rank name of `NETWORK_INTERFACE` (what `horovodrun` sets)",
        _TRANSPORT, horovod=True),
    "PEER_TIMEOUT_SECONDS": Setting(
        25.0, "a peer host silent this long (down, or its link cut) is lost: every rank's ops "
        "fail with `HorovodInternalError` (0 = the kernel's defaults, minutes to hours)",
        _TRANSPORT, see="multi-host.md#when-a-host-or-a-link-is-lost-the-failure-bounds"),
    "CPU_OPERATIONS": Setting(
        "gloo", "`MPI`: CPU collectives through MPI in jobs started by `mpirun`, "
        "`spark-hvd-run --mpi` or `init(comm=...)`; `gloo`: spark_hvd's own transport",
        _TRANSPORT, horovod=True, see="launching.md#mpi-as-a-backend"),
    "HIERARCHICAL_ALLREDUCE": Setting(
        None, "`1`: allreduce within each host, then across hosts, wherever a set spans hosts "
        "with more than one of its ranks on some host; `0`: never; unset: when bandwidth-bound",
        _HIER, shown="auto", horovod=True, see="multi-host.md#hierarchical-collectives"),
    "HIERARCHICAL_ALLGATHER": Setting(
        None, "`1` / `0`: the same for allgather; unset: always where it applies", _HIER,
        shown="auto", horovod=True, see="multi-host.md#hierarchical-collectives"),
    "AUTOTUNE": Setting(
        False, "`1`: tune the fusion threshold, cycle time, response cache and (where the job "
        "spans hosts) the hierarchical switches while training runs (launcher: `--autotune`)",
        _AUTOTUNE, horovod=True, see="autotuning.md"),
    "AUTOTUNE_LOG": Setting(
        "", "CSV file rank 0 writes: one row per sample (the settings and the score), then the "
        "best one (launcher: `--autotune-log-file`)", _AUTOTUNE, horovod=True),
    "AUTOTUNE_WARMUP_SAMPLES": Setting(
        3, "samples measured first and discarded (start-up, caches filling)", _AUTOTUNE,
        horovod=True),
    "AUTOTUNE_STEPS_PER_SAMPLE": Setting(10, "training steps in each sample", _AUTOTUNE,
                                         horovod=True),
    "AUTOTUNE_BAYES_OPT_MAX_SAMPLES": Setting(
        20, "samples tried before the best setting is kept for the rest of the job", _AUTOTUNE,
        horovod=True),
    "AUTOTUNE_GAUSSIAN_PROCESS_NOISE": Setting(
        0.8, "noise the model assumes, relative to the spread of the scores (higher: trusts "
        "single samples less)", _AUTOTUNE, horovod=True),
    "SHARED_GPU": Setting(
        "host", "what ranks of a process set that share one GPU do with CUDA tensors (NCCL "
        "refuses them): `host` runs those collectives through host memory (one warning); "
        "`nccl` gives each rank its own `NCCL_HOSTID` so NCCL connects them through its socket "
        "transport", _GPU, see="gpus.md"),
    "CUDART_LIBRARY": Setting(
        None, "path of the CUDA runtime library the core loads for CUDA tensors (default: the "
        "copy the framework loaded, NVIDIA's wheels, then the system's)", _GPU, see="gpus.md"),
    "NCCL_LIBRARY": Setting(None, "path of the NCCL library, found as `CUDART_LIBRARY` is",
                            _GPU, see="gpus.md"),
    "SHARED_GRADIENTS": Setting(
        True, "`0`: torch gradients stay in torch's own memory, and tensors in shared arenas "
        "are not reduced in place (`0` on any rank turns the latter off for its whole process "
        "set)", _FRAMEWORKS, see="guides/pytorch.md#gradients-in-shared-memory"),
    "TF_SYNC_KERNELS": Setting(
        False, "`1`: the TensorFlow op library's kernels wait for their collectives before they "
        "return (its fallback where TensorFlow's done callbacks cannot be kept); a "
        "`tf.compat.v1` Session graph whose independent collectives the ranks start in "
        "different orders then ends with the deadlock error", _FRAMEWORKS,
        see="installing.md"),
    "GRADIENT_BUCKET_BYTES": Setting(
        None, "torch `DistributedOptimizer`: small gradients submitted together (0 = one by "
        "one); CUDA gradients use torch DDP's 25 MiB buckets, since each NCCL collective costs "
        "a launch and a network round trip", _FRAMEWORKS,
        shown="262144 (CUDA: 26214400)"),
    "TF_OPS": Setting(
        True, "`0`: TensorFlow graphs run allreduces as `tf.numpy_function` nodes instead of "
        "the native `SparkHvdAllreduce` op", _FRAMEWORKS,
        see="guides/tensorflow.md#inside-graphs"),
    "START_TIMEOUT": Setting(contract.DEFAULT_START_TIMEOUT, "seconds to wait for all ranks at "
                             "start-up", _START, horovod=True),
    "GLOO_TIMEOUT_SECONDS": Setting(
        None, "the start timeout when `START_TIMEOUT` is not set (Horovod's bound on Gloo's "
        "set-up; launcher: `--gloo-timeout-seconds`)", _START, horovod=True),
    "LOG_LEVEL": Setting(
        "WARNING", "`TRACE`, `DEBUG`, `INFO`, `WARNING`, `ERROR` or `FATAL`: the level of the "
        "launcher's, the Python side's (the `spark_hvd` logger) and the native core's messages",
        _START, horovod=True),
    "KILL_GRACE_SECONDS": Setting(
        5.0, "`spark-hvd-run`: seconds between SIGTERM and SIGKILL when it stops the ranks",
        _START),
    "ELASTIC_TIMEOUT": Setting(
        contract.DEFAULT_ELASTIC_TIMEOUT, "elastic jobs: how long the job may wait to re-form "
        "(too few processes) before it fails (launcher: `--elastic-timeout`)", _ELASTIC,
        horovod=True, see="elastic.md"),
    "ELASTIC_REJOIN_SECONDS": Setting(
        contract.DEFAULT_ELASTIC_REJOIN, "elastic jobs: a member that has not rejoined this long "
        "after a reset began (it ignored the abort: frozen) is stopped and its host blacklisted",
        _ELASTIC, see="elastic.md"),
    "ELASTIC_ON_USER_ERROR": Setting(
        "raise", "`raise`: an exception in the user's code ends an elastic job; `blacklist`: "
        "its host is treated as lost (Horovod's behaviour)", _ELASTIC, see="elastic.md"),
    "SPARK_START_TIMEOUT": Setting(
        600.0, "`spark_hvd.spark.run`'s start timeout when its `start_timeout` is not given",
        _SPARK, horovod=True),
    "SPARK_HEARTBEAT_TIMEOUT": Setting(
        10.0, "on the driver: a Spark task silent this long is lost and fails the run (also the "
        "Spark configuration `spark.spark_hvd.heartbeatTimeout`)", _SPARK,
        see="multi-host.md#spark-across-machines-standalone-yarn-kubernetes"),
    "ALLOW_UNENCRYPTED": Setting(
        False, "on the driver: `1` lets `spark_hvd.spark.run` start on a cluster with "
        "`spark.ssl.enabled=true` (the ranks' traffic is authenticated, not encrypted)",
        _SPARK, see="guides/spark.md#what-happens"),
    "SKIP_SMOKE_TEST": Setting(
        False, "`build.py`: do not test a newly linked core before installing it (cross "
        "builds)", _BUILD, see="getting-started.md#supported-toolchains"),
    "BUILD_JOBS": Setting(2, "`build.py`: parallel compiler processes", _BUILD),
    "SKIP_NATIVE_BUILD": Setting(False, "`pip install`: leave the native build out", _BUILD),
    "DEBUG_BUILD": Setting(False, "`pip install`: build the core with `-O0 -g`", _BUILD),
    "TOOLCHAIN": Setting(
        None, "`zig`: build with zig's clang from PyPI's `ziglang` for glibc 2.28, LLVM's C++ "
        "runtime linked in privately (the manylinux wheel's toolchain; `make wheel` sets it)",
        _BUILD, shown="the system compiler (`CXX`, else g++)", see="installing.md"),
    "STRIP": Setting(False, "`1`: strip the built libraries (always done for the zig build)",
                     _BUILD, see="installing.md"),
    "TORCH_WHEELS": Setting(
        None, "torch wheel files (`:`-separated) to build more shared-gradient allocators from, "
        "one per torch minor (`make wheel TORCH_WHEELS=...`)", _BUILD, see="installing.md"),
    "TORCH_CXX": Setting(
        None, "the compiler of the torch allocators, which must use libstdc++ as torch does",
        _BUILD, shown="g++ for the zig build, else `CXX`", see="installing.md"),
}


def default(name):
    """The default of setting ``name`` (:data:`SETTINGS`)."""
    return SETTINGS[name].default


DEFAULT_FUSION_THRESHOLD = default("FUSION_THRESHOLD")
# 25 s + the last probe tick (< 1 s) + the abort stays within the 30 s bound the docs promise.
DEFAULT_PEER_TIMEOUT_SECONDS = default("PEER_TIMEOUT_SECONDS")
# Long enough that a thread about to submit the op another rank waits for is not mistaken for a
# deadlock; short next to the stall inspector's 60 s (native/controller/deadlock.h).
DEFAULT_DEADLOCK_CHECK_SECONDS = default("DEADLOCK_CHECK_SECONDS")
# The stall inspector's shutdown time in elastic jobs (docs: elastic training).
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
        self.cycle_time_ms = env_float("CYCLE_TIME", default("CYCLE_TIME"))
        self.cache_capacity = env_int("CACHE_CAPACITY", default("CACHE_CAPACITY"))
        if env_flag("STALL_CHECK_DISABLE"):
            self.stall_warning_seconds = 0.0
        else:
            self.stall_warning_seconds = env_float("STALL_CHECK_TIME_SECONDS",
                                                   default("STALL_CHECK_TIME_SECONDS"))
        # Elastic jobs end a stall (a frozen rank) by default, so the driver can re-form without
        # it: off elsewhere, as in Horovod.
        self.stall_shutdown_seconds = env_float(
            "STALL_SHUTDOWN_TIME_SECONDS",
            DEFAULT_ELASTIC_STALL_SHUTDOWN_SECONDS if env_flag("ELASTIC")
            else default("STALL_SHUTDOWN_TIME_SECONDS"))
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
        # lets the core choose (see docs/multi-host.md, "Hierarchical collectives").
        self.hierarchical_allreduce = env_switch("HIERARCHICAL_ALLREDUCE")
        self.hierarchical_allgather = env_switch("HIERARCHICAL_ALLGATHER")
        self.log_level = log_level()
        self.shared_memory = not env_flag("SHM_DISABLE")
        # Shared-memory allreduce tuning; 0 and None leave the core's defaults.
        self.shm_chunk_bytes = env_int("SHM_CHUNK_BYTES", 0)
        self.shm_single_copy = env_flag("SHM_SINGLE_COPY", default("SHM_SINGLE_COPY"))
        self.shm_single_copy_min_bytes = env_int("SHM_SINGLE_COPY_MIN_BYTES", None)
        # Transport buffers: each direction of a shared-memory pipe (0: the core's 4 MiB), and
        # the TCP data sockets' send/receive buffers (None: the core's 4 MiB; 0: the kernel's
        # autotuning).
        self.shm_pipe_bytes = env_int("SHM_PIPE_BYTES", 0)
        # Cached allreduces agreed through shared memory when every rank shares one host.
        self.shm_negotiation = env_flag("SHM_NEGOTIATION", default("SHM_NEGOTIATION"))
        self.tcp_buffer_bytes = env_int("TCP_BUFFER_BYTES", None)
        # A peer host silent this long (down, or its link cut: no FIN, no RST ever comes) is
        # lost and every rank's ops fail; 0 leaves the kernel's defaults (minutes to hours).
        self.peer_timeout = env_float("PEER_TIMEOUT_SECONDS", DEFAULT_PEER_TIMEOUT_SECONDS)
        # Gradients in memory every local member maps, reduced in place (torch).
        self.shared_gradients = env_flag("SHARED_GRADIENTS", default("SHARED_GRADIENTS"))
        # Horovod's gloo timeout bounds its connection set-up, as our start timeout does.
        self.start_timeout = contract.start_timeout()
        overlap = str(env("OVERLAP", default("OVERLAP"))).strip().lower()
        if overlap not in _OVERLAP:
            raise ValueError(f"SPARK_HVD_OVERLAP must be auto, 1 or 0, got {overlap!r}")
        self.overlap = _OVERLAP[overlap]
        # Ranks of a set that share one GPU (NCCL refuses them): 0 host memory, 1 NCCL with a
        # host identity per rank (the core's SHVD_SHARED_GPU_* codes).
        shared_gpu = str(env("SHARED_GPU", default("SHARED_GPU"))).strip()
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
        self.autotune_warmup_samples = env_int("AUTOTUNE_WARMUP_SAMPLES",
                                               default("AUTOTUNE_WARMUP_SAMPLES"))
        self.autotune_steps_per_sample = env_int("AUTOTUNE_STEPS_PER_SAMPLE",
                                                 default("AUTOTUNE_STEPS_PER_SAMPLE"))
        self.autotune_bayes_opt_max_samples = env_int(
            "AUTOTUNE_BAYES_OPT_MAX_SAMPLES", default("AUTOTUNE_BAYES_OPT_MAX_SAMPLES"))
        self.autotune_gaussian_process_noise = env_float(
            "AUTOTUNE_GAUSSIAN_PROCESS_NOISE", default("AUTOTUNE_GAUSSIAN_PROCESS_NOISE"))
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
DEFAULT_LOG_LEVEL = default("LOG_LEVEL")
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
    # Horovod's settings that spark_hvd reads too: their rows of SETTINGS.
    **{name: HorovodVariable(HONOURED, setting.meaning)
       for name, setting in SETTINGS.items() if setting.horovod},
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
    "THREAD_AFFINITY": HorovodVariable(WARNED, "pinning the background thread to cores is not "
                                       "implemented; use taskset or numactl"),
    "DISABLE_GROUP_FUSION": HorovodVariable(WARNED, "grouped ops may still be fused with other "
                                            "ops", flag=True),
    "ENABLE_XLA_OPS": HorovodVariable(WARNED, "there are no XLA ops; compile Keras models with "
                                      "jit_compile=False", flag=True),
    "CONTROLLER": HorovodVariable(WARNED, _OUR_TRANSPORT, accepted=("gloo",)),
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
