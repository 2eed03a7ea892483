"""MPI as the data path of CPU collectives (``HOROVOD_CPU_OPERATIONS=MPI``), under real
``mpirun`` with the machine's Open MPI.

Each test starts ``mpirun -np N python tests/test_mpi_backend.py <scenario>``: this file is also
the ranks' script. A rank prints ``OK rank=<job rank> ...`` when its scenario held, ``FAIL
<what>`` otherwise. The proof that data went through MPI is the plugin's own counter of the
MPI collectives it ran (``_mpi.collective_counts``, read from the loaded plugin) and rank 0's
timeline, which names the path of every collective (MPI_ALLREDUCE, ...).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MPIRUN = shutil.which("mpirun")
PY = sys.executable

# Every collective's path name in the timeline when MPI runs it.
MPI_PATHS = ("MPI_ALLREDUCE", "MPI_ALLGATHER", "MPI_BROADCAST", "MPI_ALLTOALL",
             "MPI_REDUCESCATTER")


# ---------------------------------------------------------------------------------------------
# The ranks' side (run under mpirun as a script).

def _values(dtype, shape, rank, salt=0):
    """Small exact values (so that every reduction is exact in every dtype): 1..3, signed
    types -1..1, bool alternating; different on every rank."""
    import numpy as np
    i = np.arange(int(np.prod(shape))).reshape(shape)
    if dtype == np.bool_:
        return (i + rank + salt) % 2 == 0
    v = (i + rank + salt) % 3 + 1
    if np.issubdtype(dtype, np.signedinteger):
        v = v - 2
    return v.astype(dtype)


def _expected(inputs, op, n):
    import numpy as np
    stack = np.stack(inputs)
    dtype = stack.dtype
    if dtype == np.bool_:
        return {"Sum": stack.any(0), "Max": stack.any(0), "Min": stack.all(0),
                "Product": stack.all(0)}[op]
    wide = stack.astype(np.float64)
    if op in ("Sum", "Average"):
        out = wide.sum(0)
        if op == "Average":  # the core scales in double; integers round toward zero
            out = out * (1.0 / n)
            if not np.issubdtype(dtype, np.floating):
                out = np.trunc(out)
    else:
        out = {"Min": wide.min(0), "Max": wide.max(0), "Product": wide.prod(0)}[op]
    return out.astype(dtype)


def emit(line):
    """Prints a result line, and appends it to this process's file in $MPI_TEST_OUT (mpirun
    interleaves the ranks' output mid-line)."""
    print(line, flush=True)
    out = os.environ.get("MPI_TEST_OUT")
    if out:
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "x")
        with open(os.path.join(out, f"world{rank}.txt"), "a") as f:
            f.write(line + "\n")


class Checker:
    def __init__(self, rank):
        self.rank, self.failures = rank, []

    def equal(self, got, want, what, tol=0.0):
        import numpy as np
        got, want = np.asarray(got), np.asarray(want)
        ok = got.shape == want.shape and got.dtype == want.dtype and (
            np.array_equal(got, want) if tol == 0 else
            np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol))
        if not ok:
            self.failures.append(f"{what}: got {got.dtype}{got.shape} {got.ravel()[:8]}, want "
                                 f"{want.dtype}{want.shape} {want.ravel()[:8]}")

    def true(self, cond, what):
        if not cond:
            self.failures.append(what)

    def report(self, **fields):
        for f in self.failures:
            emit(f"FAIL rank={self.rank} {f}")
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        if not self.failures:
            emit(f"OK rank={self.rank} {extra}")


def _numpy_dtypes():
    import numpy as np
    return [np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64, np.float16, np.float32,
            np.float64, np.bool_]


def _collectives(hvd, c, process_set, members, tag):
    """Every collective of the numpy API on `process_set` (job ranks `members`), every dtype
    and reduce op, against numpy. Returns how many of each it ran."""
    import numpy as np
    me, n = members.index(hvd.rank()), len(members)
    ran = dict.fromkeys(("allreduce", "allgather", "broadcast", "alltoall", "reducescatter"), 0)
    kw = {"process_set": process_set}
    for dt in _numpy_dtypes():
        name = np.dtype(dt).name
        ops = ["Sum", "Min", "Max", "Product"] + ([] if dt == np.bool_ else ["Average"])
        for op in ops:
            ins = [_values(dt, (4, 3), r) for r in range(n)]
            got = hvd.allreduce(ins[me], op=getattr(hvd, op), name=f"{tag}.ar.{name}.{op}", **kw)
            c.equal(got, _expected(ins, op, n), f"allreduce {name} {op}")
            ran["allreduce"] += 1
        # Ragged first dimensions: member i gives i + 1 rows (and a member may give none).
        rows = [(i + 1) if i != 1 else 0 for i in range(n)]
        ins = [_values(dt, (rows[i], 2), i, salt=5) for i in range(n)]
        got = hvd.allgather(ins[me], name=f"{tag}.ag.{name}", **kw)
        c.equal(got, np.concatenate(ins), f"allgather {name}")
        # From the last member (root_rank is a global rank, as in Horovod).
        got = hvd.broadcast(_values(dt, (7,), me, salt=1), root_rank=members[-1],
                            name=f"{tag}.bc.{name}", **kw)
        c.equal(got, _values(dt, (7,), n - 1, salt=1), f"broadcast {name}")
        # Uneven splits: member i sends j + i % 2 rows to member j.
        splits = [[j + i % 2 for j in range(n)] for i in range(n)]
        sent = [_values(dt, (sum(splits[i]), 2), i, salt=2) for i in range(n)]
        got, got_splits = hvd.alltoall(sent[me], splits=splits[me], name=f"{tag}.a2a.{name}",
                                       **kw)
        want = np.concatenate([np.split(sent[i], np.cumsum(splits[i])[:-1])[me]
                               for i in range(n)])
        c.equal(got, want, f"alltoall {name}")
        c.equal(got_splits, np.array([splits[i][me] for i in range(n)], np.int64),
                f"alltoall splits {name}")
        for kind in ("allgather", "broadcast", "alltoall"):
            ran[kind] += 1
        if dt != np.bool_:
            # 2n + 1 rows: the first (rows % n) members get one more (Horovod's rule).
            total = 2 * n + 1
            for op in ("Sum", "Average"):
                ins = [_values(dt, (total, 2), r, salt=3) for r in range(n)]
                got = hvd.reducescatter(ins[me], op=getattr(hvd, op), name=f"{tag}.rs.{name}.{op}",
                                        **kw)
                full = _expected(ins, op, n)
                start = sum(total // n + (i < total % n) for i in range(me))
                mine = total // n + (me < total % n)
                c.equal(got, full[start:start + mine], f"reducescatter {name} {op}",
                        tol=1e-3 if dt == np.float16 else 0.0)
                ran["reducescatter"] += 1
    # Fused allreduce of several tensors, prescaled and postscaled (the engine packs and scales).
    ins = [[_values(np.float32, (5,), r, salt=k) for r in range(n)] for k in range(3)]
    got = hvd.grouped_allreduce([t[me] for t in ins], op=hvd.Sum, prescale_factor=2.0,
                                postscale_factor=0.25, name=f"{tag}.grouped", **kw)
    for k in range(3):
        c.equal(got[k], _expected(ins[k], "Sum", n) * np.float32(0.5), f"grouped {k}")
    ran["allreduce"] += 1
    return ran


def _torch_bfloat16(c, members, tag, process_set):
    """bfloat16 (torch's; numpy has none) through the user-defined MPI ops."""
    import torch
    import spark_hvd.torch as thvd
    me, n = members.index(thvd.rank()), len(members)
    for op in ("Sum", "Min", "Max", "Product", "Average"):
        ins = [torch.arange(6, dtype=torch.float32).add(r).remainder(3).add(1) for r in range(n)]
        got = thvd.allreduce(ins[me].to(torch.bfloat16), op=getattr(thvd, op),
                             name=f"{tag}.bf16.{op}", process_set=process_set)
        stack = torch.stack(ins)
        want = {"Sum": stack.sum(0), "Min": stack.min(0).values, "Max": stack.max(0).values,
                "Product": stack.prod(0), "Average": stack.sum(0) / n}[op]
        ok = got.dtype == torch.bfloat16 and torch.allclose(got.float(), want, rtol=1e-2)
        c.true(ok, f"bfloat16 allreduce {op}: got {got.tolist()}, want {want.tolist()}")
    return 5


def _timeline_paths(path):
    with open(path) as f:
        events = json.load(f)
    return {e.get("name") for e in events}


def scenario_all():
    """Every collective, dtype and op on the global set through MPI; Adasum stays ours."""
    import numpy as np
    from mpi4py import MPI  # noqa: F401  (initialises MPI, thread level multiple)
    import spark_hvd.numpy as hvd
    from spark_hvd.common import _mpi
    hvd.init()
    c = Checker(hvd.rank())
    c.true(hvd.mpi_built() and hvd.mpi_enabled() and hvd.mpi_threads_supported(),
           "mpi_built / mpi_enabled / mpi_threads_supported")
    before = _mpi.collective_counts()
    ran = _collectives(hvd, c, hvd.global_process_set, list(range(hvd.size())), "g")
    ran["allreduce"] += _torch_bfloat16(c, list(range(hvd.size())), "g",
                                        hvd.global_process_set)
    after = _mpi.collective_counts()
    for kind, count in ran.items():
        c.true(after[kind] - before[kind] == count,
               f"{kind}: {after[kind] - before[kind]} through MPI, {count} run")
    # Adasum is not an MPI reduction: it runs on spark_hvd's own path.
    size = hvd.size()
    if size in (1, 2, 4):
        x = np.full(8, float(hvd.rank() + 1), np.float32)
        hvd.allreduce(x, op=hvd.Adasum, name="adasum")
        c.true(_mpi.collective_counts()["allreduce"] == after["allreduce"],
               "Adasum went through MPI")
    hvd.shutdown()
    c.true(not hvd.mpi_enabled(), "mpi_enabled after shutdown")
    timeline = os.environ.get("HOROVOD_TIMELINE")
    if c.rank == 0 and timeline:
        paths = _timeline_paths(timeline)
        missing = [p for p in MPI_PATHS if p not in paths]
        c.true(not missing, f"timeline lacks {missing}")
        c.true(size not in (1, 2, 4) or "ADASUM_ALLREDUCE" in paths,
               "timeline lacks ADASUM_ALLREDUCE")
        c.true(not any(p in paths for p in ("RING_ALLREDUCE", "RECURSIVE_DOUBLING_ALLREDUCE",
                                            "SHM_ALLREDUCE", "RING_ALLGATHER", "TREE_BROADCAST",
                                            "PAIRWISE_ALLTOALL", "RING_REDUCESCATTER")),
               f"timeline shows the core's own paths: {sorted(p for p in paths if p)}")
    c.report(counts=",".join(f"{k}:{v}" for k, v in _mpi.collective_counts().items()))


def scenario_process_sets():
    """Static and dynamic process sets get MPI communicators of their members."""
    from mpi4py import MPI  # noqa: F401
    import spark_hvd.numpy as hvd
    from spark_hvd.common import _mpi
    even, tail = hvd.ProcessSet([0, 2]), hvd.ProcessSet([1, 2])
    hvd.init(process_sets=[even, tail])
    c = Checker(hvd.rank())
    before = _mpi.collective_counts()["allgather"]
    expected = 0
    for ps in (even, tail):
        if ps.included():
            _collectives(hvd, c, ps, ps.ranks, f"ps{ps.process_set_id}")
            expected += len(_numpy_dtypes())
    c.true(_mpi.collective_counts()["allgather"] - before == expected, "allgathers via MPI")
    # join(): the joined ranks take part in rank 0's last allreduce with zeros, through MPI.
    import numpy as np
    hvd.barrier()
    before = _mpi.collective_counts()["allreduce"]
    if hvd.rank() == 0:
        got = hvd.allreduce(np.full(3, 5.0), op=hvd.Sum, name="after_join")
        c.equal(got, np.full(3, 5.0), "allreduce with the others joined")
    hvd.join()
    c.true(_mpi.collective_counts()["allreduce"] - before == 1, "joined allreduce via MPI")
    hvd.shutdown()
    c.report()


def scenario_sub_comm():
    """init(comm=<sub-communicator of MPI_COMM_WORLD>): world ranks 0, 1 form one job, the
    others (rank 2) one of their own; MPI runs each job's collectives on its communicator."""
    import numpy as np
    from mpi4py import MPI
    import spark_hvd.numpy as hvd
    from spark_hvd.common import _mpi
    world = MPI.COMM_WORLD
    sub = world.Split(color=0 if world.rank < 2 else 1, key=world.rank)
    hvd.init(comm=sub)
    c = Checker(world.rank)
    c.true(hvd.size() == sub.size and hvd.rank() == sub.rank, "rank/size of the sub job")
    got = hvd.allreduce(np.full(3, world.rank + 1.0), op=hvd.Sum, name="x")
    want = sum(r + 1.0 for r in range(world.size) if (r < 2) == (world.rank < 2))
    c.equal(got, np.full(3, want), "allreduce in the sub job")
    got = hvd.allgather(np.array([world.rank]), name="who")
    c.equal(got, np.array([r for r in range(world.size) if (r < 2) == (world.rank < 2)]),
            "allgather in the sub job")
    counts = _mpi.collective_counts()
    # A job of one exchanges nothing: no MPI call at all.
    c.true((counts["allreduce"], counts["allgather"]) == ((1, 1) if sub.size > 1 else (0, 0)),
           f"MPI counts {counts}")
    hvd.shutdown()
    c.report()


def scenario_list_comm():
    """init(comm=[2, 0]) (Horovod's list of MPI_COMM_WORLD ranks): job rank i is world rank
    ranks[i]; a process not in the list is refused."""
    import numpy as np
    from mpi4py import MPI
    import spark_hvd.numpy as hvd
    from spark_hvd.common import _mpi
    world = MPI.COMM_WORLD
    ranks = [2, 0]
    c = Checker(world.rank)
    if world.rank not in ranks:
        try:
            hvd.init(comm=ranks)
            c.true(False, "init(comm=[2, 0]) on world rank 1 did not raise")
        except ValueError as e:
            c.true("not one of them" in str(e), f"message: {e}")
        c.report(job="none")
        return
    hvd.init(comm=ranks)
    c.true(hvd.rank() == ranks.index(world.rank) and hvd.size() == 2, "job rank order")
    got = hvd.allgather(np.array([world.rank]), name="who")
    c.equal(got, np.array(ranks), "allgather of world ranks in job order")
    got = hvd.broadcast(np.array([world.rank]), root_rank=0, name="root")
    c.equal(got, np.array([2]), "broadcast from job rank 0 (world rank 2)")
    counts = _mpi.collective_counts()
    c.true(counts["allgather"] == 1 and counts["broadcast"] == 1, f"MPI counts {counts}")
    hvd.shutdown()
    c.report(job=f"{ranks.index(world.rank)}of{len(ranks)}")


def scenario_default():
    """Without the setting, mpirun jobs use spark_hvd's own transport: nothing through MPI."""
    import numpy as np
    from mpi4py import MPI  # noqa: F401
    import spark_hvd.numpy as hvd
    from spark_hvd.common import _mpi
    hvd.init()
    c = Checker(hvd.rank())
    got = hvd.allreduce(np.ones(4), op=hvd.Sum, name="x")
    c.equal(got, np.full(4, float(hvd.size())), "allreduce")
    c.true(hvd.mpi_built() and not hvd.mpi_enabled(), "mpi_built and not mpi_enabled")
    c.true(sum(_mpi.collective_counts().values()) == 0, "collectives went through MPI")
    try:
        hvd.mpi_threads_supported()
        c.true(False, "mpi_threads_supported() without MPI operations did not raise")
    except ValueError:
        pass
    hvd.shutdown()
    c.report()


def scenario_refused():
    """init refuses what MPI operations cannot do, on every rank, with the reason: argv[2] is
    what to break (mismatch, funneled, unknown); prints OK with the message's gist."""
    how = sys.argv[2]
    if how == "funneled":
        import mpi4py
        mpi4py.rc.thread_level = "funneled"
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.rank
    if how == "mismatch":
        os.environ["HOROVOD_CPU_OPERATIONS"] = "MPI" if rank == 0 else "gloo"
    import spark_hvd.numpy as hvd
    c = Checker(rank)
    try:
        hvd.init()
        c.true(False, "init did not raise")
        hvd.shutdown()
    except (ValueError, RuntimeError) as e:
        emit(f"ERROR rank={rank} {type(e).__name__}: {e}")
    c.report()


def worker_main():
    globals()["scenario_" + sys.argv[1]]()


if __name__ == "__main__":
    worker_main()
    sys.exit(0)


# ---------------------------------------------------------------------------------------------
# The tests (pytest).

import pytest  # noqa: E402

from spark_hvd.common import _config, _mpi  # noqa: E402

pytestmark = pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI) is not installed")


def mpirun(np_, scenario, *args, env=None, timeout=60, pythonpath=None):
    """Runs this file's ``scenario`` on ``np_`` ranks under mpirun; returns (exit code,
    stdout + stderr)."""
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("SPARK_HVD_", "HOROVOD_", "OMPI_", "PMIX_"))}
    full.update({"PYTHONPATH": str(pythonpath or REPO), "PYTHONUNBUFFERED": "1",
                 "SPARK_HVD_START_TIMEOUT": "30", "OMPI_MCA_rmaps_base_oversubscribe": "1"})
    full.update(env or {})
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", str(np_),
           "--mca", "btl", "self,vader,tcp"]
    for name in sorted(k for k in full if k.startswith(("SPARK_HVD_", "HOROVOD_"))):
        cmd += ["-x", name]
    cmd += [PY, __file__, scenario, *args]
    with tempfile.TemporaryDirectory() as out_dir:
        full["MPI_TEST_OUT"] = out_dir
        proc = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout,
                              cwd=REPO)
        results = "".join(p.read_text() for p in sorted(Path(out_dir).iterdir()))
    # The ranks' result lines, whole, then everything mpirun printed.
    return proc.returncode, results + "--- mpirun ---\n" + proc.stdout + proc.stderr


def assert_ok(out, ranks):
    out = out.split("--- mpirun ---")[0]
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert not fails, out
    for r in ranks:
        assert re.search(rf"^OK rank={r}\b", out, re.M), f"rank {r} did not finish\n{out}"


MPI = {"HOROVOD_CPU_OPERATIONS": "MPI"}


def test_mpi_built_tells_the_truth():
    """mpi_built(): the plugin is there and loads; build.py builds it wherever mpicxx finds
    mpi.h (as on this machine)."""
    from spark_hvd.common import basics
    assert basics.mpi_built() == os.path.exists(_mpi.plugin_path())
    if shutil.which("mpicxx"):
        assert basics.mpi_built(), f"{_mpi.plugin_path()} missing: run build.py"
    assert not basics.mpi_enabled()  # not initialised
    out = subprocess.run([PY, "-m", "spark_hvd.runner", "--check-build"], capture_output=True,
                         text=True, cwd=REPO, timeout=60).stdout
    mark = "[X]" if basics.mpi_built() else "[ ]"
    assert f"{mark} MPI" in out.split("Available tensor operations:")[1], out


def test_cpu_operations_setting(monkeypatch):
    """Horovod's values in any case; SPARK_HVD_ wins over HOROVOD_; clear errors otherwise."""
    for value, want in (("MPI", "mpi"), ("mpi", "mpi"), ("Gloo", "default"), ("", "default")):
        monkeypatch.setenv("HOROVOD_CPU_OPERATIONS", value)
        assert _config.cpu_operations() == want
    monkeypatch.setenv("SPARK_HVD_CPU_OPERATIONS", "gloo")
    monkeypatch.setenv("HOROVOD_CPU_OPERATIONS", "MPI")
    assert _config.cpu_operations() == "default"
    monkeypatch.delenv("SPARK_HVD_CPU_OPERATIONS")
    monkeypatch.setenv("HOROVOD_CPU_OPERATIONS", "nccl")
    with pytest.raises(ValueError, match="HOROVOD_CPU_OPERATIONS='nccl' is not a CPU operations"):
        _config.cpu_operations()
    monkeypatch.setenv("HOROVOD_CPU_OPERATIONS", "ccl")
    with pytest.raises(ValueError, match="oneCCL is not supported"):
        _config.cpu_operations()


def test_mpi_outside_an_mpi_job_is_refused():
    """A process no MPI launcher started cannot run its collectives through MPI."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPARK_HVD_", "HOROVOD_", "OMPI_", "PMIX_"))}
    env.update(PYTHONPATH=str(REPO), HOROVOD_CPU_OPERATIONS="mpi")
    proc = subprocess.run([PY, "-c", "import spark_hvd.numpy as hvd; hvd.init()"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "HOROVOD_CPU_OPERATIONS=MPI needs a job bootstrapped through MPI" in proc.stderr, \
        proc.stderr


# Three ranks (uneven blocks everywhere) take about 8 s on a 2-CPU machine.
@pytest.mark.parametrize("np_", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_collective_dtype_and_op_through_mpi(np_, tmp_path):
    timeline = tmp_path / "timeline.json"
    rc, out = mpirun(np_, "all", env={**MPI, "HOROVOD_TIMELINE": str(timeline)})
    assert rc == 0, out
    assert_ok(out, range(np_))


def test_process_sets_through_mpi():
    rc, out = mpirun(3, "process_sets", env=MPI)
    assert rc == 0, out
    assert_ok(out, range(3))


def test_init_with_a_sub_communicator():
    rc, out = mpirun(3, "sub_comm", env=MPI)
    assert rc == 0, out
    assert_ok(out, range(3))


def test_init_with_a_list_of_world_ranks():
    rc, out = mpirun(3, "list_comm", env=MPI)
    assert rc == 0, out
    assert_ok(out, range(3))
    assert re.search(r"^OK rank=2 job=0of2", out, re.M) and \
        re.search(r"^OK rank=0 job=1of2", out, re.M), out


def test_default_is_our_own_transport():
    rc, out = mpirun(2, "default")
    assert rc == 0, out
    assert_ok(out, range(2))


@pytest.mark.parametrize("how,env,message", [
    ("mismatch", {}, "HOROVOD_CPU_OPERATIONS differs between ranks (rank 0: mpi, rank 1: "
                     "default)"),
    ("funneled", MPI, "MPI was initialised with MPI_THREAD_FUNNELED"),
    ("unknown", {"HOROVOD_CPU_OPERATIONS": "shmem"}, "HOROVOD_CPU_OPERATIONS='shmem' is not a "
                                                     "CPU operations backend"),
])
def test_bad_settings_fail_on_every_rank(how, env, message):
    rc, out = mpirun(2, "refused", how, env=env)
    assert rc == 0, out
    assert_ok(out, range(2))
    for r in range(2):
        lines = [line for line in out.splitlines() if line.startswith(f"ERROR rank={r} ")]
        assert lines and message in lines[0], out


def test_plugin_not_built_is_refused(tmp_path):
    """A build without the plugin: mpi_built() is False and MPI operations are refused with the
    reason (a copy of the package without the libspark_hvd_mpi_*.so plugins)."""
    copy = tmp_path / "spark_hvd"
    shutil.copytree(REPO / "spark_hvd", copy,
                    ignore=shutil.ignore_patterns("__pycache__", "libspark_hvd_mpi_*.so"))
    check = subprocess.run([PY, "-c", "from spark_hvd.common import basics; "
                            "print(basics.mpi_built())"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path,
                           timeout=60)
    assert check.stdout.strip() == "False", check.stdout + check.stderr
    shown = subprocess.run([PY, "-m", "spark_hvd.runner", "--check-build"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                           cwd=tmp_path, timeout=60).stdout
    assert "[ ] MPI (spark_hvd's MPI plugin is not built" in shown, shown
    rc, out = mpirun(2, "refused", "missing", env=MPI, pythonpath=tmp_path)
    assert rc == 0, out
    assert_ok(out, range(2))
    assert "spark_hvd's MPI plugin is not built" in out, out
