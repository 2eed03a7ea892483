"""One process of the smoke test (smoke.py starts two): loads the freshly linked core next to
the system's C++ runtime, prints ``PORT <n>``, reads the peer list from stdin, then init,
allreduce, shutdown through the C API.

It runs in a fresh interpreter, loaded by its path, so it imports the standard library alone:
nothing of native_build, and not spark_hvd (the library under test is not where spark_hvd loads
it from). The structures are read from the header the library was built from, so they cannot
drift."""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path

# A healthy pair connects within milliseconds; a broken library that cannot read its peers'
# addresses waits this long for them before it fails.
SMOKE_START_TIMEOUT_S = 10.0
SMOKE_MISSING_EXPORTS = 3  # a smoke test process's exit status: the library lacks API functions

_C_TYPES = {"int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "double": ctypes.c_double}


def _header_struct(header_text: str, name: str) -> type:
    """The ctypes Structure for ``typedef struct { ... } name;`` of a C header whose fields are
    int32_t / int64_t / double and pointers (char pointers become c_char_p, others c_void_p)."""
    match = re.search(r"typedef\s+struct\s*\{([^}]*)\}\s*" + name + r"\s*;", header_text)
    if match is None:
        raise ValueError(f"no typedef struct {name} in the header")
    fields = []
    for decl in filter(None, (d.strip() for d in match.group(1).split(";"))):
        first, *more = decl.split(",")
        m = re.fullmatch(r"(?:const\s+)?(\w+)\s*(\*?)\s*(\w+)", first.strip())
        if m is None or (m.group(1) not in _C_TYPES and not m.group(2)):
            raise ValueError(f"cannot read the field declaration {decl!r} of {name}")
        base = m.group(1)
        declarators = [m.group(2, 3)] + [re.fullmatch(r"(\*?)\s*(\w+)", d.strip()).groups()
                                         for d in more]
        for star, field in declarators:
            pointer = ctypes.c_char_p if base == "char" else ctypes.c_void_p
            fields.append((field, pointer if star else _C_TYPES[base]))
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def _header_codes(header_text: str) -> dict[str, int]:
    """The ``SHVD_NAME = value`` constants of a C header's enums."""
    return {name: int(value)
            for name, value in re.findall(r"\b(SHVD_\w+)\s*=\s*(\d+)", header_text)}


def _load_system_cxx_runtime() -> None:
    """Loads the system's libstdc++ and initialises its locales, as importing torch does."""
    try:
        runtime = ctypes.CDLL("libstdc++.so.6")
    except OSError:
        return  # no shared libstdc++ (a libc++ system): nothing a core could collide with
    classic = getattr(runtime, "_ZNSt6locale7classicEv", None)  # std::locale::classic()
    if classic is not None:
        classic()


def main(rank: str, library: str, header: str) -> int:
    """Prints ``PORT <n>``, reads the peer list from stdin, then init, allreduce, shutdown.
    Exit status 0 when all went right."""
    import array

    rank = int(rank)
    _load_system_cxx_runtime()
    lib = ctypes.CDLL(library)
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", Path(header).read_text(), flags=re.S)
    missing = [f for f in dict.fromkeys(re.findall(r"\b(shvd_\w+)\s*\(", text))
               if not hasattr(lib, f)]
    if missing:
        print(f"the library does not export {', '.join(missing)} (declared in {header})")
        return SMOKE_MISSING_EXPORTS
    lib.shvd_last_error.restype = ctypes.c_char_p

    def check(result: int, what: str) -> int:
        if result < 0:
            raise RuntimeError(f"{what} failed: {lib.shvd_last_error().decode(errors='replace')}")
        return result

    try:
        print(f"PORT {check(lib.shvd_listen(b'127.0.0.1', ctypes.c_int64(-1)), 'shvd_listen')}", flush=True)
        peers = sys.stdin.read()
        options = _header_struct(text, "shvd_init_options")(
            rank=rank, size=2, local_rank=rank, local_size=2, cross_rank=0, cross_size=1,
            peers=peers.encode(), secret=b"build-smoke-test", secret_len=16,
            job_id=b"build-smoke-test", use_shared_memory=1,
            start_timeout_seconds=SMOKE_START_TIMEOUT_S, fusion_threshold_bytes=64 << 20,
            cycle_time_ms=0.5, cache_capacity=1024, overlap=-1, shm_single_copy=1,
            shm_single_copy_min_bytes=-1, shm_arenas=1)
        check(lib.shvd_init(ctypes.byref(options)), "shvd_init")
        if (lib.shvd_rank(), lib.shvd_size()) != (rank, 2):
            raise RuntimeError(f"rank/size {lib.shvd_rank()}/{lib.shvd_size()}, not {rank}/2")
        op_type = _header_struct(text, "shvd_op")
        codes = _header_codes(text)
        # A small allreduce and one large enough to take the chunked paths: sum of 1 and 2.
        for n in (5, 1 << 18):
            values = array.array("f", [rank + 1.0]) * n
            shape = (ctypes.c_int64 * 1)(n)
            op = op_type(op=codes["SHVD_OP_ALLREDUCE"], name=f"smoke.{n}".encode(),
                         dtype=codes["SHVD_DTYPE_FLOAT32"], ndim=1,
                         shape=ctypes.addressof(shape), input=values.buffer_info()[0],
                         output=values.buffer_info()[0], reduce_op=codes["SHVD_REDUCE_SUM"],
                         prescale=1.0, postscale=1.0)
            handle = ctypes.c_int64()
            check(lib.shvd_enqueue(ctypes.byref(op), 1, ctypes.byref(handle)), "shvd_enqueue")
            check(lib.shvd_wait_release(ctypes.byref(handle), 1), "allreduce")
            if values != array.array("f", [3.0]) * n:
                raise RuntimeError(f"allreduce of {n} floats gave {values[:5].tolist()}..., "
                                   "expected 3.0 everywhere")
        check(lib.shvd_shutdown(), "shvd_shutdown")
    except (RuntimeError, ValueError) as e:
        print(e, flush=True)
        return 1
    return 0
