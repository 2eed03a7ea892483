"""The MPI plugin: native/mpi/plugin/*.cc into libspark_hvd_mpi_<abi>.so next to the core, once
per MPI ABI whose headers are installed: ``openmpi`` (Open MPI's libmpi.so.40, found through
``mpicxx.openmpi``) and ``mpich`` (MPICH's libmpich.so.12, through ``mpicxx.mpich``; Intel MPI
and MVAPICH share its ABI), or the one that ``MPICXX`` (default ``mpicxx``) belongs to where
neither named wrapper exists. Each is built with its wrapper's compile and link flags
(``--showme:compile`` / ``--showme:link`` of Open MPI, ``-compile_info`` / ``-link_info`` of
MPICH; failing those, the wrapper itself compiles). spark_hvd.common._mpi picks the one of the
MPI that mpi4py loaded, as mpi4py's own wheels do. MPI itself is never copied next to it: each
plugin names its MPI library, which mpi4py has loaded by the time the core opens the plugin.

It is a separate library, not part of the core, so that the core never links MPI: the core must
build, load and run on machines without MPI, and a core linked to libmpi would fail to load
wherever that library (or the version it was built against) is missing, and would pull MPI into
every process that only uses the TCP transport. The core dlopens the plugin at init only for
``HOROVOD_CPU_OPERATIONS=MPI``; by then mpi4py has loaded and initialised the very libmpi the
plugin links to. Without MPI the plugin is skipped with a note (``mpi_built()`` is then False);
``build.py --no-mpi`` skips it."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

from .layout import DEFAULT_BUILD, MPI_LIB_PATTERN, MPI_PLUGIN_DIR, exports_map, source_dir
from .toolchain import (BASE_FLAGS, DEBUG_FLAGS, HIDDEN_FLAGS, RELEASE_FLAGS,
                        STRIP_FLAGS, build_library, compiler, env_flags, log,
                        private_archives, strip_libraries)

# ABI -> the wrapper that names it (Debian and Ubuntu install both beside the chosen mpicxx).
NAMED_WRAPPERS = {"openmpi": "mpicxx.openmpi", "mpich": "mpicxx.mpich"}


def _mpi_wrapper_flags(wrapper: str) -> tuple[str, list[str], list[str]] | None:
    """(ABI, compile flags, link flags) of the MPI compiler wrapper ``wrapper``, or None when it
    cannot say (then the wrapper compiles the plugin itself, and is taken for Open MPI)."""
    for abi, compile_q, link_q in (("openmpi", "--showme:compile", "--showme:link"),
                                   ("mpich", "-compile_info", "-link_info")):  # Intel MPI too
        try:
            got = [subprocess.run([wrapper, q], capture_output=True, text=True, timeout=30)
                   for q in (compile_q, link_q)]
        except (OSError, subprocess.TimeoutExpired):
            return None
        if all(p.returncode == 0 and p.stdout.strip() for p in got):
            compile_flags, link_flags = (shlex.split(p.stdout) for p in got)
            if compile_q == "-compile_info":  # MPICH prints the whole command, compiler first
                compile_flags = [f for f in compile_flags[1:] if f.startswith(("-I", "-D"))]
                link_flags = [f for f in link_flags[1:] if f.startswith(("-L", "-l"))]
            return abi, compile_flags, link_flags
    return None


def _mpi_headers_present(cmd: list[str]) -> bool:
    """True when ``cmd`` (a compiler with MPI's compile flags) finds ``mpi.h``."""
    try:
        proc = subprocess.run(cmd + ["-E", "-x", "c++", "-"], input="#include <mpi.h>\n",
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def _wrappers() -> list[str]:
    named = [w for w in NAMED_WRAPPERS.values() if shutil.which(w)]
    return named or [os.environ.get("MPICXX") or "mpicxx"]


def build_mpi_plugin(core: Path, debug: bool = False, verbose: bool = False, quiet: bool = False,
                     src_dir: str | os.PathLike | None = None,
                     build_dir: str | os.PathLike | None = None) -> list[Path]:
    """Compiles native/mpi/plugin/*.cc against each installed MPI ABI into
    libspark_hvd_mpi_<abi>.so next to ``core`` (the module docstring says why it is a library of
    its own). Returns the plugins built: none where no MPI with headers is installed (the core
    does without, and ``HOROVOD_CPU_OPERATIONS=MPI`` is refused at init). Raises BuildError
    when a compile fails."""
    src_dir = source_dir(src_dir)
    build_root = Path(build_dir or DEFAULT_BUILD).resolve()
    sources = sorted(src_dir.joinpath(*MPI_PLUGIN_DIR).glob("*.cc"))
    if not sources:
        return []
    built = {}
    for wrapper in _wrappers():
        plugin = _build_one(wrapper, core, sources, src_dir, build_root, debug, verbose, quiet)
        if plugin is not None:
            built.setdefault(plugin.name, plugin)
    return list(built.values())


def _build_one(wrapper: str, core: Path, sources: list[Path], src_dir: Path, build_root: Path,
               debug: bool, verbose: bool, quiet: bool) -> Path | None:
    if shutil.which(wrapper) is None:
        log(f"no MPI compiler wrapper ({wrapper}) on PATH: skipping the MPI plugin "
            "(HOROVOD_CPU_OPERATIONS=MPI needs it)", quiet)
        return None
    flags = _mpi_wrapper_flags(wrapper)
    if flags is None:
        abi, cxx, mpi_compile, mpi_link = "openmpi", [wrapper], [], []
    else:
        abi, mpi_compile, mpi_link = flags
        cxx = compiler()
    output = Path(core).parent / MPI_LIB_PATTERN.format(abi=abi)
    # MPI's headers as system headers: their own warnings are not ours. The plugin uses MPI's
    # C API only: no C++ bindings (libmpi_cxx, libmpichcxx) to compile or link.
    mpi_compile = ([f"-isystem{f[2:]}" if f.startswith("-I") else f for f in mpi_compile]
                   + ["-DOMPI_SKIP_MPICXX=1", "-DMPICH_SKIP_MPICXX=1"])
    mpi_link = [f for f in mpi_link if f not in ("-lmpi_cxx", "-lmpichcxx")]
    if not _mpi_headers_present(cxx + mpi_compile):
        log(f"{wrapper} finds no mpi.h (install MPI's development package, e.g. "
            "libopenmpi-dev or libmpich-dev): skipping its MPI plugin", quiet)
        return None
    # Only its shvd_mpi_plugin_* functions are exported (exports.map).
    cmd = (
        cxx + BASE_FLAGS + (DEBUG_FLAGS if debug else RELEASE_FLAGS) + HIDDEN_FLAGS
        + mpi_compile + [f"-I{src_dir}", "-shared"] + env_flags("CXXFLAGS")
        + [str(p) for p in sources]
        + ["-Wl,--no-undefined", f"-Wl,--version-script={exports_map(src_dir)}"]
        + private_archives() + mpi_link
        + (STRIP_FLAGS if strip_libraries() else []) + env_flags("LDFLAGS")
    )
    inputs = sources + [src_dir / "mpi" / "plugin_api.h", src_dir / "include" / "spark_hvd.h"]
    return build_library(cmd, output, inputs, build_root, f"mpi_{abi}_stamp", "mpi",
                         f"for {abi} with {wrapper}", "building the MPI plugin", verbose, quiet)
