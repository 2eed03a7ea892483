"""The core library: native/**/*.cc (but native/tests, the framework folders and the MPI plugin)
into spark_hvd/_core/libspark_hvd_core.so.

It is a plain C-ABI shared object loaded with ctypes: it needs no Python headers, torch or
TensorFlow, so one build serves every framework and Python version. Builds are incremental:
objects live under build/native/<variant>/, and a source is recompiled when it, or any header it
included last time (gcc -MMD dependency files), is newer than its object, or when the compiler
flags changed. Objects compile in parallel; the link writes a temporary file and renames it over
the old library, so processes that already loaded the old one are not disturbed.

The core exports its C API (the shvd_* functions) and nothing else: its sources are compiled
-fvisibility=hidden (c_api.cc, which defines the API, excepted) and linked with the version script
native/exports.map, so a C++ runtime linked in statically stays private. A freshly linked core
is installed only after the smoke test (smoke.py)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from .layout import (API_SOURCES, DEFAULT_BUILD, DEFAULT_OUT, HEADER_SUFFIXES, LIB_NAME,
                     MPI_PLUGIN_DIR, exports_map, source_dir)
from .smoke import SKIP_SMOKE_TEST_ENV, run_smoke_test
from .toolchain import (API_SOURCE_FLAGS, ASAN_FLAGS, BASE_FLAGS, DEBUG_FLAGS, HIDDEN_FLAGS,
                        LINK_LIBS, RELEASE_FLAGS, STRIP_FLAGS, BuildError, compile_object,
                        compiler, compiler_version, display, env_flags, lock, log, produce,
                        strip_libraries, TOOLCHAIN_ENV, ZIG_GLIBC, zig_toolchain)

# Standalone test programs (with their own main) live in tests/ and are built by their tests
# (cpp_tests.py); tensorflow/ and torch/ hold the framework libraries (frameworks.py), not the
# core.
EXCLUDED_DIRS = ("tests", "tensorflow", "torch")


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
    (:func:`smoke.run_smoke_test`), unless ``smoke_test`` is False (default: True unless
    ``SPARK_HVD_SKIP_SMOKE_TEST`` is set). An up-to-date library that has not passed it yet
    (built with the test skipped) is tested, and removed if it fails.

    Raises BuildError with the compiler's output when a step fails, or with what to do when the
    smoke test fails.
    """
    src_dir = source_dir(src_dir)
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
        log(f"no .cc sources under {src_dir}; nothing to build", quiet)
        return None

    cxx = compiler()
    if shutil.which(cxx[0]) is None:
        raise BuildError(f"C++ compiler {cxx[0]!r} not found; install g++ or set CXX")
    if len(cxx) > 2 and cxx[1:3] == ["-m", "ziglang"] and subprocess.run(
            cxx[:3] + ["version"], capture_output=True).returncode != 0:
        raise BuildError(f"{TOOLCHAIN_ENV}=zig needs the ziglang package in {cxx[0]} "
                         "(pip install ziglang)")
    version = compiler_version(tuple(cxx))
    log(f"compiler: {version} (CXX={' '.join(cxx)})", quiet)
    exports = exports_map(src_dir)

    flags = (
        BASE_FLAGS
        + (DEBUG_FLAGS if debug else RELEASE_FLAGS)
        + (ASAN_FLAGS if asan else [])
        + [f"-I{src_dir}", f"-I{src_dir / 'include'}"]
        + env_flags("CXXFLAGS")
    )
    compile_cmd = cxx + flags
    link_cmd_base = (
        cxx
        + ["-shared", f"-Wl,-soname,{LIB_NAME}", "-Wl,--no-undefined",
           f"-Wl,--version-script={exports}"]
        + (ASAN_FLAGS if asan else [])
        + (STRIP_FLAGS if strip_libraries() and not debug else [])
        + env_flags("LDFLAGS")
    )

    def visibility_flags(src: Path) -> list[str]:
        return API_SOURCE_FLAGS if src.relative_to(src_dir).as_posix() in API_SOURCES \
            else HIDDEN_FLAGS

    def verify(library: Path) -> None:
        seconds = run_smoke_test(library, src_dir / "include" / "spark_hvd.h", asan=asan)
        log(f"smoke test passed: 2 processes ran init, allreduce and shutdown with "
            f"{library.name.split('.tmp')[0]} in {seconds:.1f}s", quiet)

    with lock(build_root):
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
            log(f"compiling {len(todo)} of {len(sources)} sources ({variant}, -j{jobs})", quiet)
            for _, obj in todo:
                obj.parent.mkdir(parents=True, exist_ok=True)
            errors: list[str] = []
            with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
                futures = [pool.submit(compile_object, compile_cmd + visibility_flags(s), s, o,
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
                        log(f"  ok {src.relative_to(src_dir)}", quiet)
            if errors:
                raise BuildError(
                    "\n\n".join(errors) + f"\n\n[build] {len(errors)} of {len(todo)} sources failed"
                )
            flags_file.write_text(flags_sig)
        else:
            log(f"all {len(sources)} objects up to date ({variant})", quiet)

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
            produce(link_cmd, output, "linking", verbose, verify if smoke_test else None)
            link_stamp.write_text(link_sig)
            write_build_info(output, version)
            log(f"linked {display(output)} in {time.monotonic() - t0:.1f}s", quiet)
        else:
            log(f"{display(output)} up to date", quiet)
            if not (output.parent / BUILD_INFO).exists():
                write_build_info(output, version)
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
            log("smoke test skipped (--no-smoke-test / SPARK_HVD_SKIP_SMOKE_TEST)", quiet)
    return output


BUILD_INFO = "build_info.json"


def write_build_info(core: Path, compiler_line: str) -> None:
    """Records next to the core which compiler built it, for ``spark-hvd-run --check-build``."""
    info = {"compiler": compiler_line,
            "toolchain": "zig" if zig_toolchain() else "cxx",
            "glibc": ZIG_GLIBC if zig_toolchain() else None}
    (core.parent / BUILD_INFO).write_text(json.dumps(info) + "\n")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _file_identity(path: Path) -> str:
    st = path.stat()
    return f"{path} {st.st_ino} {st.st_size} {st.st_mtime_ns}\n"
