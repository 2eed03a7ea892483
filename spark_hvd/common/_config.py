"""Configuration from the environment. Every ``SPARK_HVD_*`` variable also accepts Horovod's
``HOROVOD_*`` name so existing job configs keep working; ours wins when both are set."""

import os

DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024


def env(name, default=None):
    """Value of ``SPARK_HVD_<name>``, else ``HOROVOD_<name>``, else ``default``."""
    for prefix in ("SPARK_HVD_", "HOROVOD_"):
        value = os.environ.get(prefix + name)
        if value is not None and value != "":
            return value
    return default


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


# SPARK_HVD_OVERLAP: run collectives while the training thread still submits (1), or collect a
# step's ops until a result is awaited (0, best when ranks outnumber half the CPUs), or decide
# from the host (auto).
_OVERLAP = {"auto": -1, "1": 1, "true": 1, "on": 1, "yes": 1, "0": 0, "false": 0, "off": 0,
            "no": 0}


class Config:
    """Engine settings read once at ``init()``."""

    def __init__(self):
        self.fusion_threshold = env_int("FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD)
        self.cycle_time_ms = env_float("CYCLE_TIME", 0.5)
        self.cache_capacity = env_int("CACHE_CAPACITY", 1024)
        if env_flag("STALL_CHECK_DISABLE"):
            self.stall_warning_seconds = 0.0
        else:
            self.stall_warning_seconds = env_float("STALL_CHECK_TIME_SECONDS", 60.0)
        self.stall_shutdown_seconds = env_float("STALL_SHUTDOWN_TIME_SECONDS", 0.0)
        self.ring_threshold = env_int("RING_THRESHOLD", 0)
        self.timeline = env("TIMELINE", "")
        self.timeline_mark_cycles = env_flag("TIMELINE_MARK_CYCLES")
        self.dynamic_process_sets = env_flag("DYNAMIC_PROCESS_SETS")
        self.shared_memory = not env_flag("SHM_DISABLE")
        # Shared-memory allreduce tuning; 0 and None leave the core's defaults.
        self.shm_chunk_bytes = env_int("SHM_CHUNK_BYTES", 0)
        self.shm_single_copy = env_flag("SHM_SINGLE_COPY", True)
        self.shm_single_copy_min_bytes = env_int("SHM_SINGLE_COPY_MIN_BYTES", None)
        # Gradients in memory every local member maps, reduced in place (torch).
        self.shared_gradients = env_flag("SHARED_GRADIENTS", True)
        self.start_timeout = env_float("START_TIMEOUT", 30.0)
        overlap = str(env("OVERLAP", "auto")).strip().lower()
        if overlap not in _OVERLAP:
            raise ValueError(f"SPARK_HVD_OVERLAP must be auto, 1 or 0, got {overlap!r}")
        self.overlap = _OVERLAP[overlap]
        for name, value in (("FUSION_THRESHOLD", self.fusion_threshold),
                            ("CACHE_CAPACITY", self.cache_capacity),
                            ("SHM_CHUNK_BYTES", self.shm_chunk_bytes),
                            ("SHM_SINGLE_COPY_MIN_BYTES", self.shm_single_copy_min_bytes)):
            if value is not None and value < 0:
                raise ValueError(f"SPARK_HVD_{name} must be >= 0, got {value}")
        if self.cycle_time_ms < 0:
            raise ValueError(f"SPARK_HVD_CYCLE_TIME must be >= 0 ms, got {self.cycle_time_ms}")
