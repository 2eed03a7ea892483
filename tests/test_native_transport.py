"""Builds and runs native/tests/transport_test.cc: TCP and shared-memory links, mesh
authentication, peer-death detection, reduction kernels and the SHA-256/HMAC helpers.

The C++ test forks its own rank processes, so it is compiled here as a standalone program
(native/tests/ is not part of the library that build.py links). The binary is cached in the
temp directory under a hash of its sources and flags, so reruns only pay for the run.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "native"
SOURCES = [
    NATIVE / "tests" / "transport_test.cc",
    NATIVE / "common" / "types.cc",
    NATIVE / "common" / "hmac.cc",
    NATIVE / "common" / "logging.cc",
    NATIVE / "transport" / "link.cc",
    NATIVE / "transport" / "tcp.cc",
    NATIVE / "transport" / "shm.cc",
    NATIVE / "transport" / "mesh.cc",
    NATIVE / "kernels" / "reduce_kernels.cc",
]
# The library's release flags, so the throughput figures the test prints are representative.
FLAGS = ["-std=c++17", "-O3", "-pthread", "-Wall"]
RUN_TIMEOUT_S = 180

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the native transport is Linux-only"
)


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _fingerprint(cxx: str) -> str:
    """Hash of the compiler, flags, the sources and every header they can include."""
    headers = [*(NATIVE / "common").glob("*.h"), *(NATIVE / "transport").glob("*.h"),
               NATIVE / "kernels" / "reduce_kernels.h", NATIVE / "tests" / "harness.h",
               NATIVE / "include" / "spark_hvd.h"]
    h = hashlib.sha256(" ".join([cxx, *FLAGS]).encode())
    for path in sorted(set(SOURCES) | set(headers)):
        h.update(str(path.relative_to(NATIVE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="module")
def transport_test_binary() -> Path:
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler (set CXX or install g++)")
    cache = Path(tempfile.gettempdir()) / f"spark_hvd_transport_test_{os.getuid()}"
    cache.mkdir(exist_ok=True)
    binary = cache / f"transport_test_{_fingerprint(cxx)}"
    if not binary.exists():
        tmp = binary.with_suffix(f".tmp{os.getpid()}")
        cmd = [cxx, *FLAGS, "-o", str(tmp), *map(str, SOURCES), "-lrt"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.fail(f"compiling the transport test failed:\n{' '.join(cmd)}\n{proc.stderr}")
        tmp.replace(binary)  # atomic: a concurrent run never sees a half-written binary
    return binary


def test_native_transport(transport_test_binary: Path) -> None:
    try:
        proc = subprocess.run(
            [str(transport_test_binary)],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        pytest.fail(f"transport_test did not finish within {RUN_TIMEOUT_S} s:\n{out or ''}")
    report = proc.stdout + ("\n--- stderr ---\n" + proc.stderr if proc.stderr else "")
    print(report)  # throughput figures show with pytest -s
    assert proc.returncode == 0, report
    assert " 0 failed" in proc.stdout, report
