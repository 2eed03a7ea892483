"""CUDA tensors through spark_hvd (issue 22, "Done when"): every collective, process sets,
mixed CPU and CUDA tensors, join, DistributedOptimizer, broadcast of parameters and optimizer
state, SyncBatchNorm; 1 rank (``hvd.init()`` with no launcher) and 2 ranks through the real
launcher (``python -m spark_hvd.runner -np 2``), and that no CUDA tensor is copied through host
memory on the NCCL path (``spark_hvd.common.gpu_counters()``).

With fewer GPUs than ranks (the one-GPU test machine: both ranks on cuda:0) every 2-rank test
runs in both modes of ``SPARK_HVD_SHARED_GPU``: unset (the default: the host path, with one
warning) and ``nccl`` (each rank its own NCCL host identity). With a GPU per rank both modes
take the NCCL path.

Each test is one job (tests/gpu/workers/<area>.py) under a subprocess timeout (no
pytest-timeout needed); a worker prints ``ok rank=R <check>`` per check and stops at the first
failure with ``FAIL rank=R <check>: <why>``, which the assertion message shows.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PY, REPO, JobResult, job_env, run_job
from hide_package import run_without

from .availability import DRY_RUN

WORKERS = Path(__file__).resolve().parent / "workers"
# Seconds per job (a healthy one takes 5-30 s); GPU_SUITE_JOB_TIMEOUT lowers it where device
# time is short (tests/gpu/device_run.sh).
JOB_TIMEOUT = float(os.environ.get("GPU_SUITE_JOB_TIMEOUT") or 150)

# (ranks, SPARK_HVD_SHARED_GPU or None for unset)
CASES = [pytest.param(1, None, id="np1"),
         pytest.param(2, None, id="np2-shared_gpu_unset"),
         pytest.param(2, "nccl", id="np2-shared_gpu_nccl")]
NP2_CASES = CASES[1:]


def gpu_count() -> int:
    if DRY_RUN:
        return 8  # a dry run on the CPU (see conftest.py): no path expectations
    import torch
    return torch.cuda.device_count()


def expected_path(np_: int, mode: str | None) -> str:
    """What the job's CUDA collectives must go through (the worker's --expect)."""
    if np_ == 1:
        return "single"
    if gpu_count() >= np_:
        return "nccl"  # a GPU per rank: NCCL whatever SPARK_HVD_SHARED_GPU says
    return "nccl" if mode == "nccl" else "host"


def run_single(script: str, *args, env: dict | None = None,
               timeout: float = JOB_TIMEOUT) -> JobResult:
    """``python tests/gpu/workers/<script>.py`` alone (``hvd.init()`` with no launcher, size
    1). Its output lines get the launcher's ``[0]<stdout>: `` prefix, so the result reads
    like a launched job's."""
    cmd = [PY, str(WORKERS / f"{script}.py"), *[str(a) for a in args]]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=job_env(env), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s\n--- stdout ---\n"
                    f"{(out or '')[-12000:]}\n--- stderr ---\n{(err or '')[-12000:]}")
    def prefixed(text, stream):
        return "".join(f"[0]<{stream}>: {line}\n" for line in text.splitlines())
    return JobResult(cmd, proc.returncode, prefixed(proc.stdout, "stdout"),
                     prefixed(proc.stderr, "stderr"), time.monotonic() - start)


def run_area(area: str, np_: int, mode: str | None) -> JobResult:
    expect = expected_path(np_, mode)
    env = {"SPARK_HVD_SHARED_GPU": mode}  # None: unset (job_env removes it)
    if np_ == 1:
        result = run_single(area, "--expect", expect, env=env)
    else:
        result = run_job(np_, str(WORKERS / f"{area}.py"), "--expect", expect, env=env,
                         timeout=JOB_TIMEOUT)
    # What the path did, shown by `pytest -rP` (or on failure): devices, counters, timings.
    print(f"{area} np={np_} SPARK_HVD_SHARED_GPU={mode or '(unset)'} expect={expect}: "
          f"{result.seconds:.1f} s")
    for r in range(np_):
        for line in result.lines(r):
            if line.startswith(("info ", "OK ")) or "nccl_collectives" in line:
                print(f"  [{r}] {line}")
    result.assert_ok(np_)
    if expect == "host":
        check_one_shared_gpu_warning(result, np_)
    return result


_SHARED_WARNING = re.compile(r"(?=.*shar)(?=.*(gpu|cuda|device))", re.IGNORECASE)


def check_one_shared_gpu_warning(result: JobResult, np_: int) -> None:
    """The host path for ranks sharing a GPU is announced on stderr, once per rank at most
    (not per op: the job ran hundreds of CUDA collectives); a Python warning may take two
    lines (the message and its source line)."""
    hits = [line for line in result.stderr.splitlines() if _SHARED_WARNING.search(line)]
    assert hits, ("ranks share a GPU and SPARK_HVD_SHARED_GPU is unset or host: expected a "
                  "warning on stderr that mentions the shared GPU (host path)\n"
                  + result.describe())
    assert len(hits) <= 2 * np_, (f"the shared-GPU warning appears {len(hits)} times (expected "
                                  f"once per rank at most):\n" + "\n".join(hits[:20]))


# ---------------------------------------------------------------------------------------------

def test_built_with_nccl_and_cuda_and_no_pyspark():
    """nccl_built() and cuda_built() are True after import, --check-build marks NCCL and CUDA
    built, and neither the launcher nor spark_hvd.torch imports PySpark."""
    if DRY_RUN:
        pytest.skip("a dry run on the CPU (see conftest.py) has no NCCL to find")
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import spark_hvd.torch as hvd; "
            "print('after import', hvd.nccl_built(), hvd.cuda_built()); "
            "print('pyspark imported:', any(m.split('.')[0] == 'pyspark' for m in sys.modules));"
            "import torch; hvd.init(); torch.cuda.set_device(0); "
            "hvd.allreduce(torch.ones(4, device='cuda'), name='probe'); "
            "print('after a CUDA allreduce', hvd.nccl_built(), hvd.cuda_built()); "
            "hvd.shutdown()")
    proc = run_without("pyspark", code, timeout=120)
    assert proc.returncode == 0, (f"spark_hvd.torch with PySpark hidden failed:\n{proc.stdout}"
                                  f"{proc.stderr[-6000:]}")
    assert "after import True True" in proc.stdout, (
        f"nccl_built() and cuda_built() must be True after import on a GPU machine:\n"
        f"{proc.stdout}{proc.stderr[-3000:]}")
    assert "pyspark imported: False" in proc.stdout, proc.stdout
    code = (f"import runpy, sys; sys.path.insert(0, {str(REPO)!r}); "
            "sys.argv = ['spark-hvd-run', '--check-build']; "
            "runpy.run_module('spark_hvd.runner', run_name='__main__')")
    proc = run_without("pyspark", code, timeout=120)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"--check-build failed with PySpark hidden:\n{report[-6000:]}"
    marks = {m.group(2).strip(): m.group(1) for m in
             re.finditer(r"^\s*\[(.)\]\s*(.+)$", proc.stdout, re.MULTILINE)}
    nccl = {k: v for k, v in marks.items() if k.upper().startswith("NCCL")}
    assert nccl and all(v == "X" for v in nccl.values()), (
        f"--check-build must show NCCL as built (its NCCL line marked [X]):\n{report}")
    # CUDA: a line naming CUDA marked [X], or the core's load report ("CUDA tensors: CUDA
    # runtime and NCCL <version> loaded").
    cuda = {k: v for k, v in marks.items() if "CUDA" in k.upper()}
    loaded = re.search(r"^\s*CUDA tensors:.*CUDA runtime and NCCL .*loaded", proc.stdout,
                       re.MULTILINE)
    assert (cuda and all(v == "X" for v in cuda.values())) or (not cuda and loaded), (
        f"--check-build must show CUDA as built (a line naming CUDA marked [X], or 'CUDA "
        f"tensors: CUDA runtime and NCCL ... loaded'):\n{report}")


@pytest.mark.parametrize("np_,mode", CASES)
def test_collectives(np_, mode):
    """Every collective on CUDA tensors (tests/gpu/workers/collectives.py), Adasum refused."""
    run_area("collectives", np_, mode)


@pytest.mark.parametrize("np_,mode", CASES)
def test_mixed_cpu_and_cuda(np_, mode):
    """CPU and CUDA tensors interleaved and in flight at once (workers/mixed.py)."""
    run_area("mixed", np_, mode)


@pytest.mark.parametrize("np_,mode", CASES)
def test_training(np_, mode):
    """broadcast_parameters / broadcast_optimizer_state, DistributedOptimizer against one
    process on the whole batch, SyncBatchNorm against BatchNorm2d (workers/training.py)."""
    run_area("training", np_, mode)


@pytest.mark.parametrize("np_,mode", NP2_CASES)
def test_process_sets(np_, mode):
    """Collectives in static process sets, interleaved with the global set
    (workers/process_sets.py)."""
    run_area("process_sets", np_, mode)


@pytest.mark.parametrize("np_,mode", NP2_CASES)
def test_join(np_, mode):
    """join while the other ranks reduce CUDA tensors (workers/join.py)."""
    run_area("join", np_, mode)


def test_shared_gpu_host_mode_explicit():
    """SPARK_HVD_SHARED_GPU=host behaves as unset: the host path, one warning, right results."""
    if gpu_count() >= 2:
        pytest.skip("a GPU per rank: the ranks do not share a GPU here")
    run_area("mixed", 2, "host")


# --- Several hosts (issue 33, parts 3 and 4) ---------------------------------------------------
# Two simulated hosts on this machine: ranks on 127.0.0.1 and 127.0.0.2 have distinct host
# ids, so the core builds its hierarchy (local and cross communicators) as across machines.
# With fewer GPUs than ranks, every rank takes its own NCCL host identity
# (SPARK_HVD_SHARED_GPU=nccl), so NCCL also connects them as separate machines (sockets). The
# network-namespace bed runs the same workers across real addresses and hostnames
# (tests/multihost: test_hierarchical_hosts.py, test_lost_hosts.py, their CUDA tests).

HIERARCHICAL_SETTING = {"on": "1", "off": "0", "auto": None}


def hosts_env(extra: dict | None = None) -> dict:
    return {"SPARK_HVD_SHARED_GPU": "nccl" if gpu_count() < 4 else None, **(extra or {})}


@pytest.mark.parametrize("setting", list(HIERARCHICAL_SETTING))
def test_hierarchical_allreduce_across_hosts(setting):
    """4 ranks, 2 simulated hosts x 2: CUDA allreduces (every op, float16 to int64, scalings,
    sizes that do not divide by a host's ranks, a fused group, 12 MiB) exact and bitwise equal
    on every rank, with HOROVOD_HIERARCHICAL_ALLREDUCE on (every allreduce through the three
    NCCL steps), automatic (the bandwidth-bound ones) or off (none): the counters say which."""
    env = hosts_env({"HOROVOD_HIERARCHICAL_ALLREDUCE": HIERARCHICAL_SETTING[setting]})
    result = run_job(4, str(WORKERS / "hierarchical.py"), "--expect", "nccl",
                     "--hierarchical", setting, env=env, transport="hosts",
                     timeout=JOB_TIMEOUT)
    print(f"hierarchical={setting}: {result.seconds:.1f} s")
    for r in range(4):
        for line in result.lines(r):
            if "hierarch" in line or "nccl_collectives" in line:
                print(f"  [{r}] {line}")
    result.assert_ok(4)


# Bounds of the lost-rank test: a short peer timeout, and slack for a loaded machine.
PEER_TIMEOUT = 4.0
SLACK = 8.0


def test_lost_rank_fails_every_nccl_op(tmp_path):
    """2 simulated hosts x 2 ranks stream 4M-float CUDA allreduces through NCCL; rank 3 (the
    second host) SIGKILLs itself mid-stream: ranks 0-2 raise HorovodInternalError naming a
    lost rank within the peer timeout (their NCCL communicators are aborted, not left waiting
    for the dead rank), and the job ends; nothing hangs."""
    reports = tmp_path / "reports"
    reports.mkdir()
    env = hosts_env({"FRAMEWORK": "torch-cuda", "STOP_SIGNAL": "KILL",
                     "SPARK_HVD_PEER_TIMEOUT_SECONDS": PEER_TIMEOUT,
                     "SPARK_HVD_KILL_GRACE_SECONDS": 15, "REPORT_DIR": str(reports)})
    if DRY_RUN:
        env["FRAMEWORK"] = "torch"
    worker = REPO / "tests" / "workers" / "lost_peer.py"
    result = run_job(4, str(worker), 1 << 22, 0, "", 0, 3, 5, 0, env=env, transport="hosts",
                     timeout=PEER_TIMEOUT + SLACK + 60)
    print(result.describe()[-3000:])
    assert result.returncode != 0, result.describe()
    killed = [line for line in result.lines(3) if line.startswith("KILLING")]
    assert killed, result.describe()
    killed_at = float(re.search(r"at=(\S+)", killed[0]).group(1))
    texts = {}
    deadline = time.monotonic() + 10
    while len(texts) < 3 and time.monotonic() < deadline:
        texts = {int(p.stem[4:]): p.read_text() for p in reports.glob("rank*.txt")}
        time.sleep(0.2)
    for r in (0, 1, 2):
        assert r in texts, f"rank {r} raised no HorovodInternalError\n{result.describe()}"
        at = float(re.search(r"at=(\S+)", texts[r]).group(1))
        print(f"rank {r}: HorovodInternalError {at - killed_at:.2f} s after the kill: "
              f"{texts[r][:300]}")
        assert at - killed_at <= PEER_TIMEOUT + SLACK, texts[r]
        assert re.search(r"rank 3\b|lost|connection", texts[r]), texts[r]


def test_keras_on_the_torch_backend_trains_through_nccl(tmp_path):
    """Keras 3 with KERAS_BACKEND=torch (issue 33, part 6) on the GPU: the 2-rank training of
    tests/workers/keras_backends.py (DistributedOptimizer, the callbacks, bitwise equal weights
    on both ranks) with the model's weights on CUDA, its gradients reduced through NCCL and
    nothing staged through host memory; the accuracy is the CPU run's within rounding."""
    pytest.importorskip("keras")
    import json
    out = tmp_path / "result.json"
    env = {"KERAS_BACKEND": "torch", "SPARK_HVD_SHARED_GPU": "nccl" if gpu_count() < 2 else None}
    result = run_job(2, str(REPO / "tests" / "workers" / "keras_backends.py"), out, env=env,
                     timeout=JOB_TIMEOUT + 60)
    result.assert_ok(2)
    got = json.loads(out.read_text())
    print({k: got[k] for k in ("device", "accuracy", "loss", "gpu_counters")})
    assert got["backend"] == "torch"
    if not DRY_RUN:
        assert got["device"].startswith("cuda"), got["device"]
        assert got["gpu_counters"]["nccl_collectives"] > 0, got["gpu_counters"]
        assert got["gpu_counters"]["host_staged_bytes"] == 0, got["gpu_counters"]
    # The CPU backends reach 0.84375 on this data (tests/test_keras_backends.py).
    assert abs(got["accuracy"] - 0.84375) <= 0.01, got["accuracy"]
