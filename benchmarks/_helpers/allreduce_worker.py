"""One rank of ``benchmarks/allreduce.py``: times float32 allreduces for one system.

Not meant to be run by hand: ``benchmarks/allreduce.py`` starts two of these per system
(through ``spark-hvd-run``, as plain subprocesses for gloo, or under ``mpirun``) and passes the
plan as JSON. Every result is one line on stdout, ``@@BENCH {json}``, so the parent can parse it
even through the launcher's ``[rank]<stdout>:`` prefixes.

Systems:
  spark_hvd  ``hvd.allreduce_(arr, op=hvd.Sum, name=...)`` (rank/size from spark-hvd-run)
  gloo       ``torch.distributed.all_reduce`` on a CPU tensor (rank/size/port from arguments)
  mpi        ``comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)`` through mpi4py (under mpirun)
"""

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

MARK = "@@BENCH "
CHECK_BASE = 1000.0  # rank r contributes pattern + r * CHECK_BASE (exact in float32)


def emit(**record):
    # One write call per line: under mpirun both ranks share the forwarded stdout, and separate
    # writes for the text and its newline (print under PYTHONUNBUFFERED) can interleave.
    sys.stdout.write(MARK + json.dumps(record) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# Systems: each offers rank, size, barrier(), allreduce(buf) (in place, Sum, synchronous),
# grad_step(bufs) (all submitted asynchronously, then all waited for) and, optionally,
# grad_step_sync(bufs) (one by one), plus close().

class SparkHvd:
    name = "spark_hvd"

    def __init__(self, args):
        try:
            import spark_hvd.numpy as hvd
        except ImportError:  # a fresh checkout run without `pip install -e .`
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
                os.path.abspath(__file__)))))
            import spark_hvd.numpy as hvd
        self.hvd = hvd
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self._names = {}
        self._grad_names = None

    def meta(self):
        hvd = self.hvd
        info = {"shared_memory": bool(hvd.shared_memory_enabled())}
        try:
            from importlib.metadata import version
            info["version"] = version("spark-hvd")
        except Exception:
            pass
        info.update(_loaded_library("libspark_hvd_core"))
        return info

    def barrier(self):
        self.hvd.barrier()

    def allreduce(self, buf):
        name = self._names.get(buf.nbytes)
        if name is None:
            name = self._names[buf.nbytes] = f"bench.allreduce.{buf.nbytes}"
        self.hvd.allreduce_(buf, op=self.hvd.Sum, name=name)

    def grad_step(self, bufs):
        hvd = self.hvd
        if self._grad_names is None or len(self._grad_names) != len(bufs):
            self._grad_names = [f"bench.grad.{i}" for i in range(len(bufs))]
        handles = [hvd.allreduce_async_(b, op=hvd.Sum, name=n)
                   for b, n in zip(bufs, self._grad_names)]
        for h in handles:
            hvd.synchronize(h)

    grad_step_sync = None

    def close(self):
        self.hvd.shutdown()


class Gloo:
    name = "gloo"

    def __init__(self, args):
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        rank = int(os.environ.get("SPARK_HVD_RANK", args.rank))
        size = int(os.environ.get("SPARK_HVD_SIZE", args.size))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=rank, world_size=size)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self._buf = self._buf_tensor = None
        self._bufs = self._bufs_tensors = None

    def meta(self):
        return {"version": self.torch.__version__}

    def _tensor(self, buf):
        # torch.from_numpy shares memory: the reduction lands in buf (checked by the caller).
        # The last array is remembered (holding it keeps its address from being reused).
        if buf is not self._buf:
            self._buf, self._buf_tensor = buf, self.torch.from_numpy(buf)
        return self._buf_tensor

    def _tensors(self, bufs):
        if bufs is not self._bufs:
            self._bufs, self._bufs_tensors = bufs, [self.torch.from_numpy(b) for b in bufs]
        return self._bufs_tensors

    def barrier(self):
        self.dist.barrier()

    def allreduce(self, buf):
        self.dist.all_reduce(self._tensor(buf), op=self.dist.ReduceOp.SUM)

    def grad_step(self, bufs):
        dist = self.dist
        works = [dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True)
                 for t in self._tensors(bufs)]
        for w in works:
            w.wait()

    def grad_step_sync(self, bufs):
        dist = self.dist
        for t in self._tensors(bufs):
            dist.all_reduce(t, op=dist.ReduceOp.SUM)

    def close(self):
        self._buf = self._buf_tensor = self._bufs = self._bufs_tensors = None
        self.dist.destroy_process_group()


class Mpi:
    name = "mpi"

    def __init__(self, args):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def meta(self):
        import mpi4py
        lib = self.MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]
        return {"version": f"mpi4py {mpi4py.__version__}; {lib}"}

    def barrier(self):
        self.comm.Barrier()

    def allreduce(self, buf):
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)

    def grad_step(self, bufs):
        MPI = self.MPI
        reqs = [self.comm.Iallreduce(MPI.IN_PLACE, b, op=MPI.SUM) for b in bufs]
        MPI.Request.Waitall(reqs)

    grad_step_sync = None

    def close(self):
        pass


SYSTEMS = {"spark_hvd": SparkHvd, "gloo": Gloo, "mpi": Mpi}


def _loaded_library(stem):
    """Path, mtime and short sha256 of the shared library this process mapped, so a run can
    tell when the native core was rebuilt between two rounds."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if stem in line}
        path = sorted(paths)[0]
        import datetime
        import hashlib
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:12]
        mtime = datetime.datetime.fromtimestamp(os.path.getmtime(path))
        return {"core": digest, "core_built": mtime.isoformat(timespec="seconds"),
                "core_path": path}
    except (OSError, IndexError):
        return {}


# ---------------------------------------------------------------------------------------------

def stats(times):
    t = np.sort(np.asarray(times, dtype=np.float64))
    return {"n": int(t.size), "median_s": float(np.median(t)), "min_s": float(t[0]),
            "p10_s": float(np.percentile(t, 10)), "p90_s": float(np.percentile(t, 90)),
            "mean_s": float(t.mean())}


def check_allreduce(system, n):
    """One allreduce of a rank- and position-dependent pattern; returns (ok, detail)."""
    pattern = (np.arange(n, dtype=np.int32) % 251).astype(np.float32)
    buf = pattern + np.float32(system.rank * CHECK_BASE)
    system.allreduce(buf)
    expected = pattern * np.float32(system.size) + np.float32(
        CHECK_BASE * system.size * (system.size - 1) / 2)
    if np.array_equal(buf, expected):
        return True, ""
    bad = np.flatnonzero(buf != expected)
    i = int(bad[0])
    return False, (f"{bad.size} of {n} elements wrong; first at [{i}]: got {float(buf[i])}, "
                   f"expected {float(expected[i])}")


def time_size(system, nbytes, warmup, reps):
    n = max(1, nbytes // 4)
    ok, detail = check_allreduce(system, n)
    buf = np.zeros(n, dtype=np.float32)  # zeros: repeated in-place sums stay finite
    for _ in range(warmup):
        system.barrier()
        system.allreduce(buf)
    times = []
    clock = time.perf_counter
    for _ in range(reps):
        system.barrier()
        t0 = clock()
        system.allreduce(buf)
        times.append(clock() - t0)
    emit(kind="size", system=system.name, rank=system.rank, size=system.size, bytes=n * 4,
         warmup=warmup, correct=ok, error=detail or None, **stats(times))


def time_grad(system, step_fn, variant, tensors, elems, warmup, steps):
    bufs = [np.zeros(elems, dtype=np.float32) for _ in range(tensors)]
    # Correctness: tensor i on rank r holds i + r*CHECK_BASE (+ position pattern).
    pattern = (np.arange(elems, dtype=np.int32) % 251).astype(np.float32)
    for i, b in enumerate(bufs):
        b[:] = pattern + np.float32(i + system.rank * CHECK_BASE)
    step_fn(bufs)
    ok, detail = True, ""
    base = np.float32(CHECK_BASE * system.size * (system.size - 1) / 2)
    for i, b in enumerate(bufs):
        expected = (pattern + np.float32(i)) * np.float32(system.size) + base
        if not np.array_equal(b, expected):
            j = int(np.flatnonzero(b != expected)[0])
            ok, detail = False, (f"tensor {i} element [{j}]: got {float(b[j])}, "
                                 f"expected {float(expected[j])}")
            break
    for b in bufs:
        b[:] = 0
    for _ in range(warmup):
        system.barrier()
        step_fn(bufs)
    times = []
    clock = time.perf_counter
    for _ in range(steps):
        system.barrier()
        t0 = clock()
        step_fn(bufs)
        times.append(clock() - t0)
    emit(kind="grad", system=system.name, variant=variant, rank=system.rank, size=system.size,
         tensors=tensors, tensor_bytes=elems * 4, warmup=warmup, correct=ok,
         error=detail or None, **stats(times))


def measure_idle(system, seconds):
    """CPU time this process (every thread: the engine's included) uses while initialized and
    idle for `seconds`: a waiting engine must sleep, not spin."""
    system.barrier()
    t0 = os.times()
    time.sleep(seconds)
    t1 = os.times()
    emit(kind="idle", system=system.name, rank=system.rank, seconds=seconds,
         cpu_s=(t1.user + t1.system) - (t0.user + t0.system))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=sorted(SYSTEMS))
    p.add_argument("--plan", help="JSON plan written by benchmarks/allreduce.py")
    p.add_argument("--rank", type=int, default=0, help="gloo only")
    p.add_argument("--size", type=int, default=1, help="gloo only")
    p.add_argument("--port", type=int, default=0, help="gloo only")
    args = p.parse_args(argv)
    if not args.system or not args.plan:
        print("this is a helper of benchmarks/allreduce.py; run that instead")
        return 0
    plan = json.loads(args.plan)
    rank = os.environ.get("SPARK_HVD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
    rank = int(rank) if rank is not None else (args.rank if args.system == "gloo" else "?")
    try:
        system = SYSTEMS[args.system](args)
        rank = system.rank
        if rank == 0:
            emit(kind="meta", system=system.name, rank=rank, size=system.size,
                 pid=os.getpid(), **system.meta())
        for nbytes, warmup, reps in plan["sizes"]:
            time_size(system, int(nbytes), int(warmup), int(reps))
        grad = plan.get("grad")
        if grad:
            time_grad(system, system.grad_step, "async", grad["tensors"], grad["elems"],
                      grad["warmup"], grad["steps"])
            if system.grad_step_sync is not None and grad.get("sync_steps", 0) > 0:
                time_grad(system, system.grad_step_sync, "sync", grad["tensors"], grad["elems"],
                          min(grad["warmup"], 2), grad["sync_steps"])
        idle_s = float(plan.get("idle_s") or 0)
        if idle_s > 0:
            measure_idle(system, idle_s)
        system.barrier()
        system.close()
        emit(kind="done", system=args.system, rank=rank)
        return 0
    except BaseException as e:  # report it machine-readably, then fail
        emit(kind="error", system=args.system, rank=rank,
             error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        return 1


if __name__ == "__main__":
    sys.exit(main())
