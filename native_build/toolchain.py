"""The C++ toolchain: which compiler (``CXX``, default g++; ``SPARK_HVD_TOOLCHAIN=zig``: zig's
clang from the ziglang package, targeting glibc ZIG_GLIBC, for the manylinux wheel), the flags every library is built
with, and how a compile or link runs: into a temporary file renamed over the old output, so that
processes which already loaded the old library are not disturbed and a failure leaves it as it
was. The parts (core.py, frameworks.py, mpi_plugin.py, cpp_tests.py) say what to compile; this
module alone runs the compiler."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

BASE_FLAGS = ["-std=c++17", "-fPIC", "-pthread", "-Wall"]
RELEASE_FLAGS = ["-O3", "-DNDEBUG"]
DEBUG_FLAGS = ["-O0", "-g"]
ASAN_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer"]
LINK_LIBS = ["-pthread", "-lrt", "-ldl"]

# The core's symbols are its own (only the C API is exported), so the compiler may bind every
# call inside the library directly. The framework libraries do not get these flags: hiding the
# inline functions of torch's or TensorFlow's headers would give the library private copies of
# their static locals.
HIDDEN_FLAGS = ["-fvisibility=hidden", "-fvisibility-inlines-hidden"]
# Defines the extern "C" shvd_* functions, declared in include/spark_hvd.h without a visibility
# attribute: compiled with default visibility so that exports.map can export them (a hidden
# symbol cannot be), with inline functions hidden like everywhere else.
API_SOURCE_FLAGS = ["-fvisibility-inlines-hidden"]
# The TensorFlow op library keeps its exports (no version script), so it hides the symbols that
# static archives such as libstdc++.a bring in with this instead.
PRIVATE_ARCHIVES_FLAG = "-Wl,--exclude-libs,ALL"


# The wheel's toolchain: SPARK_HVD_TOOLCHAIN=zig builds with zig's clang (the ziglang package
# on PyPI, no system compiler) for glibc ZIG_GLIBC, so the libraries run on any Linux with that
# glibc or newer (manylinux_2_28), with LLVM's C++ runtime linked in and kept private.
TOOLCHAIN_ENV = "SPARK_HVD_TOOLCHAIN"
ZIG_GLIBC = "2.28"
# Strip the libraries (the wheel's; SPARK_HVD_STRIP=1 asks for it elsewhere): the core with
# LLVM's C++ runtime in it is 18 MB with symbols, 3 MB without.
STRIP_FLAGS = ["-s"]


class BuildError(RuntimeError):
    """A compile or link step failed; the message holds the compiler output."""


def log(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"[build] {msg}", flush=True)


def display(p: Path) -> str:
    """``p`` relative to the working directory where it lies below it (for messages)."""
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def zig_toolchain() -> bool:
    return os.environ.get(TOOLCHAIN_ENV, "") == "zig"


def compiler() -> list[str]:
    """The C++ compiler command: zig's (SPARK_HVD_TOOLCHAIN=zig), else CXX, else g++."""
    if zig_toolchain():
        # zig keeps frame pointers at every optimisation level; g++ and clang drop them
        # from -O1 on, and the small-allreduce path showed the difference.
        return [sys.executable, "-m", "ziglang", "c++", "-target",
                f"{platform.machine()}-linux-gnu.{ZIG_GLIBC}", "-fomit-frame-pointer"]
    return shlex.split(os.environ.get("CXX", "g++"))


def private_archives() -> list[str]:
    """PRIVATE_ARCHIVES_FLAG where the linker knows it (zig's does not; its libraries hide
    everything but shvd_* through the version script anyway)."""
    return [] if zig_toolchain() else [PRIVATE_ARCHIVES_FLAG]


def strip_libraries() -> bool:
    return zig_toolchain() or os.environ.get("SPARK_HVD_STRIP", "") not in ("", "0")


def env_flags(name: str) -> list[str]:
    return shlex.split(os.environ.get(name, ""))


@functools.lru_cache(maxsize=None)
def compiler_version(cxx: tuple[str, ...]) -> str:
    """The first line of ``cxx --version`` (e.g. ``g++ (Debian 12.2.0-14) 12.2.0``)."""
    try:
        proc = subprocess.run(list(cxx) + ["--version"], capture_output=True, text=True,
                              timeout=30)
        first = (proc.stdout or proc.stderr).strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        first = []
    return first[0].strip() if first else f"{cxx[0]} (version unknown)"


def compile_object(cmd: list[str], src: Path, obj: Path, verbose: bool) -> tuple[Path, str]:
    """Compiles ``src`` into ``obj`` with ``cmd`` (compiler and flags), writing the headers it
    included to ``obj`` with suffix ``.d`` (gcc -MMD). Returns (src, the compiler's warnings);
    raises BuildError with its output when it fails."""
    tmp = obj.with_name(obj.name + ".tmp")
    tmp_dep = obj.with_suffix(".d.tmp")
    full = cmd + ["-MMD", "-MF", str(tmp_dep), "-MT", str(obj), "-c", str(src), "-o", str(tmp)]
    if verbose:
        print(" ".join(shlex.quote(c) for c in full), flush=True)
    proc = subprocess.run(full, capture_output=True, text=True)
    output = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        for p in (tmp, tmp_dep):
            with contextlib.suppress(OSError):
                p.unlink()
        raise BuildError(f"compiling {src} failed (exit {proc.returncode}):\n{output}")
    os.replace(tmp_dep, obj.with_suffix(".d"))
    os.replace(tmp, obj)
    return src, output


def produce(cmd: list[str], output: Path, what: str, verbose: bool, verify=None) -> None:
    """Runs ``cmd -o <temp>`` and renames the temp file over ``output``, so that processes which
    already loaded the old library are not disturbed and a failure leaves the old one.
    ``verify(temp)``, when given, runs before the rename: a library that fails it (BuildError)
    is never installed."""
    tmp = output.with_name(output.name + f".tmp{os.getpid()}")
    cmd = cmd + ["-o", str(tmp)]
    if verbose:
        print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = (proc.stdout + proc.stderr).strip()
    try:
        if proc.returncode != 0:
            raise BuildError(f"{what} {output.name} failed (exit {proc.returncode}):\n{out}")
        if out:
            print(f"[build] {what} {output.name}:\n{out}", flush=True)
        if verify is not None:
            verify(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.replace(tmp, output)


@contextlib.contextmanager
def lock(build_dir: Path):
    """Serialise concurrent builds of the same tree (several engineers, pip + make...)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_library(cmd: list[str], output: Path, inputs: list[Path], build_root: Path,
                  stamp_name: str, version: str, note: str, what: str, verbose: bool,
                  quiet: bool) -> Path:
    """Runs ``cmd`` (one compile-and-link step) into ``output`` unless the library is up to
    date: built by the same command (``version`` too, recorded in ``stamp_name``) and newer
    than every one of ``inputs``. ``note`` says what it was built with."""
    stamp = build_root / stamp_name
    signature = " ".join(cmd) + f"\n{version}\n"
    with lock(build_root):
        if (output.exists() and stamp.exists() and stamp.read_text() == signature
                and max(p.stat().st_mtime for p in inputs if p.exists())
                <= output.stat().st_mtime):
            log(f"{display(output)} up to date ({note})", quiet)
            return output
        t0 = time.monotonic()
        produce(cmd, output, what, verbose)
        stamp.write_text(signature)
        log(f"built {display(output)} {note} in {time.monotonic() - t0:.1f}s", quiet)
    return output
