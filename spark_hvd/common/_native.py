"""ctypes binding of the native core's C ABI (native/include/spark_hvd.h).

The one place that knows the library's symbols and struct layouts; everything else calls the
small functions here. The core is framework-free, so one build serves torch, TensorFlow, NumPy
and every Python version.
"""

import ctypes
import os

from ._errors import CollectiveError, UnsupportedError
from .exceptions import HorovodInternalError

ERR_INVALID, ERR_INTERNAL, ERR_STATE, ERR_UNSUPPORTED = 1, 2, 3, 4

(OP_ALLREDUCE, OP_ALLGATHER, OP_BROADCAST, OP_ALLTOALL, OP_REDUCESCATTER, OP_BARRIER, OP_JOIN,
 OP_ADD_PROCESS_SET, OP_REMOVE_PROCESS_SET) = range(9)

# Data type codes (native/common/types.h).
# UINT16 came later and was appended, so the earlier codes kept their values.
UINT8, INT8, INT16, INT32, INT64, FLOAT16, BFLOAT16, FLOAT32, FLOAT64, BOOL, UINT16 = range(11)
DTYPE_SIZES = {UINT8: 1, INT8: 1, UINT16: 2, INT16: 2, INT32: 4, INT64: 8, FLOAT16: 2,
               BFLOAT16: 2, FLOAT32: 4, FLOAT64: 8, BOOL: 1}
DTYPE_NAMES = {UINT8: "uint8", INT8: "int8", UINT16: "uint16", INT16: "int16", INT32: "int32",
               INT64: "int64", FLOAT16: "float16", BFLOAT16: "bfloat16", FLOAT32: "float32",
               FLOAT64: "float64", BOOL: "bool"}


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
        "shvd_rank": (i32, []), "shvd_size": (i32, []),
        "shvd_local_rank": (i32, []), "shvd_local_size": (i32, []),
        "shvd_cross_rank": (i32, []), "shvd_cross_size": (i32, []),
        "shvd_shared_memory_enabled": (i32, []),
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
        "shvd_release": (i32, [i64]),
        "shvd_start_timeline": (i32, [ctypes.c_char_p, i32]),
        "shvd_stop_timeline": (i32, []),
        "shvd_last_error": (ctypes.c_char_p, []),
        "shvd_last_error_kind": (i32, []),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


lib = _load()


def raise_last_error():
    """Raises the Python exception for the calling thread's last native error."""
    message = (lib.shvd_last_error() or b"").decode("utf-8", "replace")
    kind = lib.shvd_last_error_kind()
    if kind == ERR_INVALID:
        raise CollectiveError(message)
    if kind == ERR_UNSUPPORTED:
        raise UnsupportedError(message)
    if kind == ERR_INTERNAL:
        raise HorovodInternalError(message)
    raise RuntimeError(message)


def check(result):
    """Returns ``result`` unless it signals failure (-1), in which case raises."""
    if result == -1:
        raise_last_error()
    return result
