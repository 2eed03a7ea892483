"""Host-memory stand-ins for the CUDA runtime and NCCL (fake_cuda.cc), for tests of the core's
GPU path on machines without a GPU."""

import os
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "fake_cuda.cc"


def build(directory) -> dict:
    """Builds the stand-in library into ``directory`` (g++, or $CXX) and returns the
    environment that makes a job's core load it as its CUDA runtime and NCCL."""
    lib = Path(directory) / "libfake_cuda.so"
    subprocess.run([os.environ.get("CXX", "g++"), "-std=c++17", "-O2", "-shared", "-fPIC",
                    "-pthread", str(SOURCE), "-o", str(lib)], check=True, timeout=240)
    return {"SPARK_HVD_CUDART_LIBRARY": str(lib), "SPARK_HVD_NCCL_LIBRARY": str(lib),
            "FAKE_CUDA_DEVICE_COUNT": "4"}
