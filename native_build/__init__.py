"""The native build that build.py runs (and setup.py, for `pip install .`), one module a part:

    toolchain      the C++ compiler (CXX), the flags, running a compile or a link; BuildError
    layout         where sources, objects and libraries live; --clean
    core           the core library, spark_hvd/_core/libspark_hvd_core.so (incremental)
    smoke          the two-process test a freshly linked core passes before it is installed
    smoke_worker   one process of that test (standard library only)
    frameworks     the TensorFlow op and torch allocator libraries
    mpi_plugin     the MPI plugin, libspark_hvd_mpi.so
    cpp_tests      the C++ test programs of native/tests/

A build-time package of the source tree: the spark_hvd wheel does not contain it."""

from .core import build
from .cpp_tests import build_test_program
from .frameworks import FRAMEWORK_LIBRARIES, build_framework_library
from .layout import clean
from .mpi_plugin import build_mpi_plugin
from .toolchain import BuildError

__all__ = ["BuildError", "FRAMEWORK_LIBRARIES", "build", "build_framework_library",
           "build_mpi_plugin", "build_test_program", "clean"]
