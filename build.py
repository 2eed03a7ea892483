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
    python build.py --no-tensorflow --no-torch   # the core only
    python build.py -j 4 -v       # 4 parallel compiles, print every command

Environment: CXX (compiler, default g++), CXXFLAGS / LDFLAGS (appended), SPARK_HVD_BUILD_JOBS,
SPARK_HVD_NATIVE_DIR (source tree, default ./native; used for testing the build itself).
setup.py imports build() from here, so `pip install .` / `pip install -e .` build the library.

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
import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
LIB_NAME = "libspark_hvd_core.so"
TF_LIB_NAME = "libspark_hvd_tf.so"
TORCH_LIB_NAME = "libspark_hvd_torch.so"
DEFAULT_SRC = ROOT / "native"
DEFAULT_BUILD = ROOT / "build" / "native"
DEFAULT_OUT = ROOT / "spark_hvd" / "_core" / LIB_NAME

HEADER_SUFFIXES = (".h", ".hpp", ".hh", ".inc", ".ipp")

BASE_FLAGS = ["-std=c++17", "-fPIC", "-pthread", "-Wall"]
RELEASE_FLAGS = ["-O3", "-DNDEBUG"]
DEBUG_FLAGS = ["-O0", "-g"]
ASAN_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer"]
LINK_LIBS = ["-pthread", "-lrt", "-ldl"]


class BuildError(RuntimeError):
    """A compile or link step failed; the message holds the compiler output."""


def _log(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"[build] {msg}", flush=True)


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CXX", "g++"))


def _env_flags(name: str) -> list[str]:
    return shlex.split(os.environ.get(name, ""))


# Standalone test programs (with their own main) live in tests/ and are built by their tests;
# tensorflow/ and torch/ hold the framework libraries (build_framework_library), not the core.
EXCLUDED_DIRS = ("tests", "tensorflow", "torch")


def _sources(src_dir: Path) -> list[Path]:
    if not src_dir.is_dir():
        return []
    return sorted(p for p in src_dir.rglob("*.cc")
                  if p.is_file() and p.relative_to(src_dir).parts[0] not in EXCLUDED_DIRS)


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


def _produce(cmd: list[str], output: Path, what: str, verbose: bool) -> None:
    """Runs ``cmd -o <temp>`` and renames the temp file over ``output``, so that processes which
    already loaded the old library are not disturbed and a failure leaves the old one."""
    tmp = output.with_name(output.name + f".tmp{os.getpid()}")
    cmd = cmd + ["-o", str(tmp)]
    if verbose:
        print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise BuildError(f"{what} {output.name} failed (exit {proc.returncode}):\n{out}")
    if out:
        print(f"[build] {what} {output.name}:\n{out}", flush=True)
    os.replace(tmp, output)


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
) -> Path | None:
    """Compile and link the core. Returns the library path, or None when there are no sources.

    Raises BuildError with the compiler's output when a step fails.
    """
    src_dir = Path(src_dir or os.environ.get("SPARK_HVD_NATIVE_DIR") or DEFAULT_SRC).resolve()
    build_root = Path(build_dir or DEFAULT_BUILD).resolve()
    output = Path(output or DEFAULT_OUT).resolve()
    if jobs is None:
        jobs = int(os.environ.get("SPARK_HVD_BUILD_JOBS", "2"))
    jobs = max(1, jobs)
    if asan:
        debug = True

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
        + ["-shared", f"-Wl,-soname,{LIB_NAME}", "-Wl,--no-undefined"]
        + (ASAN_FLAGS if asan else [])
        + _env_flags("LDFLAGS")
    )

    with _lock(build_root):
        obj_root.mkdir(parents=True, exist_ok=True)
        # Different flags (or compiler) invalidate every object of this variant.
        flags_file = obj_root / "flags"
        flags_sig = " ".join(compile_cmd) + f"\nsrc={src_dir}\n"
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
                futures = [pool.submit(_compile_one, compile_cmd, s, o, verbose) for s, o in todo]
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

        # Relink when an object is newer than the library, or the library came from another
        # variant / object set (recorded in link_stamp).
        link_stamp = build_root / "link_stamp"
        link_cmd = link_cmd_base + [str(o) for o in objects] + LINK_LIBS
        link_sig = " ".join(link_cmd) + f"\nout={output}\n"
        need_link = (
            bool(todo)
            or not output.exists()
            or not link_stamp.exists()
            or link_stamp.read_text() != link_sig
            or max(o.stat().st_mtime for o in objects) > output.stat().st_mtime
        )
        if need_link:
            _produce(link_cmd, output, "linking", verbose)
            link_stamp.write_text(link_sig)
            _log(f"linked {_display(output)} in {time.monotonic() - t0:.1f}s", quiet)
        else:
            _log(f"{_display(output)} up to date", quiet)
    return output


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


# framework -> (source folder, library, display name, link to the core, what is lost without it)
FRAMEWORK_LIBRARIES = {
    "tensorflow": ("tensorflow", TF_LIB_NAME, "TensorFlow", True,
                   "its graph ops (spark_hvd.tensorflow will use tf.numpy_function)"),
    "torch": ("torch", TORCH_LIB_NAME, "torch", False,
              "its shared-gradient allocator (gradients are copied through the shared segment)"),
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
    folder, lib_name, display, link_core, lost = FRAMEWORK_LIBRARIES[framework]
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
    cmd = (
        _compiler() + BASE_FLAGS + (DEBUG_FLAGS if debug else RELEASE_FLAGS) + fw_compile
        + [f"-I{src_dir}", "-shared"] + _env_flags("CXXFLAGS") + [str(s) for s in sources]
        + core_link + ["-Wl,--no-undefined"] + fw["link"] + _env_flags("LDFLAGS")
    )
    inputs = sources + [src_dir / "include" / "spark_hvd.h", src_dir / "common" / "types.h"]
    stamp = build_root / f"{framework}_stamp"
    signature = " ".join(cmd) + f"\n{framework}={fw['version']}\n"
    with _lock(build_root):
        if (output.exists() and stamp.exists() and stamp.read_text() == signature
                and max(p.stat().st_mtime for p in inputs if p.exists())
                <= output.stat().st_mtime):
            _log(f"{_display(output)} up to date ({display} {fw['version']})", quiet)
            return output
        t0 = time.monotonic()
        _produce(cmd, output, "building", verbose)
        stamp.write_text(signature)
        _log(f"built {_display(output)} against {display} {fw['version']} in "
             f"{time.monotonic() - t0:.1f}s", quiet)
    return output


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
    for lib in (output, output.parent / TF_LIB_NAME, output.parent / TORCH_LIB_NAME):
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
    ap.add_argument("--src", default=None, help="source tree (default native/)")
    ap.add_argument("--build-dir", default=None, help="object directory (default build/native/)")
    ap.add_argument("--output", default=None, help=f"library path (default spark_hvd/_core/{LIB_NAME})")
    args = ap.parse_args(argv)

    if args.clean:
        clean(args.build_dir, args.output, args.quiet)
        return 0
    try:
        core = build(debug=args.debug, asan=args.asan, jobs=args.jobs, verbose=args.verbose,
                     quiet=args.quiet, src_dir=args.src, build_dir=args.build_dir,
                     output=args.output)
        for framework, skip in (("tensorflow", args.no_tensorflow), ("torch", args.no_torch)):
            if core is not None and not skip and not args.asan:
                build_framework_library(framework, core, debug=args.debug, verbose=args.verbose,
                                        quiet=args.quiet, src_dir=args.src,
                                        build_dir=args.build_dir)
    except BuildError as e:
        print(f"[build] ERROR: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
