"""Helpers shared by the worker scripts (they run as ranks under spark-hvd-run).

A worker records every failed check instead of stopping at the first, then prints one line per
failure (``FAIL rank=R ...``) and a final marker: ``OK rank=R checks=N ...`` when all passed.
The tests look for those markers in the launcher's prefixed output.
"""

from __future__ import annotations

import hashlib
import os
import sys
import traceback
import zlib

import numpy as np

ALL_DTYPES = [np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64, np.float16, np.float32,
              np.float64, np.bool_]


class Checks:
    """Collects check results for one rank."""

    def __init__(self, rank: int):
        self.rank = rank
        self.count = 0
        self.failures: list[str] = []

    def check(self, ok, what: str) -> bool:
        self.count += 1
        if not ok:
            self.fail(what)
        return bool(ok)

    def fail(self, what: str) -> None:
        self.failures.append(what)
        if len(self.failures) <= 50:  # keep the output readable when everything breaks
            print(f"FAIL rank={self.rank} {what}", flush=True)

    def run(self, what: str, fn, *args, **kwargs):
        """Calls ``fn``; an unexpected exception counts as a failure (returns None)."""
        self.count += 1
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any exception is a finding
            self.fail(f"{what}: unexpected {type(e).__name__}: {e}\n"
                      + "".join(traceback.format_exc(limit=4)))
            return None

    def raises(self, what: str, exc_type, fn, *args, match=(), **kwargs):
        """``fn`` must raise ``exc_type`` whose message contains every string in ``match``.
        Returns the exception (or None)."""
        self.count += 1
        try:
            fn(*args, **kwargs)
        except exc_type as e:
            msg = str(e)
            missing = [m for m in ([match] if isinstance(match, str) else match) if m not in msg]
            if missing:
                self.fail(f"{what}: message {msg!r} lacks {missing}")
            return e
        except Exception as e:  # noqa: BLE001
            self.fail(f"{what}: expected {exc_type.__name__}, got {type(e).__name__}: {e}")
            return e
        self.fail(f"{what}: expected {exc_type.__name__}, nothing was raised")
        return None

    def finish(self, **fields) -> None:
        """Prints the final marker and exits (code 1 when a check failed)."""
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        if self.failures:
            print(f"FAILED rank={self.rank} {len(self.failures)} of {self.count} checks failed",
                  flush=True)
            sys.stdout.flush()
            os._exit(1)
        print(f"OK rank={self.rank} checks={self.count} {extra}".rstrip(), flush=True)


def run_mode(functions: dict) -> None:
    """Runs the worker function named by ``sys.argv[1]`` (looked up in ``functions``, the
    worker module's ``globals()``) with this rank's Checks, then reports."""
    c = Checks(int(os.environ["SPARK_HVD_RANK"]))
    functions[sys.argv[1]](c)
    c.finish()


def apply_rank_env() -> None:
    """Sets the variables only this rank sees: ENV_OF_RANK_<rank>="NAME=VALUE ..." (to test
    whose settings win when ranks differ). Call before init."""
    for item in os.environ.get(f"ENV_OF_RANK_{os.environ.get('SPARK_HVD_RANK')}", "").split():
        key, _, value = item.partition("=")
        os.environ[key] = value


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def make_input(rank: int, shape, dtype, tag, kind: str = "sum") -> np.ndarray:
    """Deterministic input of ``rank`` for case ``tag``: every rank can compute every other
    rank's input to build the reference. Values are chosen so that the reduction ``kind``
    ("sum", "product", "any") cannot overflow the dtype for up to 4 ranks."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed_of(tag, rank, str(dtype), tuple(shape)))
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if kind == "product":
        if dtype.kind == "f":
            return rng.uniform(0.5, 1.5, size=shape).astype(dtype)
        low = 0 if dtype.kind == "u" else -2
        return rng.integers(low, 3, size=shape).astype(dtype)
    if dtype.kind == "f":
        return rng.uniform(-4, 4, size=shape).astype(dtype)
    if dtype.kind == "u":  # wider types past 255: a byte-wise kernel would show
        return rng.integers(0, 50 if dtype.itemsize == 1 else 2000, size=shape).astype(dtype)
    bound = 25 if dtype.itemsize == 1 else 1000
    return rng.integers(-bound, bound, size=shape).astype(dtype)


def digest(array) -> bytes:
    a = np.ascontiguousarray(array)
    return hashlib.sha256(str(a.dtype).encode() + repr(a.shape).encode() + a.tobytes()).digest()


def describe_diff(got, want) -> str:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != {want.dtype}"
    if got.size == 0:
        return "empty"
    bad = np.argwhere(~np.isclose(got.astype(np.float64), want.astype(np.float64),
                                  rtol=1e-6, atol=0)) if got.dtype.kind == "f" else \
        np.argwhere(got != want)
    if len(bad) == 0:
        bad = np.argwhere(got != want)
    if len(bad) == 0:
        return "equal"
    idx = tuple(bad[0])
    return (f"{len(bad)} of {got.size} elements differ; first at {idx}: got {got[idx]!r} "
            f"want {want[idx]!r}")


def close(got, want, rtol=0.0, atol=0.0) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.dtype.kind != "f" or (rtol == 0 and atol == 0):
        return bool(np.array_equal(got, want))
    return bool(np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                            atol=atol))


def tolerance(dtype, nranks: int) -> tuple[float, float]:
    """(rtol, atol) for comparing a reduction of values in [-4, 4] with a float64 reference."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        # Each of the (n - 1) partial sums is rounded to fp16 once (half an ulp at |x| < 16,
        # 2**-7), plus the final rounding.
        return 2e-3, nranks * 2.0 ** -7
    if dtype == np.float32:
        return 1e-5, 1e-5 * nranks
    if dtype == np.float64:
        return 1e-12, 1e-12 * nranks
    return 0.0, 0.0


def write_pid(tag: str = "") -> None:
    """Records this rank's pid in $PID_DIR (for tests that check nothing is left behind)."""
    pid_dir = os.environ.get("PID_DIR")
    if pid_dir:
        rank = os.environ.get("SPARK_HVD_RANK", "x")
        with open(os.path.join(pid_dir, f"rank{rank}{tag}.pid"), "w") as f:
            f.write(str(os.getpid()))


def deny_process_vm_readv() -> None:
    """Make ``process_vm_readv`` fail with EPERM in this process and the threads it starts from
    now on, as a container's seccomp profile may: a seccomp filter, installed through libc."""
    import ctypes
    import platform
    arch, nr = {"x86_64": (0xC000003E, 310), "aarch64": (0xC00000B7, 270)}[platform.machine()]

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                    ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]

    ld_abs, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET
    allow, eperm = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    program = (SockFilter * 6)(
        SockFilter(ld_abs, 0, 0, 4),    # seccomp_data.arch
        SockFilter(jeq, 0, 3, arch),    # another architecture's calls: allow
        SockFilter(ld_abs, 0, 0, 0),    # seccomp_data.nr
        SockFilter(jeq, 0, 1, nr),
        SockFilter(ret, 0, 0, eperm),
        SockFilter(ret, 0, 0, allow))
    prog = SockFprog(len(program), program)
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0 or \
            libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "cannot install the seccomp filter")


def scatter_counts(rows: int, n: int) -> list[int]:
    """Rows each of ``n`` members gets from a reducescatter of ``rows`` rows (Horovod's rule:
    the first ``rows % n`` members get one row more)."""
    return [rows // n + (1 if i < rows % n else 0) for i in range(n)]


def scatter_slice(rows: int, n: int, me: int) -> slice:
    """The rows member ``me`` of ``n`` gets from a reducescatter of ``rows`` rows."""
    counts = scatter_counts(rows, n)
    return slice(sum(counts[:me]), sum(counts[:me + 1]))


def ref_adasum(inputs):
    """Adasum of one tensor over the members (a power of two), combined pairwise as a binary
    tree like the core: (1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b, coefficient 1 for a vector
    whose squared norm is below 1e-8, rounded to the dtype after every level."""
    dtype = inputs[0].dtype
    vs = [x.astype(np.float64).ravel() for x in inputs]
    level = 1
    while level < len(vs):
        nxt = list(vs)
        for r in range(len(vs)):
            a, b = vs[r & ~level], vs[r | level]
            dot, an, bn = float(a @ b), float(a @ a), float(b @ b)
            ac = 1.0 - dot / an * 0.5 if an >= 1e-8 else 1.0
            bc = 1.0 - dot / bn * 0.5 if bn >= 1e-8 else 1.0
            nxt[r] = (ac * a + bc * b).astype(dtype).astype(np.float64)
        vs = nxt
        level <<= 1
    return vs[0].astype(dtype).reshape(inputs[0].shape)
