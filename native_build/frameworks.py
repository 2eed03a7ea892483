"""The framework libraries next to the core: TensorFlow's graph ops (native/tensorflow/ ->
libspark_hvd_tf.so) and torch's shared-gradient allocator (native/torch/ ->
libspark_hvd_torch_<major>_<minor>.so).

The TensorFlow library is written against TensorFlow's C API (native/tensorflow/tf_c_api.h
declares what it uses), so it needs no TensorFlow to build and one binary serves TensorFlow 2.16
and later. It is linked against a stub libtensorflow_framework.so.2 made here from those
declarations: the library then names libtensorflow_framework.so.2 as needed, which TensorFlow has
loaded by the time tf.load_op_library opens it, and carries no path to it.

The torch allocator subclasses c10::Allocator, torch's C++ class, so it is built per torch minor
against that torch's headers (the torch the building interpreter imports; more from torch wheel
files named in SPARK_HVD_TORCH_WHEELS), always with a libstdc++ compiler (g++ unless
SPARK_HVD_TORCH_CXX says otherwise): torch's classes hold libstdc++'s std::unique_ptr.
spark_hvd.torch loads the one for the running torch's minor, and without one copies gradients
through the shared segment and says so.

A library is rebuilt when its sources (or that torch's version) change. torch's flags are asked
for once per installation and kept in the build folder (importing torch takes seconds). Without
the TensorFlow library spark_hvd.tensorflow runs graph collectives as tf.numpy_function nodes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

from .layout import (DEFAULT_BUILD, EXPORTS_MAP, LIB_NAME, TF_LIB_NAME, TORCH_LIB_PATTERN,
                     exports_map, source_dir)
from .toolchain import (BASE_FLAGS, DEBUG_FLAGS, HIDDEN_FLAGS, PRIVATE_ARCHIVES_FLAG,
                        RELEASE_FLAGS, STRIP_FLAGS, TOOLCHAIN_ENV, build_library, compiler,
                        env_flags, log, private_archives, produce, strip_libraries)


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


# Per framework: the code that prints its compile flags, link flags and version as JSON. Only
# c10's headers and library for torch: the allocator hook needs nothing else. No run path: the
# library is loaded after torch, which has loaded libc10.so.
_FRAMEWORK_FLAGS = {
    "torch": (
        "import json, os, torch; d = os.path.dirname(torch.__file__); print(json.dumps({"
        "'compile': ['-I' + os.path.join(d, 'include'), '-D_GLIBCXX_USE_CXX11_ABI=%d' "
        "% int(torch._C._GLIBCXX_USE_CXX11_ABI)], 'link': ['-L' + os.path.join(d, 'lib'), "
        "'-lc10'], 'version': torch.__version__}))"),
}


def framework_config(framework: str, python: str, build_root: Path) -> dict | None:
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


def torch_library_name(version: str) -> str:
    """The torch allocator's file for torch ``version`` (``2.13.0+cpu`` -> its minor 2.13)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return TORCH_LIB_PATTERN.format(major=major, minor=minor)


# framework -> (display name, what is lost without it)
FRAMEWORK_LIBRARIES = {
    "tensorflow": ("TensorFlow", "its graph ops (spark_hvd.tensorflow will use tf.numpy_function)"),
    "torch": ("torch",
              "its shared-gradient allocator (gradients are copied through the shared segment)"),
}

# TensorFlow's library that holds its C API, named by the op library, and whose functions the
# stub defines.
TF_FRAMEWORK_SONAME = "libtensorflow_framework.so.2"
_C_FUNCTION = re.compile(r"^[A-Za-z_][\w\s\*]*?\b(TF_\w+)\(", re.M)


def _tf_stub(header: Path, build_root: Path, verbose: bool) -> Path:
    """A stub libtensorflow_framework.so.2 defining every function ``header`` declares, to link
    the op library against (never installed: TensorFlow's own is there at run time)."""
    names = sorted(set(_C_FUNCTION.findall(header.read_text())))
    stub_dir = build_root / "tf_stub"
    stub_dir.mkdir(parents=True, exist_ok=True)
    source = stub_dir / "stub.c"
    text = "".join(f"void {n}(void) {{}}\n" for n in names)
    lib = stub_dir / TF_FRAMEWORK_SONAME
    if not lib.exists() or not source.exists() or source.read_text() != text:
        source.write_text(text)
        produce(compiler() + ["-x", "c", "-shared", "-fPIC", f"-Wl,-soname,{TF_FRAMEWORK_SONAME}",
                              str(source)], lib, "building the stub", verbose)
    return lib


def _build_tensorflow(core: Path, src_dir: Path, build_root: Path, debug: bool, verbose: bool,
                      quiet: bool) -> Path | None:
    sources = sorted((src_dir / "tensorflow").glob("*.cc"))
    if not sources:
        return None
    output = Path(core).parent / TF_LIB_NAME
    header = src_dir / "tensorflow" / "tf_c_api.h"
    stub = _tf_stub(header, build_root, verbose)
    # Exports nothing but what TensorFlow looks for (its ops and kernels register themselves in
    # static constructors): hidden symbols, the C++ runtime private.
    cmd = (
        compiler() + BASE_FLAGS + (DEBUG_FLAGS if debug else RELEASE_FLAGS) + HIDDEN_FLAGS
        + [f"-I{src_dir}", "-shared"] + env_flags("CXXFLAGS") + [str(s) for s in sources]
        + [f"-L{output.parent}", f"-l:{LIB_NAME}", "-Wl,-rpath,$ORIGIN",
           f"-L{stub.parent}", f"-l:{TF_FRAMEWORK_SONAME}", "-ldl", "-Wl,--no-undefined",
           f"-Wl,--version-script={exports_map(src_dir)}"] + private_archives()
        + (STRIP_FLAGS if strip_libraries() else []) + env_flags("LDFLAGS")
    )
    inputs = sources + [header, src_dir / "include" / "spark_hvd.h", src_dir / EXPORTS_MAP]
    return build_library(cmd, output, inputs, build_root, "tensorflow_stamp", "c-api",
                         "on TensorFlow's C API", "building", verbose, quiet)


def _torch_from_wheel(wheel: Path, build_root: Path) -> dict | None:
    """The compile/link flags and version of the torch in the wheel file ``wheel``: its headers
    and libc10.so unpacked under ``build_root`` (once per wheel)."""
    m = re.match(r"torch-([0-9][^-]*)-", wheel.name)
    if m is None or not wheel.is_file():
        return None
    dest = build_root / f"torch-{m.group(1)}"
    done = dest / ".unpacked"
    if not done.exists():
        with zipfile.ZipFile(wheel) as z:
            members = [n for n in z.namelist() if n.startswith("torch/include/")
                       or n == "torch/lib/libc10.so"]
            z.extractall(dest, members)
        done.write_text(wheel.name)
    d = dest / "torch"
    return {"compile": [f"-I{d / 'include'}", "-D_GLIBCXX_USE_CXX11_ABI=1"],
            "link": [f"-L{d / 'lib'}", "-lc10"], "version": m.group(1)}


def torch_compiler() -> list[str]:
    """The compiler of the torch allocator: one with libstdc++, whose types torch's classes
    hold. SPARK_HVD_TORCH_CXX, else g++ for the wheel (zig's clang brings libc++), else CXX."""
    if os.environ.get("SPARK_HVD_TORCH_CXX"):
        return shlex.split(os.environ["SPARK_HVD_TORCH_CXX"])
    return ["g++"] if os.environ.get(TOOLCHAIN_ENV) == "zig" else compiler()


def _build_torch(core: Path, src_dir: Path, build_root: Path, debug: bool, verbose: bool,
                 quiet: bool, python: str) -> list[Path]:
    sources = sorted((src_dir / "torch").glob("*.cc"))
    if not sources:
        return []
    configs = []
    fw = framework_config("torch", python, build_root)
    if fw is not None:
        configs.append(fw)
    for w in filter(None, os.environ.get("SPARK_HVD_TORCH_WHEELS", "").split(os.pathsep)):
        got = _torch_from_wheel(Path(w), build_root)
        if got is None:
            log(f"SPARK_HVD_TORCH_WHEELS: {w} is not a torch wheel file: skipped", quiet)
        else:
            configs.append(got)
    if not configs:
        log(f"torch is not importable here: skipping {FRAMEWORK_LIBRARIES['torch'][1]}", quiet)
        return []
    built = {}
    for fw in configs:
        name = torch_library_name(fw["version"])
        if name in built:
            continue
        output = Path(core).parent / name
        fw_compile = [f"-isystem{f[2:]}" if f.startswith("-I") else f for f in fw["compile"]]
        cmd = (
            torch_compiler() + BASE_FLAGS + (DEBUG_FLAGS if debug else RELEASE_FLAGS)
            + fw_compile + [f"-I{src_dir}", "-shared"] + env_flags("CXXFLAGS")
            + [str(s) for s in sources] + ["-Wl,--no-undefined", PRIVATE_ARCHIVES_FLAG,
                                           f"-Wl,--version-script={exports_map(src_dir)}"]
            + fw["link"] + (STRIP_FLAGS if strip_libraries() else []) + env_flags("LDFLAGS")
        )
        inputs = sources + [src_dir / EXPORTS_MAP]
        built[name] = build_library(cmd, output, inputs, build_root, f"{name}.stamp",
                                    f"torch={fw['version']}", f"against torch {fw['version']}",
                                    "building", verbose, quiet)
    return list(built.values())


def build_framework_library(
    framework: str,
    core: Path,
    debug: bool = False,
    verbose: bool = False,
    quiet: bool = False,
    src_dir: str | os.PathLike | None = None,
    build_dir: str | os.PathLike | None = None,
    python: str | None = None,
) -> list[Path]:
    """Builds ``framework``'s library (``"tensorflow"`` or ``"torch"``) next to ``core``: the
    TensorFlow op library on TensorFlow's C API (no TensorFlow needed), the torch allocator once
    per torch minor found (the torch ``python``, default this interpreter, imports, and
    SPARK_HVD_TORCH_WHEELS). Returns the libraries built (none when there is nothing to build
    against: the Python adapter then does without). Raises BuildError when a compile fails."""
    src_dir = source_dir(src_dir)
    build_root = Path(build_dir or DEFAULT_BUILD).resolve()
    if framework == "tensorflow":
        lib = _build_tensorflow(core, src_dir, build_root, debug, verbose, quiet)
        return [lib] if lib is not None else []
    return _build_torch(core, src_dir, build_root, debug, verbose, quiet,
                        python or sys.executable)
