"""Every collective x dtype x shape x process set, through the real launcher and real processes,
against NumPy references (tests/workers/collectives.py does the checking; one launch covers
thousands of cases and reports each failure).

Transports: shared memory on one host, TCP only, and two simulated hosts (127.0.0.1 and
127.0.0.2: TCP between them, shared memory inside one).
"""

import subprocess

import pytest

from conftest import PY, REPO, TRANSPORTS, WORKERS, job_env, load_timeline, run_job


def _expected_shm(transport, np_, rank):
    """Whether ``rank`` talks to some peer over shared memory."""
    if transport == "tcp":
        return 0
    if transport == "shm":
        return 1
    first_host = (np_ + 1) // 2
    on_first = rank < first_host
    return int((first_host if on_first else np_ - first_host) > 1)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("np_", [2, 3])
def test_op_matrix(np_, transport):
    """Allreduce (every op, prescale/postscale, sync/async/in place), grouped allreduce,
    allgather (uneven first dims), broadcast from every root, alltoall (even and uneven splits,
    received splits), reducescatter (uneven rows), barrier, on every dtype and dims 1-3, on the
    global set and two static subsets; results bitwise identical on every member. The large
    (8M-element) cases run where they add a path: every 2-rank transport and 3 ranks across
    two hosts (ring / recursive doubling over links)."""
    args = ["--sets", "static"]
    if np_ == 2 or transport == "hosts":
        args.append("--large")
    r = run_job(np_, "collectives", *args, transport=transport, timeout=220)
    r.assert_ok(np_)
    first_host = (np_ + 1) // 2 if transport == "hosts" else np_
    for rank in range(np_):
        assert int(r.field(rank, "shm")) == _expected_shm(transport, np_, rank), r.describe()
        local_size = first_host if rank < first_host else np_ - first_host
        assert int(r.field(rank, "local_size")) == local_size, r.describe()
    assert int(r.field(0, "cross_size")) == (2 if transport == "hosts" else 1), r.describe()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("threshold", [1, 2 ** 40], ids=["ring_always", "doubling_always"])
def test_algorithm_threshold(threshold):
    """SPARK_HVD_RING_THRESHOLD forces the ring (1 byte) or recursive doubling (1 TiB) for every
    size, with 3 ranks (not a power of two) over TCP, on odd and large sizes."""
    r = run_job(3, "collectives", "--sets", "none", "--large", "--suites",
                "allreduce,grouped_allreduce,allreduce_average_default",
                transport="tcp", env={"SPARK_HVD_RING_THRESHOLD": threshold}, timeout=160)
    r.assert_ok(3)


@pytest.mark.timeout(180)
def test_shared_memory_small_chunks():
    """The shared-memory group with 4 KiB chunks: many chunk and slice boundaries inside and
    across fused tensors of every dtype."""
    r = run_job(3, "collectives", "--sets", "none", "--suites",
                "allreduce,grouped_allreduce", transport="shm",
                env={"SPARK_HVD_SHM_CHUNK_BYTES": 4096}, timeout=160)
    r.assert_ok(3)


def _allreduce_paths(timeline):
    """The shared-memory allreduce paths rank 0's timeline names."""
    return {p for seq in load_timeline(timeline).values() for _, p in seq
            if p in ("SHM_ALLREDUCE", "SHM_SINGLE_COPY_ALLREDUCE", "SHM_ARENA_ALLREDUCE")}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np_", [2, 3])
def test_shared_memory_small_allreduces(tmp_path, np_):
    """Allreduces of up to 8 KiB take the one-wait path (every member reduces every member's
    copy itself), larger ones the sliced slots path: every dtype and op, fused and not, in
    place and into a separate output, exact and bitwise equal on every rank. Rank 0's
    timeline names both paths."""
    timeline = tmp_path / "timeline.json"
    r = run_job(np_, "collectives", "--sets", "none", "--suites",
                "allreduce,grouped_allreduce,allreduce_average_default", transport="shm",
                env={"SPARK_HVD_TIMELINE": timeline}, timeout=160)
    r.assert_ok(np_)
    paths = {p for seq in load_timeline(timeline).values() for _, p in seq
             if p.startswith("SHM_")}
    assert {"SHM_SMALL_ALLREDUCE", "SHM_ALLREDUCE"} <= paths, paths


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np_", [2, 3])
def test_shared_arenas_reduce_in_place(tmp_path, np_):
    """Arrays in the core's shared arenas on every rank: large allreduces are reduced in place
    (each member reads its share of everyone's tensors and writes the sums into all of them),
    exactly, for every dtype and op, fused, in place and into a separate output, with Average
    bitwise equal on every rank; 4 KiB chunks split each share into pieces across tensor
    boundaries. Rank 0's timeline and every rank's count name the path."""
    timeline = tmp_path / "timeline.json"
    r = run_job(np_, "shared_arenas", "--mode", "numpy", transport="shm",
                env={"SPARK_HVD_SHM_CHUNK_BYTES": 4096, "SPARK_HVD_TIMELINE": timeline},
                timeout=160)
    r.assert_ok(np_)
    assert "SHM_ARENA_ALLREDUCE" in _allreduce_paths(timeline)
    for rank in range(np_):
        assert int(r.field(rank, "inplace")) >= 20, r.describe()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("why", ["rank 1's arrays in ordinary memory",
                                 "rank 1 sets SPARK_HVD_SHARED_GRADIENTS=0"])
def test_shared_arenas_need_every_rank(tmp_path, why):
    """Rank 1's arrays are in ordinary memory, or rank 1 refuses arenas: every rank keeps the
    copying paths (also ranks 0 and 2, whose arrays are in arenas), with the same exact
    results."""
    timeline = tmp_path / "timeline.json"
    env = ({"ARENA_RANKS": "0,2"} if "ordinary" in why
           else {"ENV_OF_RANK_1": "SPARK_HVD_SHARED_GRADIENTS=0"})
    r = run_job(3, "shared_arenas", "--mode", "numpy", transport="shm",
                env={**env, "SPARK_HVD_TIMELINE": timeline}, timeout=160)
    r.assert_ok(3)
    assert _allreduce_paths(timeline) == {"SHM_ALLREDUCE"}
    assert [int(r.field(rank, "inplace")) for rank in range(3)] == [0, 0, 0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("np_", [2, 3])
def test_shared_memory_single_copy(tmp_path, np_):
    """Every allreduce through the single-copy path (members read each other's tensors with
    process_vm_readv; its size threshold set to 0) with 4 KiB chunks: slices that span fused
    tensors, in place and not, every dtype and op, and with 3 members the partial sums. Rank
    0's timeline names the path."""
    timeline = tmp_path / "timeline.json"
    r = run_job(np_, "collectives", "--sets", "none", "--suites",
                "allreduce,grouped_allreduce,allreduce_average_default", transport="shm",
                env={"SPARK_HVD_SHM_SINGLE_COPY_MIN_BYTES": 0, "SPARK_HVD_SHM_CHUNK_BYTES": 4096,
                     "SPARK_HVD_TIMELINE": timeline}, timeout=160)
    r.assert_ok(np_)
    assert _allreduce_paths(timeline) == {"SHM_SINGLE_COPY_ALLREDUCE"}


@pytest.mark.timeout(180)
def test_shared_memory_single_copy_refused(tmp_path):
    """One rank may not read its peers' memory (a seccomp filter makes process_vm_readv fail,
    as some container profiles do): every member keeps the slots path, including rank 0, which
    could read the others; the results are still right."""
    timeline = tmp_path / "timeline.json"
    r = run_job(3, "collectives", "--sets", "none", "--suites", "allreduce,grouped_allreduce",
                transport="shm",
                env={"SPARK_HVD_SHM_SINGLE_COPY_MIN_BYTES": 0, "DENY_PROCESS_VM_READV_RANK": 1,
                     "SPARK_HVD_TIMELINE": timeline}, timeout=160)
    r.assert_ok(3)
    assert _allreduce_paths(timeline) == {"SHM_ALLREDUCE"}


@pytest.mark.timeout(180)
def test_shared_memory_settings_of_rank_0_apply(tmp_path):
    """Shared-memory settings that differ between ranks (rank 1: single copy from 0 bytes and
    4 KiB chunks, rank 2: single copy off) cannot split a set: rank 0's apply to every member
    (rank 0's defaults keep these small tensors on the slots path)."""
    timeline = tmp_path / "timeline.json"
    r = run_job(3, "collectives", "--sets", "none", "--suites", "allreduce,grouped_allreduce",
                transport="shm",
                env={"ENV_OF_RANK_1": "SPARK_HVD_SHM_SINGLE_COPY_MIN_BYTES=0 "
                                      "SPARK_HVD_SHM_CHUNK_BYTES=4096",
                     "ENV_OF_RANK_2": "SPARK_HVD_SHM_SINGLE_COPY=0",
                     "SPARK_HVD_TIMELINE": timeline}, timeout=160)
    r.assert_ok(3)
    assert _allreduce_paths(timeline) == {"SHM_ALLREDUCE"}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_adasum_four_ranks(transport):
    """op=Adasum over 4 ranks (two levels of pairwise combination) against a float64
    reference, single and fused; the 3-rank static sets refuse it (not a power of two)."""
    r = run_job(4, "collectives", "--sets", "static", "--suites", "adasum",
                transport=transport, timeout=130)
    r.assert_ok(4)


@pytest.mark.timeout(120)
def test_single_process_job():
    """A script started without a launcher is a job of size 1: every op returns its input
    (reduced over one rank)."""
    env = job_env()
    proc = subprocess.run([PY, str(WORKERS / "collectives.py"), "--sets", "none"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "OK rank=0 " in proc.stdout, proc.stdout[-5000:]
