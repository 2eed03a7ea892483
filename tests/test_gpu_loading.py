"""The GPU path where there is no GPU (CI): the core loads the CUDA runtime and NCCL at run
time, says truthfully what it found, refuses CUDA ops it cannot run with a clear error, and keeps
working for host tensors. The CUDA collectives themselves are tested on a GPU machine by
tests/gpu (`make test-gpu`)."""

import ctypes.util
import glob
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import PY, REPO, job_env


def _run(code, env=None, timeout=60):
    p = subprocess.run([PY, "-c", textwrap.dedent(code)], env=job_env(env), cwd=REPO,
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def _machine_has(stem):
    if ctypes.util.find_library(stem):
        return True
    return any(glob.glob(os.path.join(p, "nvidia", "*", "lib", f"lib{stem}.so*"))
               for p in sys.path if p)


def test_built_flags_match_the_libraries_this_machine_has():
    rc, out = _run("""
        import spark_hvd.torch as hvd
        from spark_hvd.common import _gpu
        print("FLAGS", hvd.cuda_built(), hvd.nccl_built(), _gpu.status())
        print("REPORT", _gpu.report())
    """)
    assert rc == 0, out
    flags = next(line for line in out.splitlines() if line.startswith("FLAGS")).split()
    has_cudart, has_nccl = _machine_has("cudart"), _machine_has("nccl")
    assert flags[1] == str(has_cudart), out
    assert flags[2] == str(has_cudart and has_nccl), out
    report = next(line for line in out.splitlines() if line.startswith("REPORT"))
    assert ("no CUDA runtime" in report) != has_cudart, report


def test_a_missing_nccl_path_is_reported_and_nothing_breaks():
    rc, out = _run("""
        import spark_hvd.torch as hvd
        from spark_hvd.common import _gpu
        print("NCCL", hvd.nccl_built())
        print("REPORT", _gpu.report())
        print("COUNTERS", sorted(hvd.gpu_counters().items()) if hasattr(hvd, "gpu_counters")
              else sorted(_gpu.counters().items()))
    """, env={"SPARK_HVD_NCCL_LIBRARY": "/nonexistent/libnccl.so.2"})
    assert rc == 0, out
    if not _machine_has("nccl"):
        assert "NCCL False" in out, out
    assert "/nonexistent/libnccl.so.2" in out or "no CUDA runtime" in out, out
    assert "('host_staged_bytes', 0)" in out and "('nccl_collectives', 0)" in out, out


def test_cuda_ops_without_a_gpu_fail_clearly_and_host_ops_go_on():
    # A CUDA op record (device kind 1) on a machine without a GPU: refused at enqueue with the
    # reason, on the calling thread; the job then keeps working for host tensors.
    rc, out = _run("""
        import numpy as np
        import spark_hvd.numpy as hvd_np
        from spark_hvd.common import _ops, basics
        from spark_hvd.common._native import FLOAT32, OP_ALLREDUCE
        basics.init()
        a = np.ones(4, dtype=np.float32)
        rec = _ops.make_op(OP_ALLREDUCE, "gpu.op", FLOAT32, a.shape, a.ctypes.data,
                           a.ctypes.data, place=(1, 0, 0))
        try:
            _ops.enqueue([rec])
            print("ENQUEUED")
        except Exception as e:
            print("REFUSED", type(e).__name__, e)
        rec = _ops.make_op(OP_ALLREDUCE, "odd.op", FLOAT32, a.shape, a.ctypes.data,
                           a.ctypes.data, place=(7, 0, 0))
        try:
            _ops.enqueue([rec])
        except ValueError as e:
            print("KIND", e)
        print("HOST", hvd_np.allreduce(np.arange(3.0), op=_ops.Sum).tolist())
        basics.shutdown()
    """)
    assert rc == 0, out
    assert "ENQUEUED" not in out, out
    refused = next(line for line in out.splitlines() if line.startswith("REFUSED"))
    assert "CUDA" in refused, refused
    assert "unknown device kind 7" in out, out
    assert "HOST [0.0, 1.0, 2.0]" in out, out


def test_a_bad_shared_gpu_setting_is_refused_at_init():
    rc, out = _run("""
        from spark_hvd.common import basics
        try:
            basics.init()
            print("INITIALIZED")
        except Exception as e:
            print("REFUSED", e)
    """, env={"SPARK_HVD_SHARED_GPU": "sometimes"})
    assert "INITIALIZED" not in out, out
    assert "SPARK_HVD_SHARED_GPU=sometimes" in out and "'host'" in out and "'nccl'" in out, out


@pytest.mark.parametrize("flag", ["--check-build"])
def test_check_build_shows_the_gpu_libraries(flag):
    p = subprocess.run([PY, "-m", "spark_hvd.runner", flag], env=job_env(), cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    nccl_line = next(line for line in p.stdout.splitlines() if line.strip().endswith("NCCL"))
    assert ("[X]" in nccl_line) == (_machine_has("cudart") and _machine_has("nccl")), p.stdout
