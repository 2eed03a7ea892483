"""Where the build reads and writes: the sources (native/), the objects and stamps
(build/native/), the libraries (spark_hvd/_core/), which files of the source tree play a part in
every library (the version script, the source that defines the C API), and --clean."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .toolchain import BuildError, display, log

ROOT = Path(__file__).resolve().parents[1]  # the repository: build.py, native/, spark_hvd/
LIB_NAME = "libspark_hvd_core.so"
TF_LIB_NAME = "libspark_hvd_tf.so"
# One per torch minor (frameworks.py), e.g. libspark_hvd_torch_2_13.so.
TORCH_LIB_PATTERN = "libspark_hvd_torch_{major}_{minor}.so"
# One per MPI ABI (mpi_plugin.py): Open MPI's libmpi.so.40, MPICH's libmpi.so.12.
MPI_LIB_PATTERN = "libspark_hvd_mpi_{abi}.so"
DEFAULT_SRC = ROOT / "native"
DEFAULT_BUILD = ROOT / "build" / "native"
DEFAULT_OUT = ROOT / "spark_hvd" / "_core" / LIB_NAME

HEADER_SUFFIXES = (".h", ".hpp", ".hh", ".inc", ".ipp")

# Defines the extern "C" shvd_* functions: the only core source compiled with default
# visibility (toolchain.API_SOURCE_FLAGS).
API_SOURCES = ("c_api.cc",)
# Which symbols a library exports (native/exports.map: shvd_* alone, whatever static archives
# such as libstdc++.a bring in stays private).
EXPORTS_MAP = "exports.map"
# The MPI plugin's sources (mpi_plugin.py): compiled against MPI, never into the core.
MPI_PLUGIN_DIR = ("mpi", "plugin")


def source_dir(src_dir: str | os.PathLike | None) -> Path:
    """The source tree: ``src_dir``, else SPARK_HVD_NATIVE_DIR, else ./native."""
    return Path(src_dir or os.environ.get("SPARK_HVD_NATIVE_DIR") or DEFAULT_SRC).resolve()


def exports_map(src_dir: Path) -> Path:
    exports = src_dir / EXPORTS_MAP
    if not exports.is_file():
        raise BuildError(f"{exports} is missing: the version script that keeps everything but "
                         "the shvd_* functions private to the library")
    return exports


def clean(build_dir: str | os.PathLike | None = None, output: str | os.PathLike | None = None,
          quiet: bool = False) -> None:
    """Removes the build folder, the core and the libraries built next to it."""
    build_root = Path(build_dir or DEFAULT_BUILD).resolve()
    output = Path(output or DEFAULT_OUT).resolve()
    if build_root.exists():
        shutil.rmtree(build_root)
        log(f"removed {display(build_root)}", quiet)
    for lib in [output] + sorted(output.parent.glob("libspark_hvd_*.so")):
        if lib.exists():
            lib.unlink()
            log(f"removed {display(lib)}", quiet)
