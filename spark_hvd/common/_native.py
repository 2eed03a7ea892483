"""ctypes binding of the native core's C ABI (native/include/spark_hvd.h).

The one place that knows the library's symbols, struct layouts and codes (the dtype, reduce-op,
op and error numbers come from the core itself at load, checked against the names used here);
everything else calls the small functions here. The core is framework-free, so one build
serves torch, TensorFlow, NumPy and every Python version.
"""

import ctypes
import os

from ._errors import CollectiveError, UnsupportedError
from .exceptions import HorovodInternalError


class InitOptions(ctypes.Structure):
    _fields_ = [
        ("rank", ctypes.c_int32), ("size", ctypes.c_int32),
        ("local_rank", ctypes.c_int32), ("local_size", ctypes.c_int32),
        ("cross_rank", ctypes.c_int32), ("cross_size", ctypes.c_int32),
        ("peers", ctypes.c_char_p),
        ("secret", ctypes.c_char_p), ("secret_len", ctypes.c_int32),
        ("job_id", ctypes.c_char_p),
        ("use_shared_memory", ctypes.c_int32),
        ("start_timeout_seconds", ctypes.c_double),
        ("fusion_threshold_bytes", ctypes.c_int64),
        ("cycle_time_ms", ctypes.c_double),
        ("cache_capacity", ctypes.c_int64),
        ("stall_warning_seconds", ctypes.c_double),
        ("stall_shutdown_seconds", ctypes.c_double),
        ("ring_threshold_bytes", ctypes.c_int64),
        ("timeline_path", ctypes.c_char_p),
        ("timeline_mark_cycles", ctypes.c_int32),
        ("process_set_ranks", ctypes.POINTER(ctypes.c_int32)),
        ("process_set_sizes", ctypes.POINTER(ctypes.c_int32)),
        ("num_process_sets", ctypes.c_int32),
        ("overlap", ctypes.c_int32),
        ("shm_chunk_bytes", ctypes.c_int64),
        ("shm_single_copy", ctypes.c_int32),
        ("shm_single_copy_min_bytes", ctypes.c_int64),
        ("shm_arenas", ctypes.c_int32),
        ("shm_pipe_bytes", ctypes.c_int64),
        ("shm_negotiation", ctypes.c_int32),
        ("hierarchical_allreduce", ctypes.c_int32),
        ("hierarchical_allgather", ctypes.c_int32),
        ("autotune", ctypes.c_int32),
        ("autotune_log", ctypes.c_char_p),
        ("autotune_warmup_samples", ctypes.c_int32),
        ("autotune_steps_per_sample", ctypes.c_int32),
        ("autotune_bayes_opt_max_samples", ctypes.c_int32),
        ("autotune_gaussian_process_noise", ctypes.c_double),
        ("autotune_fixed", ctypes.c_int32),
        ("peer_timeout_seconds", ctypes.c_double),
        # MPI backend (see _mpi).
        ("cpu_operations", ctypes.c_int32),
        ("mpi_comm", ctypes.c_int64),
        ("mpi_plugin", ctypes.c_char_p),
        ("shared_gpu", ctypes.c_int32),
        ("deadlock_check_seconds", ctypes.c_double),
    ]


def _library_path():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(here, "_core", "libspark_hvd_core.so")


def _load():
    path = _library_path()
    if not os.path.exists(path):
        raise ImportError(
            f"spark_hvd's native core is not built ({path} is missing). "
            "Run `python build.py` in the source tree or reinstall with `pip install .`.")
    lib = ctypes.CDLL(path)  # CDLL releases the GIL during every call
    i32, i64, vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    p_i32, p_i64 = ctypes.POINTER(i32), ctypes.POINTER(i64)
    signatures = {
        "shvd_listen": (i32, [ctypes.c_char_p, i64]),
        "shvd_init": (i32, [ctypes.POINTER(InitOptions)]),
        "shvd_shutdown": (i32, []),
        "shvd_is_initialized": (i32, []),
        "shvd_abort": (i32, [ctypes.c_char_p]),
        "shvd_post_notice": (i32, [i64]),
        "shvd_released_notice": (i64, []),
        "shvd_calling_thread_ops": (i64, []),
        "shvd_rank": (i32, []), "shvd_size": (i32, []),
        "shvd_local_rank": (i32, []), "shvd_local_size": (i32, []),
        "shvd_cross_rank": (i32, []), "shvd_cross_size": (i32, []),
        "shvd_shared_memory_enabled": (i32, []),
        "shvd_tuned_parameters": (i32, [ctypes.POINTER(ctypes.c_double), i32]),
        "shvd_shared_alloc": (vp, [i64]),
        "shvd_shared_free": (i32, [vp]),
        "shvd_shared_bytes": (i64, []),
        "shvd_shared_inplace_allreduces": (i64, []),
        "shvd_process_set_size": (i32, [i32]),
        "shvd_process_set_rank": (i32, [i32]),
        "shvd_process_set_ranks": (i32, [i32, p_i32, i32]),
        "shvd_process_set_ids": (i32, [p_i32, i32]),
        "shvd_process_set_find": (i32, [p_i32, i32]),
        "shvd_enqueue_packed": (i32, [ctypes.c_char_p, i64, i32, p_i64]),
        "shvd_enqueue_record": (i64, [ctypes.c_char_p, i64]),
        "shvd_enqueue_record_wait": (i64, [ctypes.c_char_p, i64, i32]),
        "shvd_poll": (i32, [i64]),
        "shvd_wait": (i32, [i64]),
        "shvd_wait_release": (i32, [p_i64, i32]),
        "shvd_wait_release_one": (i32, [i64]),
        "shvd_wait_for": (i32, [p_i64, i32, i32]),
        "shvd_wait_release_for": (i32, [p_i64, i32, i32]),
        "shvd_wait_release_one_for": (i32, [i64, i32]),
        "shvd_release_completed": (i32, [p_i64, i32]),
        "shvd_output": (i32, [i64, ctypes.POINTER(vp), p_i64]),
        "shvd_output_shape": (i32, [i64, p_i64, i32]),
        "shvd_output_ints": (i32, [i64, p_i64, i32]),
        "shvd_output_device": (i32, [i64]),
        "shvd_output_copy": (i32, [i64, vp, vp]),
        "shvd_gpu_load": (i32, [ctypes.c_char_p, ctypes.c_char_p]),
        "shvd_gpu_report": (ctypes.c_char_p, []),
        "shvd_gpu_counters": (i32, [p_i64, i32]),
        "shvd_release": (i32, [i64]),
        "shvd_start_timeline": (i32, [ctypes.c_char_p, i32]),
        "shvd_stop_timeline": (i32, []),
        "shvd_last_error": (ctypes.c_char_p, []),
        "shvd_last_error_kind": (i32, []),
        "shvd_abi_codes": (ctypes.c_char_p, []),
    }
    for name, (restype, argtypes) in signatures.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise ImportError(f"spark_hvd's native core {path} does not export {name}: it is "
                              "older than its Python side. Rebuild it (`python build.py`) or "
                              "reinstall spark_hvd.") from None
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


lib = _load()


# ---- the ABI's codes ----------------------------------------------------------------------------
# The numbers are the core's (SHVD_* in spark_hvd.h, listed by shvd_abi_codes); Python only names
# the codes it uses. check_abi_codes fails the import when the two lists differ, so a core built
# from another version of the header never receives a code that means something else there.

# The codes Python uses, by kind, as the core names them.
ABI_NAMES = {
    "dtype": ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
              "float64", "bool", "uint16"),
    "reduce_op": ("Average", "Sum", "Adasum", "Min", "Max", "Product"),
    "op": ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier", "join",
           "add_process_set", "remove_process_set"),
    "error": ("none", "invalid", "internal", "state", "unsupported", "connect"),
}


def parse_abi_codes(table):
    """``shvd_abi_codes()``'s text as ``{kind: {name: code}}``, plus ``{dtype name: bytes}``."""
    codes, sizes = {}, {}
    for line in table.splitlines():
        kind, name, code, *more = line.split()
        codes.setdefault(kind, {})[name] = int(code)
        if kind == "dtype":
            sizes[name] = int(more[0])
    return codes, sizes


def check_abi_codes(codes, expected=ABI_NAMES, where="the native core"):
    """Raises ImportError unless ``codes`` names exactly the codes of ``expected``, each once
    (one name per code), for every kind."""
    problems = []
    for kind in sorted(set(codes) | set(expected)):
        have, want = codes.get(kind, {}), set(expected.get(kind, ()))
        if set(have) != want:
            missing = ", ".join(sorted(want - set(have))) or "-"
            extra = ", ".join(sorted(set(have) - want)) or "-"
            problems.append(f"{kind}: missing {missing}; unknown to Python {extra}")
        elif len(set(have.values())) != len(have):
            problems.append(f"{kind}: two names share a code ({have})")
    if problems:
        raise ImportError(f"spark_hvd's Python side and {where} disagree about the ABI's codes "
                          f"(native/include/spark_hvd.h): {'; '.join(problems)}. The core was "
                          "built from another version: rebuild it (`python build.py`) or "
                          "reinstall spark_hvd.")


ABI_CODES, _DTYPE_SIZES = parse_abi_codes(lib.shvd_abi_codes().decode())
check_abi_codes(ABI_CODES)

_dtype, _op, _err = ABI_CODES["dtype"], ABI_CODES["op"], ABI_CODES["error"]
(UINT8, INT8, INT16, INT32, INT64, FLOAT16, BFLOAT16, FLOAT32, FLOAT64, BOOL,
 UINT16) = (_dtype[n] for n in ABI_NAMES["dtype"])
DTYPE_SIZES = {_dtype[n]: size for n, size in _DTYPE_SIZES.items()}
DTYPE_NAMES = {code: n for n, code in _dtype.items()}
(OP_ALLREDUCE, OP_ALLGATHER, OP_BROADCAST, OP_ALLTOALL, OP_REDUCESCATTER, OP_BARRIER, OP_JOIN,
 OP_ADD_PROCESS_SET, OP_REMOVE_PROCESS_SET) = (_op[n] for n in ABI_NAMES["op"])
ERR_INVALID, ERR_INTERNAL, ERR_STATE, ERR_UNSUPPORTED, ERR_CONNECT = (
    _err[n] for n in ("invalid", "internal", "state", "unsupported", "connect"))
# Reduce ops by name (hvd.Average, hvd.Sum, ... are these codes: common/_ops.py).
REDUCE_OPS = ABI_CODES["reduce_op"]


def raise_last_error(hints=None):
    """Raises the Python exception for the calling thread's last native error; ``hints``
    ({error kind: text}) adds the text to the message of an error of that kind."""
    message = (lib.shvd_last_error() or b"").decode("utf-8", "replace")
    kind = lib.shvd_last_error_kind()
    if hints and kind in hints:
        message = f"{message} {hints[kind]}"
    if kind == ERR_INVALID:
        raise CollectiveError(message)
    if kind == ERR_UNSUPPORTED:
        raise UnsupportedError(message)
    if kind in (ERR_INTERNAL, ERR_CONNECT):
        raise HorovodInternalError(message)
    raise RuntimeError(message)


def require_init():
    """Raises Horovod's ``ValueError`` unless the core is initialized (between ``init()`` and
    ``shutdown()``)."""
    if not lib.shvd_is_initialized():
        raise ValueError("spark_hvd has not been initialized; call hvd.init() first.")


def check(result):
    """Returns ``result`` unless it signals failure (-1), in which case raises."""
    if result == -1:
        raise_last_error()
    return result
