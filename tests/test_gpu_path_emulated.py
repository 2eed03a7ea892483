"""The core's GPU path (native/gpu/gpu_path.cc) on every machine: CUDA tensors through NCCL,
with the CUDA runtime and NCCL replaced by host-memory stand-ins (tests/fake_cuda/fake_cuda.cc,
loaded through SPARK_HVD_CUDART_LIBRARY / SPARK_HVD_NCCL_LIBRARY as a user's real ones are).

Real processes through the launcher hand the core NumPy buffers as tensors on CUDA devices
(tests/workers/gpu_emulated.py). What runs is the core's own code: ready events on the
caller's stream, the core's stream waiting for them, communicators made over the job's links,
fused allreduces through the GPU fusion buffer, device results for allgather, alltoall and
reducescatter, the staged path for what NCCL cannot run, the hierarchical NCCL allreduce, the
finalizer and its counters, and aborting the communicators when a peer is lost. What only a
GPU can show (kernels, streams, NCCL's transports, speed) is tests/gpu's, on a GPU machine.
"""

import re

import pytest

import fake_cuda
from conftest import run_job

@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The environment that makes a job's core load the emulated CUDA runtime and NCCL."""
    return fake_cuda.build(tmp_path_factory.mktemp("fake_cuda"))


def counters(result, rank):
    line = next(line for line in result.lines(rank) if line.startswith("COUNTERS "))
    return {k: int(v) for k, v in (kv.split("=") for kv in line.split()[1:])}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np_,transport,hierarchical", [
    (2, "shm", False), (3, "tcp", False), (4, "hosts", True)])
def test_collectives_on_emulated_gpus(emulated, np_, transport, hierarchical):
    """Every collective on "CUDA" buffers, one GPU per rank: right results (NumPy references),
    the same bits on every rank, through NCCL (counted, each with its latency split), and only
    the int16 allreduce, a type NCCL lacks, staged through host memory; a process set's own
    communicators (removed with it); a joined rank taking part with zeros. Over two hosts with
    HOROVOD_HIERARCHICAL_ALLREDUCE=1 the allreduces take the hierarchical NCCL path."""
    env = {**emulated, "SPARK_HVD_DYNAMIC_PROCESS_SETS": "1"}
    if hierarchical:
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
    r = run_job(np_, "gpu_emulated", "check", transport=transport, env=env, timeout=160)
    r.assert_ok(np_)
    for rank in range(np_):
        c = counters(r, rank)
        assert c["nccl_collectives"] >= 25, (rank, c)
        # Timed: the ops of this rank's own tensors (not the joined rank's 3 with zeros).
        joined = 3 if rank == np_ - 1 else 0
        assert c["latency_ops"] == c["nccl_collectives"] - joined, (rank, c)
        assert c["latency_gpu_ns"] > 0 and c["latency_launch_ns"] > 0, (rank, c)
        assert c["host_staged_bytes"] == 400, (rank, c)  # int16: 200 bytes in, 200 out
        if hierarchical:
            assert c["nccl_hierarchical_allreduces"] >= 20, (rank, c)
        else:
            assert c["nccl_hierarchical_allreduces"] == 0, (rank, c)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shared", ["host", "nccl"])
def test_ranks_sharing_a_gpu(emulated, shared):
    """Two ranks on one GPU, which NCCL refuses: by default every collective goes through host
    memory, with one warning naming the ranks and the settings; SPARK_HVD_SHARED_GPU=nccl runs
    them through NCCL (each rank its own NCCL host). Results are right either way."""
    env = {**emulated, "SPARK_HVD_TEST_DEVICE": "0", "SPARK_HVD_SHARED_GPU": shared}
    r = run_job(2, "gpu_emulated", "check", transport="shm", env=env, timeout=100)
    r.assert_ok(2)
    c = counters(r, 0)
    warning = "ranks 0 and 1 (process set 0) share one GPU"
    if shared == "host":
        assert c["nccl_collectives"] == 0 and c["host_staged_bytes"] > 10_000_000, c
        assert r.stderr.count(warning) == 1, r.describe()
        assert "SPARK_HVD_SHARED_GPU=nccl" in r.stderr, r.describe()
    else:
        assert c["nccl_collectives"] >= 25 and c["host_staged_bytes"] == 400, c
        assert warning not in r.stderr, r.describe()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_,transport,hierarchical", [(3, "tcp", False), (4, "hosts", True)])
def test_a_lost_rank_fails_the_nccl_ops_in_flight(emulated, tmp_path, np_, transport,
                                                  hierarchical):
    """The last rank's NCCL work hangs and it is SIGKILLed while the ranks stream 16 MiB
    allreduces: the others, waiting in NCCL for its data (NCCL's work waits for a lost peer
    until its communicator is aborted), raise HorovodInternalError naming it within 10 s
    instead of hanging. The failed op's output does not change after the error, not even at
    shutdown: the work queued after the hung kernel (hierarchical: the copies out of the
    fusion buffer) ended before the core handed the buffer back."""
    env = {**emulated, "KILL_TIME_FILE": tmp_path / "killed_at",
           "SPARK_HVD_KILL_GRACE_SECONDS": 20}
    if hierarchical:
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
    r = run_job(np_, "gpu_emulated", "lost", transport=transport, env=env, timeout=100)
    for line in survivors_lost_lines(r, np_):
        detect = float(re.search(r"detect=(-?[\d.]+)", line).group(1))
        assert 0 <= detect < 10, r.describe()
        assert "rewritten=0" in line, r.describe()
    assert "did not end within" not in r.stderr, r.describe()


@pytest.mark.timeout(120)
def test_gpu_work_stuck_past_the_abort_is_given_up_after_10_s(emulated, tmp_path):
    """As above, but the survivors' hung NCCL work ignores the abort, as on a GPU that is
    stuck for real: the core waits for it 10 s after the abort (so that stale work cannot write
    tensors already handed back), then warns once and fails the op anyway, instead of keeping
    the caller forever."""
    env = {**emulated, "KILL_TIME_FILE": tmp_path / "killed_at", "FAKE_NCCL_STUCK": "1",
           "SPARK_HVD_KILL_GRACE_SECONDS": 30}
    r = run_job(3, "gpu_emulated", "lost", transport="tcp", env=env, timeout=100)
    for line in survivors_lost_lines(r, 3):
        detect = float(re.search(r"detect=(-?[\d.]+)", line).group(1))
        assert 9.5 <= detect < 25, r.describe()
    warning = "GPU work of aborted collectives did not end within 10 s of the abort"
    assert r.stderr.count(warning) == 2, r.describe()   # one per survivor


def survivors_lost_lines(r, np_: int) -> list[str]:
    """The LOST lines of the ranks that survived the last one's SIGKILL, checked for the
    error that names it; the job failed (a rank was killed) and nothing segfaulted."""
    assert r.returncode != 0, r.describe()
    assert f"rank {np_ - 1} was killed by signal 9" in r.stderr, r.describe()
    lines = []
    for rank in range(np_ - 1):
        lost = [line for line in r.lines(rank) if line.startswith("LOST ")]
        assert lost and r.markers(rank), r.describe()
        assert "HorovodInternalError" in lost[0] and f"rank {np_ - 1}" in lost[0], lost[0]
        lines.append(lost[0])
    assert "Segmentation fault" not in r.stderr, r.describe()
    return lines
