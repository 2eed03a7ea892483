#!/usr/bin/env python3
"""Build the native core (native/**/*.cc) into spark_hvd/_core/libspark_hvd_core.so, and, when
TensorFlow is importable, its graph ops (native/tensorflow/) into libspark_hvd_tf.so, and, when
torch is importable, its shared-gradient allocator (native/torch/) into libspark_hvd_torch.so,
and, where mpicxx finds MPI, the MPI plugin (native/mpi/plugin/) into libspark_hvd_mpi.so.

    python build.py               # optimised build (-O3)
    python build.py --debug       # -O0 -g, same output path
    python build.py --asan        # --debug plus AddressSanitizer (needs LD_PRELOAD=libasan.so)
    python build.py --clean       # remove build/native and the libraries
    python build.py --no-tensorflow --no-torch --no-mpi   # the core only
    python build.py -j 4 -v       # 4 parallel compiles, print every command
    python build.py --no-smoke-test   # cross builds: a library this machine cannot run
    python build.py --zig         # the wheel's toolchain: zig's clang for glibc 2.28 (ziglang)

Environment: CXX (compiler, default g++), SPARK_HVD_TOOLCHAIN=zig (as --zig; the torch
allocator is still built with g++ or SPARK_HVD_TORCH_CXX: torch's classes hold libstdc++'s types),
SPARK_HVD_TORCH_WHEELS (torch wheel files to build more torch minors' allocators from), CXXFLAGS / LDFLAGS (appended), SPARK_HVD_BUILD_JOBS,
SPARK_HVD_NATIVE_DIR (source tree, default ./native; used for testing the build itself),
SPARK_HVD_SKIP_SMOKE_TEST=1 (as --no-smoke-test), MPICXX (the MPI compiler wrapper).

This file is the command line; the build itself is the package native_build/, one module a
part (the compiler, the core, the smoke test, the framework libraries, the MPI plugin: its
__init__ lists them), which setup.py imports too, so `pip install .` / `pip install -e .` build
the libraries.
"""

from __future__ import annotations

import argparse
import os
import sys

from native_build import (FRAMEWORK_LIBRARIES, BuildError, build, build_framework_library,
                          build_mpi_plugin, build_test_program, clean)
from native_build.layout import LIB_NAME
from native_build.smoke import SKIP_SMOKE_TEST_ENV
from native_build.toolchain import TOOLCHAIN_ENV

__all__ = ["BuildError", "FRAMEWORK_LIBRARIES", "build", "build_framework_library",
           "build_mpi_plugin", "build_test_program", "clean", "main"]


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
    ap.add_argument("--zig", action="store_true",
                    help="build with zig's clang for glibc 2.28 (the manylinux wheel's toolchain; "
                         "needs the ziglang package; also SPARK_HVD_TOOLCHAIN=zig)")
    ap.add_argument("--no-smoke-test", action="store_true",
                    help="install the core without running two processes with it first (cross "
                         f"builds; also {SKIP_SMOKE_TEST_ENV}=1)")
    args = ap.parse_args(argv)

    if args.zig:
        os.environ[TOOLCHAIN_ENV] = "zig"
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
