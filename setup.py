"""setuptools glue: metadata lives in pyproject.toml; this file only hooks the native build.

`pip install .` and `pip install -e .` both run build_py, which here first runs the native build
(native_build/, what build.py runs) to produce
spark_hvd/_core/libspark_hvd_core.so (and libspark_hvd_tf.so, libspark_hvd_torch_<maj>_<min>.so
per torch minor found, and an MPI plugin libspark_hvd_mpi_<abi>.so per MPI with headers; in the
source tree, so an editable install sees it too; build/wheel/ with the wheel's toolchain), then
copies it into the wheel as package data (SPARK_HVD_SKIP_NATIVE_BUILD=1 skips the build,
SPARK_HVD_DEBUG_BUILD=1 builds -O0 -g). The library is a ctypes-loaded C ABI object, independent
of the Python version, so the wheel is tagged py3-none-<platform>.

The toolchain: where neither CXX nor SPARK_HVD_TOOLCHAIN is set and the ziglang package is
importable (pyproject.toml's build requirements bring it on x86-64 and aarch64 Linux), zig's
clang builds for glibc 2.28 and the wheel is tagged manylinux_2_28_<arch> (`make wheel` then
checks that tag with auditwheel); CXX=g++ or CXX=clang++ builds with that compiler instead, for
this machine only (tagged linux_<arch>), as an sdist install on a platform without a wheel does.

As with `python build.py`, a freshly linked core goes into the package only after its
two-process smoke test passed; when it fails, the install stops with the build's message (which
compiler, what to do). SPARK_HVD_SKIP_SMOKE_TEST=1 skips the test, for cross builds only.
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py
from setuptools.dist import Distribution

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import native_build  # noqa: E402  (native_build/ next to this file, as build.py uses it)


def _use_zig():
    """Whether this build uses the wheel's toolchain (see the module docstring)."""
    choice = os.environ.get(native_build.toolchain.TOOLCHAIN_ENV, "")
    if choice or os.environ.get("CXX"):
        return choice == "zig"
    try:
        import ziglang  # noqa: F401
    except ImportError:
        return False
    return sys.platform.startswith("linux")


if _use_zig():
    os.environ[native_build.toolchain.TOOLCHAIN_ENV] = "zig"


# Where the wheel's toolchain builds (objects and libraries), apart from the in-tree g++ build
# that make build / the tests use, so neither invalidates the other.
WHEEL_BUILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build", "wheel")


class build_py(_build_py):
    def run(self):
        if os.environ.get("SPARK_HVD_SKIP_NATIVE_BUILD", "") not in ("", "0"):
            # scripts/setup.sh installs the package first and builds the core separately, so a
            # half-written native/ does not stop the environment from being set up.
            super().run()
            return
        debug = os.environ.get("SPARK_HVD_DEBUG_BUILD", "") not in ("", "0")
        zig = _use_zig()
        dirs = ({"build_dir": os.path.join(WHEEL_BUILD, "native"),
                 "output": os.path.join(WHEEL_BUILD, "_core", native_build.layout.LIB_NAME)}
                if zig else {})
        try:
            core = native_build.build(debug=debug, **dirs)
            bdir = dirs.get("build_dir")
            built = [core]
            for framework in native_build.FRAMEWORK_LIBRARIES:
                if core is not None:  # torch's skipped (with a note) when it is not importable
                    built += native_build.build_framework_library(framework, core, debug=debug,
                                                                  build_dir=bdir)
            if core is not None:  # skipped (with a note) where no MPI has headers
                built += native_build.build_mpi_plugin(core, debug=debug, build_dir=bdir)
        except native_build.BuildError as e:
            raise SystemExit(f"[build] ERROR: {e}")
        super().run()
        if zig and core is not None:
            # The wheel carries the libraries zig built in this run (not those an earlier run
            # left in build/wheel/, nor the in-tree g++ ones) and their build_info.json (what
            # --check-build reports).
            dest = os.path.join(self.build_lib, "spark_hvd", "_core")
            for name in os.listdir(dest):
                if name.endswith(".so") or name == native_build.core.BUILD_INFO:
                    os.remove(os.path.join(dest, name))
            info = os.path.join(os.path.dirname(core), native_build.core.BUILD_INFO)
            for path in built + [info]:
                self.copy_file(str(path), os.path.join(dest, os.path.basename(path)))


class BinaryDistribution(Distribution):
    """Mark the distribution as platform-specific (it ships a .so)."""

    def has_ext_modules(self):
        return True


cmdclass = {"build_py": build_py}

try:  # setuptools >= 70 ships bdist_wheel; older ones need the wheel package.
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:  # pragma: no cover
    try:
        from wheel.bdist_wheel import bdist_wheel as _bdist_wheel
    except ImportError:
        _bdist_wheel = None

if _bdist_wheel is not None:

    class bdist_wheel(_bdist_wheel):
        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            _, _, plat = super().get_tag()
            if _use_zig() and plat.startswith("linux_"):
                # What zig's target glibc gives; `make wheel` confirms it with auditwheel.
                glibc = native_build.toolchain.ZIG_GLIBC.replace(".", "_")
                plat = f"manylinux_{glibc}_{plat[len('linux_'):]}"
            return "py3", "none", plat

    cmdclass["bdist_wheel"] = bdist_wheel

setup(cmdclass=cmdclass, distclass=BinaryDistribution)
