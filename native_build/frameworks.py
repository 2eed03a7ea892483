"""The framework libraries, each built against the framework that the building interpreter
imports: TensorFlow's graph ops (native/tensorflow/ -> libspark_hvd_tf.so, on its headers and
libtensorflow_framework) and torch's shared-gradient allocator (native/torch/ ->
libspark_hvd_torch.so, on c10's headers), next to the core.

A library is rebuilt when that framework's version or its sources change. The framework's flags
are asked for once per installation and kept in the build folder (importing TensorFlow takes
seconds; a build with nothing to do takes a fraction of one). Both are optional: without the
TensorFlow library spark_hvd.tensorflow runs graph collectives as tf.numpy_function nodes;
without the torch one gradients stay in torch's own memory (and are copied through the shared
segment)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from .layout import (DEFAULT_BUILD, EXPORTS_MAP, LIB_NAME, TF_LIB_NAME, TORCH_LIB_NAME,
                     exports_map, source_dir)
from .toolchain import (BASE_FLAGS, DEBUG_FLAGS, PRIVATE_ARCHIVES_FLAG, RELEASE_FLAGS,
                        build_library, compiler, env_flags, log)


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
    src_dir = source_dir(src_dir)
    build_root = Path(build_dir or DEFAULT_BUILD).resolve()
    sources = sorted((src_dir / folder).glob("*.cc"))
    if not sources:
        return None
    fw = framework_config(framework, python or sys.executable, build_root)
    if fw is None:
        log(f"{display} is not importable here: skipping {lost}", quiet)
        return None
    output = Path(core).parent / lib_name
    # The framework's headers as system headers: their own deprecation warnings are not ours.
    fw_compile = [f"-isystem{f[2:]}" if f.startswith("-I") else f for f in fw["compile"]]
    core_link = ([f"-L{output.parent}", f"-l:{LIB_NAME}", "-Wl,-rpath,$ORIGIN"]
                 if link_core else [])
    exports = [f"-Wl,--version-script={exports_map(src_dir)}"] if c_exports_only else []
    cmd = (
        compiler() + BASE_FLAGS + (DEBUG_FLAGS if debug else RELEASE_FLAGS) + fw_compile
        + [f"-I{src_dir}", "-shared"] + env_flags("CXXFLAGS") + [str(s) for s in sources]
        + core_link + ["-Wl,--no-undefined", PRIVATE_ARCHIVES_FLAG] + exports + fw["link"]
        + env_flags("LDFLAGS")
    )
    inputs = sources + [src_dir / "include" / "spark_hvd.h", src_dir / "common" / "types.h",
                        src_dir / EXPORTS_MAP]
    return build_library(cmd, output, inputs, build_root, f"{framework}_stamp",
                         f"{framework}={fw['version']}", f"against {display} {fw['version']}",
                         "building", verbose, quiet)
