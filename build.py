#!/usr/bin/env python3
"""Build the native core (native/**/*.cc) into spark_hvd/_core/libspark_hvd_core.so, and, when
TensorFlow is importable, its graph ops (native/tensorflow/) into libspark_hvd_tf.so, and, when
torch is importable, its shared-gradient allocator (native/torch/) into libspark_hvd_torch.so.

The library is a plain C-ABI shared object loaded with ctypes: it needs no Python headers, torch
or TensorFlow, so one build serves every framework and Python version. Builds are incremental:
objects live under build/native/<variant>/, and a source is recompiled when it, or any header it
included last time (gcc -MMD dependency files), is newer than its object, or when the compiler
flags changed. Objects compile in parallel; the link writes a temporary file and renames it over
the old library, so processes that already loaded the old one are not disturbed.

    python build.py               # optimised build (-O3)
    python build.py --debug       # -O0 -g, same output path
    python build.py --asan        # --debug plus AddressSanitizer (needs LD_PRELOAD=libasan.so)
    python build.py --clean       # remove build/native and the libraries
    python build.py --no-tensorflow --no-torch --no-mpi   # the core only
    python build.py -j 4 -v       # 4 parallel compiles, print every command
    python build.py --no-smoke-test   # cross builds: a library this machine cannot run

Environment: CXX (compiler, default g++), CXXFLAGS / LDFLAGS (appended), SPARK_HVD_BUILD_JOBS,
SPARK_HVD_NATIVE_DIR (source tree, default ./native; used for testing the build itself),
SPARK_HVD_SKIP_SMOKE_TEST=1 (as --no-smoke-test).
setup.py imports build() from here, so `pip install .` / `pip install -e .` build the library.

The core exports its C API (the shvd_* functions) and nothing else: its sources are compiled
-fvisibility=hidden (c_api.cc, which defines the API, excepted) and linked with the version script
native/exports.map, so a C++ runtime linked in statically stays private. A freshly linked core
is installed only after a smoke test: two processes that load it next to the system's C++
runtime, as torch and TensorFlow do, init, allreduce and shut down over 127.0.0.1 (a fraction of
a second). When that fails the build fails, naming the compiler and what to do.

Where an MPI implementation with headers is installed (an ``mpicxx`` wrapper on PATH, or
``MPICXX``), the MPI plugin (native/mpi/plugin/) is built too, into libspark_hvd_mpi.so next to
the core, with the wrapper's compile and link flags (``--showme:compile`` / ``--showme:link``
of Open MPI, ``-compile_info`` / ``-link_info`` of MPICH; failing those, the wrapper itself
compiles). It is a separate library, not part of the core, so that the core never links MPI:
the core must build, load and run on machines without MPI, and a core linked to libmpi would
fail to load wherever that library (or the version it was built against) is missing, and
would pull MPI into every process that only uses the TCP transport. The core dlopens the plugin
at init only for ``HOROVOD_CPU_OPERATIONS=MPI``; by then mpi4py has loaded and initialised the
very libmpi the plugin links to. Without MPI the plugin is skipped with a note
(``mpi_built()`` is then False); ``--no-mpi`` skips it.

The TensorFlow op library is built against the TensorFlow that the building interpreter
imports (its headers and libtensorflow_framework), and rebuilt when that version or its sources
change. TensorFlow's flags are asked for once per installation and kept in the build folder
(importing TensorFlow takes seconds; a build with nothing to do takes a fraction of one). It is
optional: without it spark_hvd.tensorflow runs graph collectives as
tf.numpy_function nodes. The torch library is built the same way against torch's c10 headers;
without it gradients stay in torch's own memory (and are copied through the shared segment).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import fcntl
import functools
import json
import os
import re
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
LIB_NAME = "libspark_hvd_core.so"
TF_LIB_NAME = "libspark_hvd_tf.so"
TORCH_LIB_NAME = "libspark_hvd_torch.so"
MPI_LIB_NAME = "libspark_hvd_mpi.so"
DEFAULT_SRC = ROOT / "native"
DEFAULT_BUILD = ROOT / "build" / "native"
DEFAULT_OUT = ROOT / "spark_hvd" / "_core" / LIB_NAME

HEADER_SUFFIXES = (".h", ".hpp", ".hh", ".inc", ".ipp")

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
API_SOURCES = ("c_api.cc",)
# Which symbols a library exports (native/exports.map: shvd_* alone, whatever static archives
# such as libstdc++.a bring in stays private). The TensorFlow op library keeps its exports, so
# it hides the archives' symbols with --exclude-libs instead.
EXPORTS_MAP = "exports.map"
PRIVATE_ARCHIVES_FLAG = "-Wl,--exclude-libs,ALL"

SKIP_SMOKE_TEST_ENV = "SPARK_HVD_SKIP_SMOKE_TEST"
# A healthy pair connects within milliseconds; a broken library that cannot read its peers'
# addresses waits this long for them before it fails.
SMOKE_START_TIMEOUT_S = 10.0
SMOKE_TIMEOUT_S = 40.0  # the whole test, processes included, before they are killed
SMOKE_MISSING_EXPORTS = 3  # a smoke test process's exit status: the library lacks API functions


class BuildError(RuntimeError):
    """A compile or link step failed; the message holds the compiler output."""


def _log(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"[build] {msg}", flush=True)


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CXX", "g++"))


def _env_flags(name: str) -> list[str]:
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


def _exports_map(src_dir: Path) -> Path:
    exports = src_dir / EXPORTS_MAP
    if not exports.is_file():
        raise BuildError(f"{exports} is missing: the version script that keeps everything but "
                         "the shvd_* functions private to the library")
    return exports


# Standalone test programs (with their own main) live in tests/ and are built by their tests;
# tensorflow/ and torch/ hold the framework libraries (build_framework_library), not the core.
EXCLUDED_DIRS = ("tests", "tensorflow", "torch")
# The MPI plugin's sources (build_mpi_plugin): compiled against MPI, never into the core.
MPI_PLUGIN_DIR = ("mpi", "plugin")


def _sources(src_dir: Path) -> list[Path]:
    if not src_dir.is_dir():
        return []
    return sorted(p for p in src_dir.rglob("*.cc")
                  if p.is_file() and p.relative_to(src_dir).parts[0] not in EXCLUDED_DIRS
                  and p.relative_to(src_dir).parts[:2] != MPI_PLUGIN_DIR)


def _newest_header_mtime(src_dir: Path) -> float:
    newest = 0.0
    if src_dir.is_dir():
        for p in src_dir.rglob("*"):
            if p.suffix in HEADER_SUFFIXES and p.is_file():
                newest = max(newest, p.stat().st_mtime)
    return newest


def _read_deps(dep_file: Path) -> list[Path] | None:
    """Prerequisites listed in a gcc -MMD file, or None when it is missing or unreadable."""
    try:
        text = dep_file.read_text()
    except OSError:
        return None
    text = text.replace("\\\n", " ")
    _, sep, rest = text.partition(": ")
    if not sep:
        return None
    # Only the first rule matters (later ones are phony header targets if -MP were used).
    first_rule = rest.split("\n", 1)[0]
    return [Path(tok.replace("\\ ", " ")) for tok in first_rule.split()]


def _needs_compile(src: Path, obj: Path, dep: Path, fallback_header_mtime: float) -> bool:
    try:
        obj_mtime = obj.stat().st_mtime
    except OSError:
        return True
    if src.stat().st_mtime > obj_mtime:
        return True
    deps = _read_deps(dep)
    if deps is None:
        # No dependency record: be conservative and compare against every header in the tree.
        return fallback_header_mtime > obj_mtime
    for d in deps:
        try:
            if d.stat().st_mtime > obj_mtime:
                return True
        except OSError:
            return True  # a header it used is gone (renamed/removed): recompile to find out
    return False


def _compile_one(cmd: list[str], src: Path, obj: Path, verbose: bool) -> tuple[Path, str]:
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


def _produce(cmd: list[str], output: Path, what: str, verbose: bool, verify=None) -> None:
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


def build_test_program(name: str, sources: list[str], src_dir: Path = DEFAULT_SRC,
                       build_dir: Path = DEFAULT_BUILD) -> Path:
    """Compiles a standalone C++ test program of native/tests/ (``sources``: paths relative to
    ``src_dir``, its own file with main() first, then the library sources it tests) with the
    library's release flags, and returns the binary. The binary is named after a hash of the
    compiler, the flags, the sources and every header under ``src_dir``, so a rerun with
    nothing changed only runs it. Raises BuildError with the compiler's output."""
    import hashlib

    cxx = _compiler()
    flags = BASE_FLAGS + RELEASE_FLAGS + _env_flags("CXXFLAGS")
    paths = [src_dir / s for s in sources]
    headers = sorted(p for p in src_dir.rglob("*") if p.suffix in HEADER_SUFFIXES and p.is_file())
    digest = hashlib.sha256(" ".join(cxx + flags).encode())
    for path in paths + headers:
        digest.update(str(path.relative_to(src_dir)).encode())
        digest.update(path.read_bytes())
    out_dir = build_dir / "tests"
    out_dir.mkdir(parents=True, exist_ok=True)
    binary = out_dir / f"{name}_{digest.hexdigest()[:16]}"
    if not binary.exists():
        _produce(cxx + flags + [str(p) for p in paths] + LINK_LIBS + _env_flags("LDFLAGS"),
                 binary, "compiling test program", verbose=False)
    return binary


@contextlib.contextmanager
def _lock(build_dir: Path):
    """Serialise concurrent builds of the same tree (several engineers, pip + make...)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build(
    debug: bool = False,
    asan: bool = False,
    jobs: int | None = None,
    verbose: bool = False,
    quiet: bool = False,
    src_dir: str | os.PathLike | None = None,
    build_dir: str | os.PathLike | None = None,
    output: str | os.PathLike | None = None,
    smoke_test: bool | None = None,
) -> Path | None:
    """Compile and link the core. Returns the library path, or None when there are no sources.

    A library is installed at ``output`` only after it passed the two-process smoke test
    (:func:`run_smoke_test`), unless ``smoke_test`` is False (default: True unless
    ``SPARK_HVD_SKIP_SMOKE_TEST`` is set). An up-to-date library that has not passed it yet
    (built with the test skipped) is tested, and removed if it fails.

    Raises BuildError with the compiler's output when a step fails, or with what to do when the
    smoke test fails.
    """
    src_dir = Path(src_dir or os.environ.get("SPARK_HVD_NATIVE_DIR") or DEFAULT_SRC).resolve()
    build_root = Path(build_dir or DEFAULT_BUILD).resolve()
    output = Path(output or DEFAULT_OUT).resolve()
    if jobs is None:
        jobs = int(os.environ.get("SPARK_HVD_BUILD_JOBS", "2"))
    jobs = max(1, jobs)
    if asan:
        debug = True
    if smoke_test is None:
        smoke_test = os.environ.get(SKIP_SMOKE_TEST_ENV, "") in ("", "0")

    variant = "asan" if asan else ("debug" if debug else "release")
    obj_root = build_root / variant

    output.parent.mkdir(parents=True, exist_ok=True)
    init_py = DEFAULT_OUT.parent / "__init__.py"
    if output == DEFAULT_OUT and not init_py.exists():
        init_py.write_text("")

    sources = _sources(src_dir)
    if not sources:
        _log(f"no .cc sources under {src_dir}; nothing to build", quiet)
        return None

    cxx = _compiler()
    if shutil.which(cxx[0]) is None:
        raise BuildError(f"C++ compiler {cxx[0]!r} not found; install g++ or set CXX")
    version = compiler_version(tuple(cxx))
    _log(f"compiler: {version} (CXX={' '.join(cxx)})", quiet)
    exports = _exports_map(src_dir)

    flags = (
        BASE_FLAGS
        + (DEBUG_FLAGS if debug else RELEASE_FLAGS)
        + (ASAN_FLAGS if asan else [])
        + [f"-I{src_dir}", f"-I{src_dir / 'include'}"]
        + _env_flags("CXXFLAGS")
    )
    compile_cmd = cxx + flags
    link_cmd_base = (
        cxx
        + ["-shared", f"-Wl,-soname,{LIB_NAME}", "-Wl,--no-undefined",
           f"-Wl,--version-script={exports}"]
        + (ASAN_FLAGS if asan else [])
        + _env_flags("LDFLAGS")
    )

    def visibility_flags(src: Path) -> list[str]:
        return API_SOURCE_FLAGS if src.relative_to(src_dir).as_posix() in API_SOURCES \
            else HIDDEN_FLAGS

    def verify(library: Path) -> None:
        seconds = run_smoke_test(library, src_dir / "include" / "spark_hvd.h", asan=asan)
        _log(f"smoke test passed: 2 processes ran init, allreduce and shutdown with "
             f"{library.name.split('.tmp')[0]} in {seconds:.1f}s", quiet)

    with _lock(build_root):
        obj_root.mkdir(parents=True, exist_ok=True)
        # Different flags (or compiler) invalidate every object of this variant.
        flags_file = obj_root / "flags"
        flags_sig = (" ".join(compile_cmd) + f"\n{version}\nhidden={HIDDEN_FLAGS} "
                     f"api={API_SOURCES}:{API_SOURCE_FLAGS}\nsrc={src_dir}\n")
        flags_changed = not flags_file.exists() or flags_file.read_text() != flags_sig

        header_mtime = _newest_header_mtime(src_dir)
        objects: list[Path] = []
        todo: list[tuple[Path, Path]] = []
        for src in sources:
            rel = src.relative_to(src_dir)
            obj = obj_root / rel.with_suffix(".o")
            objects.append(obj)
            if flags_changed or _needs_compile(src, obj, obj.with_suffix(".d"), header_mtime):
                todo.append((src, obj))

        t0 = time.monotonic()
        if todo:
            _log(f"compiling {len(todo)} of {len(sources)} sources ({variant}, -j{jobs})", quiet)
            for _, obj in todo:
                obj.parent.mkdir(parents=True, exist_ok=True)
            errors: list[str] = []
            with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
                futures = [pool.submit(_compile_one, compile_cmd + visibility_flags(s), s, o,
                                       verbose) for s, o in todo]
                for fut in concurrent.futures.as_completed(futures):
                    try:
                        src, out = fut.result()
                    except BuildError as e:
                        errors.append(str(e))
                        continue
                    if out:  # warnings
                        print(f"[build] {src.relative_to(src_dir)}:\n{out}", flush=True)
                    elif verbose:
                        _log(f"  ok {src.relative_to(src_dir)}", quiet)
            if errors:
                raise BuildError(
                    "\n\n".join(errors) + f"\n\n[build] {len(errors)} of {len(todo)} sources failed"
                )
            flags_file.write_text(flags_sig)
        else:
            _log(f"all {len(sources)} objects up to date ({variant})", quiet)

        # Relink when an object (or the version script) is newer than the library, or the
        # library came from another variant / object set (recorded in link_stamp).
        link_stamp = build_root / "link_stamp"
        link_cmd = link_cmd_base + [str(o) for o in objects] + LINK_LIBS
        link_sig = " ".join(link_cmd) + f"\nout={output}\n"
        need_link = (
            bool(todo)
            or not output.exists()
            or not link_stamp.exists()
            or link_stamp.read_text() != link_sig
            or max(p.stat().st_mtime for p in objects + [exports]) > output.stat().st_mtime
        )
        # Records the library (inode, size, mtime) that last passed the smoke test.
        smoke_stamp = build_root / "smoke_stamp"
        if need_link:
            _produce(link_cmd, output, "linking", verbose, verify if smoke_test else None)
            link_stamp.write_text(link_sig)
            _log(f"linked {_display(output)} in {time.monotonic() - t0:.1f}s", quiet)
        else:
            _log(f"{_display(output)} up to date", quiet)
            if smoke_test and _read(smoke_stamp) != _file_identity(output):
                try:
                    verify(output)
                except BuildError:
                    # A library that fails it must not stay where spark_hvd loads it from.
                    for p in (output, link_stamp):
                        with contextlib.suppress(OSError):
                            p.unlink()
                    raise
        if smoke_test:
            smoke_stamp.write_text(_file_identity(output))
        else:
            _log("smoke test skipped (--no-smoke-test / SPARK_HVD_SKIP_SMOKE_TEST)", quiet)
    return output


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _file_identity(path: Path) -> str:
    st = path.stat()
    return f"{path} {st.st_ino} {st.st_size} {st.st_mtime_ns}\n"


# --- The smoke test: two processes that use a freshly linked core through its C API -----------
#
# It loads the library the way a job does after `import torch` or `import tensorflow`: with the
# system's C++ runtime already loaded and its locales initialised. A core that exports its
# own copy of the runtime (or part of it) then shares some of its objects with that copy (the
# locale facets' ids are STB_GNU_UNIQUE symbols, unified across the process whatever the load
# order), and the two copies disagree: the peer list's ports read as 0 and ranks never connect.
# Nothing here imports spark_hvd (the library under test is not where spark_hvd loads it from):
# the structures are read from the header the library was built from, so they cannot drift.


def run_smoke_test(library: Path, header: Path, asan: bool = False) -> float:
    """Runs two processes that load ``library`` next to the system's C++ runtime, as a framework
    does, and init, allreduce (two sizes) and shut down over 127.0.0.1 through its C API
    (``header``). Returns the seconds it took; raises BuildError naming the compiler and what to
    do when either process fails, crashes or hangs."""
    t0 = time.monotonic()
    env = dict(os.environ)
    if asan:  # an ASan library loads only into a process that starts with the ASan runtime
        asan_rt = subprocess.run(_compiler() + ["-print-file-name=libasan.so"],
                                 capture_output=True, text=True).stdout.strip()
        env.update(LD_PRELOAD=asan_rt, ASAN_OPTIONS="detect_leaks=0")
    boot = ("import importlib.util as u, sys; s = u.spec_from_file_location('_shvd_build', "
            "sys.argv[1]); m = u.module_from_spec(s); s.loader.exec_module(m); "
            "sys.exit(m._smoke_worker(*sys.argv[2:]))")
    procs, logs = [], []
    failures: list[str] = []
    try:
        for rank in range(2):
            log = tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-c", boot, str(Path(__file__).resolve()), str(rank),
                 str(library), str(header)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env))
        deadline = t0 + SMOKE_TIMEOUT_S
        ports = [_read_line(p, deadline) for p in procs]
        # Without both ports the peer list stays empty: the other process then fails at once.
        peers = "".join(f"127.0.0.1 {port.split()[1]} smoke-host\n" for port in ports) \
            if all(port.startswith("PORT ") for port in ports) else ""
        for p in procs:
            with contextlib.suppress(OSError):
                p.stdin.write(peers)
            with contextlib.suppress(OSError):
                p.stdin.close()
        for rank, p in enumerate(procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                failures.append(f"rank {rank}: no result after {SMOKE_TIMEOUT_S:.0f} s (killed)")
                continue
            out = p.stdout.read()
            if p.returncode != 0:
                logs[rank].seek(0)
                first = "" if ports[rank].startswith("PORT ") else ports[rank]
                detail = "\n".join(x for x in (first, out.strip(), logs[rank].read().strip()[-1500:])
                                   if x)
                failures.append(f"rank {rank}: {_exit_status(p.returncode)}"
                                + ("\n" + detail).replace("\n", "\n    "))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if failures:
        missing_exports = any(p.returncode == SMOKE_MISSING_EXPORTS for p in procs)
        raise BuildError(_smoke_failure_message(library, failures, missing_exports))
    return time.monotonic() - t0


def _read_line(proc: subprocess.Popen, deadline: float) -> str:
    """The first line ``proc`` prints, or "" when it exits or the deadline passes first."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(max(0.0, deadline - time.monotonic())):
            return ""
    return proc.stdout.readline().strip()


def _exit_status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit status {code}"


def _smoke_failure_message(library: Path, failures: list[str], missing_exports: bool) -> str:
    cxx = _compiler()
    ldflags = os.environ.get("LDFLAGS", "")
    if missing_exports:
        advice = (f"define every function that include/spark_hvd.h declares in "
                  f"{' or '.join(API_SOURCES)} (the only source compiled with default "
                  f"visibility; the others are -fvisibility=hidden), and name it shvd_* "
                  f"({EXPORTS_MAP} exports nothing else)")
    else:
        static_runtime = [f for f in shlex.split(ldflags) if f.startswith("-static")]
        advice = "build with the distribution's compiler: CXX=g++ python build.py"
        if static_runtime:
            advice = (f"drop {' '.join(static_runtime)} from LDFLAGS (the C++ runtime must be "
                      f"the one torch and TensorFlow load), or {advice}")
        advice += ". If a build with the distribution's g++ fails too, report this output"
    return (
        f"the smoke test of {library.name.split('.tmp')[0]} failed: two processes could not "
        f"init, allreduce and shut down over 127.0.0.1 with it, so it was not installed (every "
        f"multi-rank job would fail the same way).\n  " + "\n  ".join(failures) + "\n"
        f"Compiler: {compiler_version(tuple(cxx))} (CXX={' '.join(cxx)}"
        + (f", LDFLAGS={ldflags}" if ldflags else "") + ").\n"
        f"What to do: {advice}. Only for a cross build whose library cannot run here: "
        f"--no-smoke-test or {SKIP_SMOKE_TEST_ENV}=1.")


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


def _smoke_worker(rank: str, library: str, header: str) -> int:
    """One process of the smoke test (run by run_smoke_test): prints ``PORT <n>``, reads the
    peer list from stdin, then init, allreduce, shutdown. Exit status 0 when all went right."""
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


def _python_json(python: str, code: str, timeout: float) -> dict | list | None:
    """What ``code`` run by ``python`` prints last, as JSON; None if it fails."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                              timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Per framework: the code that prints its compile flags, link flags and version as JSON.
_FRAMEWORK_FLAGS = {
    "tensorflow": (
        "import json, tensorflow as tf; print(json.dumps({'compile': "
        "tf.sysconfig.get_compile_flags(), 'link': tf.sysconfig.get_link_flags(), "
        "'version': tf.__version__}))"),
    # Only c10's headers and library: the allocator hook needs nothing else of torch.
    "torch": (
        "import json, os, torch; d = os.path.dirname(torch.__file__); print(json.dumps({"
        "'compile': ['-I' + os.path.join(d, 'include'), '-D_GLIBCXX_USE_CXX11_ABI=%d' "
        "% int(torch._C._GLIBCXX_USE_CXX11_ABI)], 'link': ['-L' + os.path.join(d, 'lib'), "
        "'-lc10', '-Wl,-rpath,' + os.path.join(d, 'lib')], 'version': torch.__version__}))"),
}


def _framework_config(framework: str, python: str, build_root: Path) -> dict | None:
    """Compile/link flags and version of the ``framework`` that ``python`` imports, or None.

    Importing a framework takes seconds, so the answer is kept in ``build_root`` under the
    identity of the installation (where ``python`` finds the package, and its ``__init__``'s
    size and modification time: a reinstall rewrites it); finding that imports nothing."""
    identity = _python_json(python, (
        f"import json, os, sys, importlib.util as u; s = u.find_spec('{framework}'); "
        "st = os.stat(s.origin) if s and s.origin else None; "
        "print(json.dumps([sys.executable, s.origin, st.st_size, st.st_mtime_ns] if st "
        "else None))"), timeout=60)
    if identity is None:
        return None
    cache = build_root / f"{framework}_config.json"
    with contextlib.suppress(OSError, ValueError):
        saved = json.loads(cache.read_text())
        if saved.get("identity") == identity:
            return saved["config"]
    config = _python_json(python, _FRAMEWORK_FLAGS[framework], timeout=300)
    if config is not None:
        with contextlib.suppress(OSError):
            build_root.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps({"identity": identity, "config": config}))
    return config


# framework -> (source folder, library, display name, link to the core, what is lost without it,
# whether only its shvd_* functions are exported: the torch allocator is called through them by
# ctypes; TensorFlow registers the ops through the library's static constructors and may look up
# its kernels' symbols, so that library keeps its exports and only hides static archives)
FRAMEWORK_LIBRARIES = {
    "tensorflow": ("tensorflow", TF_LIB_NAME, "TensorFlow", True,
                   "its graph ops (spark_hvd.tensorflow will use tf.numpy_function)", False),
    "torch": ("torch", TORCH_LIB_NAME, "torch", False,
              "its shared-gradient allocator (gradients are copied through the shared segment)",
              True),
}


def build_framework_library(
    framework: str,
    core: Path,
    debug: bool = False,
    verbose: bool = False,
    quiet: bool = False,
    src_dir: str | os.PathLike | None = None,
    build_dir: str | os.PathLike | None = None,
    python: str | None = None,
) -> Path | None:
    """Compile native/<framework>/*.cc against the ``framework`` (``"tensorflow"`` or
    ``"torch"``) that ``python`` (default: this interpreter) imports, into its library next to
    ``core`` (the TensorFlow ops link to the core; the torch allocator gets the core's functions
    from Python).

    Returns the library path, or None when the framework is not importable (nothing to build
    against; the Python adapter then does without). Raises BuildError when the compile fails.
    """
    folder, lib_name, display, link_core, lost, c_exports_only = FRAMEWORK_LIBRARIES[framework]
    src_dir = Path(src_dir or os.environ.get("SPARK_HVD_NATIVE_DIR") or DEFAULT_SRC).resolve()
    build_root = Path(build_dir or DEFAULT_BUILD).resolve()
    sources = sorted((src_dir / folder).glob("*.cc"))
    if not sources:
        return None
    fw = _framework_config(framework, python or sys.executable, build_root)
    if fw is None:
        _log(f"{display} is not importable here: skipping {lost}", quiet)
        return None
    output = Path(core).parent / lib_name
    # The framework's headers as system headers: their own deprecation warnings are not ours.
    fw_compile = [f"-isystem{f[2:]}" if f.startswith("-I") else f for f in fw["compile"]]
    core_link = ([f"-L{output.parent}", f"-l:{LIB_NAME}", "-Wl,-rpath,$ORIGIN"]
                 if link_core else [])
    exports = [f"-Wl,--version-script={_exports_map(src_dir)}"] if c_exports_only else []
    cmd = (
        _compiler() + BASE_FLAGS + (DEBUG_FLAGS if debug else RELEASE_FLAGS) + fw_compile
        + [f"-I{src_dir}", "-shared"] + _env_flags("CXXFLAGS") + [str(s) for s in sources]
        + core_link + ["-Wl,--no-undefined", PRIVATE_ARCHIVES_FLAG] + exports + fw["link"]
        + _env_flags("LDFLAGS")
    )
    inputs = sources + [src_dir / "include" / "spark_hvd.h", src_dir / "common" / "types.h",
                        src_dir / EXPORTS_MAP]
    return _build_library(cmd, output, inputs, build_root, f"{framework}_stamp",
                          f"{framework}={fw['version']}", f"against {display} {fw['version']}",
                          "building", verbose, quiet)


def _build_library(cmd: list[str], output: Path, inputs: list[Path], build_root: Path,
                   stamp_name: str, version: str, note: str, what: str, verbose: bool,
                   quiet: bool) -> Path:
    """Runs ``cmd`` (one compile-and-link step) into ``output`` unless the library is up to
    date: built by the same command (``version`` too, recorded in ``stamp_name``) and newer
    than every one of ``inputs``. ``note`` says what it was built with."""
    stamp = build_root / stamp_name
    signature = " ".join(cmd) + f"\n{version}\n"
    with _lock(build_root):
        if (output.exists() and stamp.exists() and stamp.read_text() == signature
                and max(p.stat().st_mtime for p in inputs if p.exists())
                <= output.stat().st_mtime):
            _log(f"{_display(output)} up to date ({note})", quiet)
            return output
        t0 = time.monotonic()
        _produce(cmd, output, what, verbose)
        stamp.write_text(signature)
        _log(f"built {_display(output)} {note} in {time.monotonic() - t0:.1f}s", quiet)
    return output


def _mpi_wrapper_flags(wrapper: str) -> tuple[list[str], list[str]] | None:
    """(compile flags, link flags) of the MPI compiler wrapper ``wrapper``, or None when it
    cannot say (then the wrapper compiles the plugin itself)."""
    for compile_q, link_q in (("--showme:compile", "--showme:link"),  # Open MPI
                              ("-compile_info", "-link_info")):      # MPICH, Intel MPI
        try:
            got = [subprocess.run([wrapper, q], capture_output=True, text=True, timeout=30)
                   for q in (compile_q, link_q)]
        except (OSError, subprocess.TimeoutExpired):
            return None
        if all(p.returncode == 0 and p.stdout.strip() for p in got):
            compile_flags, link_flags = (shlex.split(p.stdout) for p in got)
            if compile_q == "-compile_info":  # MPICH prints the whole command, compiler first
                compile_flags = [f for f in compile_flags[1:] if f.startswith(("-I", "-D"))]
                link_flags = [f for f in link_flags[1:] if f.startswith(("-L", "-l", "-Wl"))]
            return compile_flags, link_flags
    return None


def _mpi_headers_present(cmd: list[str]) -> bool:
    """True when ``cmd`` (a compiler with MPI's compile flags) finds ``mpi.h``."""
    try:
        proc = subprocess.run(cmd + ["-E", "-x", "c++", "-"], input="#include <mpi.h>\n",
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def build_mpi_plugin(core: Path, debug: bool = False, verbose: bool = False, quiet: bool = False,
                     src_dir: str | os.PathLike | None = None,
                     build_dir: str | os.PathLike | None = None) -> Path | None:
    """Compile native/mpi/plugin/*.cc against the installed MPI into libspark_hvd_mpi.so next
    to ``core`` (the module docstring says why it is a library of its own).

    Returns the library path, or None when no MPI with headers is installed (the wrapper,
    ``MPICXX`` or ``mpicxx``, is missing or finds no ``mpi.h``): the core does without, and
    ``HOROVOD_CPU_OPERATIONS=MPI`` is refused at init. Raises BuildError when the compile
    fails."""
    src_dir = Path(src_dir or os.environ.get("SPARK_HVD_NATIVE_DIR") or DEFAULT_SRC).resolve()
    build_root = Path(build_dir or DEFAULT_BUILD).resolve()
    sources = sorted(src_dir.joinpath(*MPI_PLUGIN_DIR).glob("*.cc"))
    output = Path(core).parent / MPI_LIB_NAME
    if not sources:
        return None
    wrapper = os.environ.get("MPICXX") or "mpicxx"
    if shutil.which(wrapper) is None:
        _log(f"no MPI compiler wrapper ({wrapper}) on PATH: skipping the MPI plugin "
             "(HOROVOD_CPU_OPERATIONS=MPI needs it)", quiet)
        return None
    flags = _mpi_wrapper_flags(wrapper)
    if flags is None:
        compiler, mpi_compile, mpi_link = [wrapper], [], []
    else:
        compiler, (mpi_compile, mpi_link) = _compiler(), flags
    # MPI's headers as system headers: their own warnings are not ours. The plugin uses MPI's
    # C API only: no C++ bindings (Open MPI's libmpi_cxx) to compile or link.
    mpi_compile = ([f"-isystem{f[2:]}" if f.startswith("-I") else f for f in mpi_compile]
                   + ["-DOMPI_SKIP_MPICXX=1", "-DMPICH_SKIP_MPICXX=1"])
    mpi_link = [f for f in mpi_link if f != "-lmpi_cxx"]
    if not _mpi_headers_present(compiler + mpi_compile):
        _log(f"{wrapper} finds no mpi.h (install MPI's development package, e.g. "
             "libopenmpi-dev): skipping the MPI plugin", quiet)
        return None
    # Only its shvd_mpi_plugin_* functions are exported (exports.map).
    cmd = (
        compiler + BASE_FLAGS + (DEBUG_FLAGS if debug else RELEASE_FLAGS) + HIDDEN_FLAGS
        + mpi_compile + [f"-I{src_dir}", "-shared"] + _env_flags("CXXFLAGS")
        + [str(p) for p in sources]
        + ["-Wl,--no-undefined", f"-Wl,--version-script={_exports_map(src_dir)}",
           PRIVATE_ARCHIVES_FLAG] + mpi_link
        + _env_flags("LDFLAGS")
    )
    inputs = sources + [src_dir / "mpi" / "plugin_api.h", src_dir / "include" / "spark_hvd.h"]
    return _build_library(cmd, output, inputs, build_root, "mpi_stamp", "mpi",
                          f"with {wrapper}", "building the MPI plugin", verbose, quiet)


def _display(p: Path) -> str:
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def clean(build_dir: str | os.PathLike | None = None, output: str | os.PathLike | None = None,
          quiet: bool = False) -> None:
    build_root = Path(build_dir or DEFAULT_BUILD).resolve()
    output = Path(output or DEFAULT_OUT).resolve()
    if build_root.exists():
        shutil.rmtree(build_root)
        _log(f"removed {_display(build_root)}", quiet)
    for lib in (output, output.parent / TF_LIB_NAME, output.parent / TORCH_LIB_NAME,
                output.parent / MPI_LIB_NAME):
        if lib.exists():
            lib.unlink()
            _log(f"removed {_display(lib)}", quiet)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the spark_hvd native core.")
    ap.add_argument("--debug", action="store_true", help="-O0 -g instead of -O3")
    ap.add_argument("--asan", action="store_true", help="debug build with AddressSanitizer")
    ap.add_argument("--clean", action="store_true", help="remove objects and the library")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (default 2)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every command")
    ap.add_argument("-q", "--quiet", action="store_true", help="print only warnings and errors")
    ap.add_argument("--no-tensorflow", action="store_true",
                    help="skip the TensorFlow op library even when TensorFlow is importable")
    ap.add_argument("--no-torch", action="store_true",
                    help="skip the torch allocator library even when torch is importable")
    ap.add_argument("--no-mpi", action="store_true",
                    help="skip the MPI plugin even when MPI is installed")
    ap.add_argument("--src", default=None, help="source tree (default native/)")
    ap.add_argument("--build-dir", default=None, help="object directory (default build/native/)")
    ap.add_argument("--output", default=None, help=f"library path (default spark_hvd/_core/{LIB_NAME})")
    ap.add_argument("--no-smoke-test", action="store_true",
                    help="install the core without running two processes with it first (cross "
                         f"builds; also {SKIP_SMOKE_TEST_ENV}=1)")
    args = ap.parse_args(argv)

    if args.clean:
        clean(args.build_dir, args.output, args.quiet)
        return 0
    try:
        core = build(debug=args.debug, asan=args.asan, jobs=args.jobs, verbose=args.verbose,
                     quiet=args.quiet, src_dir=args.src, build_dir=args.build_dir,
                     output=args.output, smoke_test=False if args.no_smoke_test else None)
        for framework, skip in (("tensorflow", args.no_tensorflow), ("torch", args.no_torch)):
            if core is not None and not skip and not args.asan:
                build_framework_library(framework, core, debug=args.debug, verbose=args.verbose,
                                        quiet=args.quiet, src_dir=args.src,
                                        build_dir=args.build_dir)
        if core is not None and not args.no_mpi and not args.asan:
            build_mpi_plugin(core, debug=args.debug, verbose=args.verbose, quiet=args.quiet,
                             src_dir=args.src, build_dir=args.build_dir)
    except BuildError as e:
        print(f"[build] ERROR: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
