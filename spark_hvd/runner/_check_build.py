"""``spark-hvd-run --check-build``: what this installation can do.

Reads the core's own answers (``spark_hvd.common.basics``) when the core is importable; without
it, reports only what can be seen from outside: importable frameworks and mpirun on PATH.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import json
import os
import shutil


def _has_module(name: str) -> bool:
    # find_spec, not import: importing TensorFlow takes seconds and may print warnings.
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _core_answers() -> tuple[dict[str, bool | None], str | None]:
    """The core's ``*_built()`` answers (None for a question it cannot answer) and, when the
    core cannot be loaded, the reason."""
    names = ("tcp_built", "mpi_built", "nccl_built", "cuda_built")
    try:
        basics = importlib.import_module("spark_hvd.common.basics")
    except Exception as e:  # any failure to load the core is worth reporting, not crashing on
        return {n: None for n in names}, f"{type(e).__name__}: {e}"
    answers = {}
    for n in names:
        fn = getattr(basics, n, None)
        try:
            answers[n] = bool(fn()) if callable(fn) else None
        except Exception:
            answers[n] = None
    return answers, None


def _mpi_note(built: bool | None) -> str:
    """How MPI operations are turned on, or why they cannot be."""
    if built:
        return " (HOROVOD_CPU_OPERATIONS=MPI in jobs started by mpirun or init(comm=...))"
    if built is None:
        return ""
    try:
        from spark_hvd.common import _mpi
        return f" ({_mpi.plugin_problem()})"
    except Exception:  # the core itself did not load: reported below
        return ""


def _mark(value: bool | None) -> str:
    return {True: "[X]", False: "[ ]", None: "[?]"}[value]


def check_build_report() -> str:
    """The text ``--check-build`` prints."""
    try:
        from importlib.metadata import version
        ver = version("spark-hvd")
    except Exception:  # running from a source tree
        ver = getattr(importlib.import_module("spark_hvd"), "__version__", "(unknown version)")
    core, problem = _core_answers()
    mpi = core["mpi_built"]
    lines = [
        f"spark_hvd {ver}:",
        "",
        "Available frameworks:",
        f"    {_mark(_has_module('torch'))} PyTorch",
        f"    {_mark(_has_module('tensorflow'))} TensorFlow",
        f"    {_mark(_has_module('keras'))} Keras",
        "",
        "Available controllers:",
        f"    {_mark(core['tcp_built'])} TCP (Gloo-compatible, the default)",
        # Negotiation is always our own; mpirun jobs only meet through mpi4py.
        f"    {_mark(False)} MPI (jobs started by mpirun meet through mpi4py, then negotiate "
        "over TCP)",
        "",
        "Available tensor operations:",
        f"    {_mark(core['tcp_built'])} TCP / shared memory",
        f"    {_mark(core['nccl_built'])} NCCL",
        f"    {_mark(mpi)} MPI{_mpi_note(mpi)}",
        "",
        f"mpirun on PATH: {'yes' if shutil.which('mpirun') else 'no'}",
        f"mpi4py importable: {'yes' if _has_module('mpi4py') else 'no'}",
    ]
    if problem is not None:
        lines.append(f"native core: not loadable ({problem}); [?] marks what it would answer")
    else:
        lines.append(f"CUDA tensors: {_gpu_report()}")
    lines += _binaries_report()
    return "\n".join(lines)


def _binaries_report() -> list[str]:
    """Which binaries this installation uses: the core (where, built by which compiler: the
    manylinux wheel's zig build or a from-source build) and the libraries beside it."""
    spec = importlib.util.find_spec("spark_hvd")
    if spec is None or not spec.submodule_search_locations:
        return []
    core_dir = os.path.join(list(spec.submodule_search_locations)[0], "_core")
    try:
        with open(os.path.join(core_dir, "build_info.json")) as fh:
            info = json.load(fh)
    except (OSError, ValueError):
        info = {}
    if info.get("toolchain") == "zig":
        how = (f"{info.get('compiler')} via zig, for glibc {info.get('glibc')} and later "
               "(the manylinux wheel's build)")
    else:
        how = f"{info.get('compiler', 'unknown compiler')}, built from source for this machine"
    libs = sorted(os.path.basename(p) for p in glob.glob(os.path.join(core_dir, "*.so")))

    def minors(prefix):
        return [n[len(prefix):-3].replace("_", ".") for n in libs if n.startswith(prefix)]
    tf = "libspark_hvd_tf.so" in libs
    return [
        f"native core: {os.path.join(core_dir, 'libspark_hvd_core.so')} ({how})",
        f"TensorFlow op library: {'yes (TensorFlow C API, 2.16+)' if tf else 'no'}",
        f"torch shared-gradient allocator for torch: {', '.join(minors('libspark_hvd_torch_')) or 'none'}",
        f"MPI plugins: {', '.join(minors('libspark_hvd_mpi_')) or 'none'}",
    ]


def _gpu_report() -> str:
    """What the core's GPU path loaded (spark_hvd.common._gpu), in words."""
    try:
        return importlib.import_module("spark_hvd.common._gpu").report()
    except Exception as e:  # the report is informative only
        return f"unknown ({type(e).__name__}: {e})"
