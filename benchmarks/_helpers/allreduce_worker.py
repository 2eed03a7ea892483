"""One rank of ``benchmarks/allreduce.py``: times float32 allreduces for one system.

Not meant to be run by hand: ``benchmarks/allreduce.py`` starts two of these per system
(through ``spark-hvd-run``, as plain subprocesses for gloo, or under ``mpirun``) and passes the
plan as JSON. Every result is one line on stdout, ``@@BENCH {json}``, so the parent can parse it
even through the launcher's ``[rank]<stdout>:`` prefixes.

Systems (``--device cpu``, the default):
  spark_hvd  ``hvd.allreduce_(arr, op=hvd.Sum, name=...)`` (rank/size from spark-hvd-run)
  gloo       ``torch.distributed.all_reduce`` on a CPU tensor (rank/size/port from arguments)
  mpi        ``comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)`` through mpi4py (under mpirun)

With ``--device cuda`` the buffers are float32 CUDA tensors (rank r on GPU r % device count):
  spark_hvd  ``spark_hvd.torch``'s ``hvd.allreduce_(t, op=hvd.Sum, name=...)``
  nccl       ``torch.distributed.all_reduce`` with the NCCL backend (``--nccl-hostid JOB`` sets
             ``NCCL_HOSTID=JOB-<rank>`` first: ranks sharing a GPU look like separate hosts)
  gloo       ``torch.distributed.all_reduce`` with the gloo backend on CUDA tensors
A timed repetition is then ``plan["cuda_batch"]`` back-to-back ops (up to 1 MiB; one op
above) followed by ``torch.cuda.synchronize()``, as nccl-tests times: time per op = elapsed /
ops; before it every rank meets at the system's barrier and the GPU is idle.
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
CUDA_BATCH_MAX_BYTES = 1 << 20  # CUDA: back-to-back ops per repetition up to this size
# For whoever edits the --device cuda code on a machine without a GPU: the CUDA systems run on
# CPU tensors (torch NCCL becomes gloo), so the driver's cuda path can be run end to end. The
# numbers mean nothing.
CUDA_DRY_RUN = os.environ.get("BENCH_CUDA_DRY_RUN_ON_CPU") == "1"


def emit(**record):
    # One write call per line: under mpirun both ranks share the forwarded stdout, and separate
    # writes for the text and its newline (print under PYTHONUNBUFFERED) can interleave.
    sys.stdout.write(MARK + json.dumps(record) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# Systems: each offers rank, size, barrier(), allreduce(buf) (in place, Sum, synchronous),
# grad_step(bufs) (all submitted asynchronously, then all waited for) and, optionally,
# grad_step_sync(bufs) (one by one), plus close().

def _import_spark_hvd(module):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:  # a fresh checkout run without `pip install -e .`
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))))
        return importlib.import_module(module)


def _core_meta():
    """spark_hvd's version and the native core this process mapped."""
    info = {}
    try:
        from importlib.metadata import version
        info["version"] = version("spark-hvd")
    except Exception:
        pass
    info.update(_loaded_library("libspark_hvd_core"))
    return info


class SparkHvd:
    name = "spark_hvd"
    module = "spark_hvd.numpy"

    def __init__(self, args):
        self.hvd = hvd = _import_spark_hvd(self.module)
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self._names = {}
        self._grad_names = None

    def meta(self):
        return {"shared_memory": bool(self.hvd.shared_memory_enabled()), **_core_meta()}

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


class SparkHvdCuda(SparkHvd):
    """spark_hvd.torch on CUDA tensors (the NCCL path); the ops are SparkHvd's."""
    module = "spark_hvd.torch"

    def __init__(self, args):
        super().__init__(args)
        import torch
        self.torch = torch
        self.device = pick_gpu(torch, self.hvd.local_rank())
        self.cuda_batch = 1
        self._counters0 = read_gpu_counters()

    def meta(self):
        hvd = self.hvd
        return {"nccl_built": bool(hvd.nccl_built()), "cuda_built": bool(hvd.cuda_built()),
                "SPARK_HVD_SHARED_GPU": os.environ.get("SPARK_HVD_SHARED_GPU"),
                "gpu_counters": self._counters0, **_core_meta(),
                **_gpu_meta(self.torch, self.device)}

    def final(self):
        """What the path did over the whole run: the core's GPU counters, before and after."""
        return {"gpu_counters_before": self._counters0, "gpu_counters": read_gpu_counters()}


class TorchCuda:
    """torch.distributed (NCCL or gloo) on CUDA tensors; rank/size/port from arguments."""

    def __init__(self, args, backend):
        import torch
        import torch.distributed as dist
        if CUDA_DRY_RUN:
            backend = "gloo"
        self.torch, self.dist, self.backend = torch, dist, backend
        self.name = args.system
        rank, size = args.rank, args.size
        self.device = pick_gpu(torch, rank)
        if backend == "nccl" and args.nccl_hostid:
            # Ranks sharing a GPU: NCCL refuses duplicate GPUs within one host, so each rank
            # claims a host of its own (NCCL then connects them over the network transport).
            os.environ["NCCL_HOSTID"] = f"{args.nccl_hostid}-{rank}"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=rank, world_size=size)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.cuda_batch = 1

    def meta(self):
        info = {"version": f"torch {self.torch.__version__}",
                "NCCL_HOSTID": os.environ.get("NCCL_HOSTID")}
        if self.backend == "nccl":
            try:
                info["nccl_version"] = ".".join(map(str, self.torch.cuda.nccl.version()))
            except Exception:
                pass
        info.update(_gpu_meta(self.torch, self.device))
        return info

    def barrier(self):
        if self.backend == "nccl":
            self.dist.barrier(device_ids=[self.device.index])
        else:
            self.dist.barrier()

    def allreduce(self, buf):
        self.dist.all_reduce(buf, op=self.dist.ReduceOp.SUM)

    def grad_step(self, bufs):
        dist = self.dist
        works = [dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True) for t in bufs]
        for w in works:
            w.wait()

    grad_step_sync = None

    def close(self):
        self.dist.destroy_process_group()


def pick_gpu(torch, index):
    """Selects and returns GPU ``index % visible GPUs`` (the CPU in a dry run)."""
    if CUDA_DRY_RUN:
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if n < 1:
        raise RuntimeError("--device cuda: no CUDA device (torch.cuda.device_count() is 0)")
    torch.cuda.set_device(index % n)
    return torch.device("cuda", index % n)


def _gpu_meta(torch, device):
    if CUDA_DRY_RUN:
        return {"device": str(device), "gpu": "(dry run on the CPU)"}
    return {"device": str(device), "gpu": torch.cuda.get_device_name(device),
            "gpus_visible": torch.cuda.device_count(), "torch_cuda": torch.version.cuda}


def read_gpu_counters():
    try:
        try:
            from spark_hvd.common import gpu_counters
        except ImportError:
            from spark_hvd.common.basics import gpu_counters
        return dict(gpu_counters())
    except Exception as e:  # an older core: say so in the report, do not fail the run
        return {"unavailable": f"{type(e).__name__}: {e}"}


def _cuda_buffers(system):
    """Buffer conversions of a CUDA system: NumPy array -> CUDA tensor and back."""
    torch, device = system.torch, system.device
    system.buffer = lambda arr: torch.from_numpy(arr).to(device)
    system.numpy = lambda buf: buf.cpu().numpy()
    system.sync = (lambda: None) if CUDA_DRY_RUN else (lambda: torch.cuda.synchronize(device))
    return system


def make_system(args):
    if args.device == "cuda":
        if args.system == "spark_hvd":
            return _cuda_buffers(SparkHvdCuda(args))
        return _cuda_buffers(TorchCuda(args, args.system))
    return SYSTEMS[args.system](args)


# Buffers: CPU systems time NumPy arrays (``buffer``/``numpy``/``sync`` absent), CUDA systems
# their tensors (set by _cuda_buffers).

def _buffer(system, arr):
    fn = getattr(system, "buffer", None)
    return fn(arr) if fn else arr


def _numpy(system, buf):
    fn = getattr(system, "numpy", None)
    return fn(buf) if fn else buf


def _timed(system, op, arg, reps, ops_per_rep):
    """Per-op times of ``op(arg)`` over ``reps`` repetitions: all ranks meet at the barrier
    first; a CPU system times one op, a CUDA system ``ops_per_rep`` back-to-back ops until the
    GPU is done."""
    clock = time.perf_counter
    sync = getattr(system, "sync", None)
    times = []
    if sync is None:
        for _ in range(reps):
            system.barrier()
            t0 = clock()
            op(arg)
            times.append(clock() - t0)
        return times
    for _ in range(reps):
        system.barrier()
        sync()
        t0 = clock()
        for _ in range(ops_per_rep):
            op(arg)
        sync()
        times.append((clock() - t0) / ops_per_rep)
    return times


# ---------------------------------------------------------------------------------------------

def stats(times):
    t = np.sort(np.asarray(times, dtype=np.float64))
    return {"n": int(t.size), "median_s": float(np.median(t)), "min_s": float(t[0]),
            "p10_s": float(np.percentile(t, 10)), "p90_s": float(np.percentile(t, 90)),
            "mean_s": float(t.mean())}


def check_allreduce(system, n):
    """One allreduce of a rank- and position-dependent pattern; returns (ok, detail)."""
    pattern = (np.arange(n, dtype=np.int32) % 251).astype(np.float32)
    buf = _buffer(system, pattern + np.float32(system.rank * CHECK_BASE))
    system.allreduce(buf)
    buf = _numpy(system, buf)
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
    # zeros: repeated in-place sums stay finite
    buf = _buffer(system, np.zeros(n, dtype=np.float32))
    for _ in range(warmup):
        system.barrier()
        system.allreduce(buf)
    ops = getattr(system, "cuda_batch", 1) if n * 4 <= CUDA_BATCH_MAX_BYTES else 1
    times = _timed(system, system.allreduce, buf, reps, ops)
    emit(kind="size", system=system.name, rank=system.rank, size=system.size, bytes=n * 4,
         warmup=warmup, correct=ok, error=detail or None, ops_per_rep=ops, **stats(times))


def time_grad(system, step_fn, variant, tensors, elems, warmup, steps):
    # Correctness: tensor i on rank r holds i + r*CHECK_BASE (+ position pattern).
    pattern = (np.arange(elems, dtype=np.int32) % 251).astype(np.float32)
    bufs = [_buffer(system, pattern + np.float32(i + system.rank * CHECK_BASE))
            for i in range(tensors)]
    step_fn(bufs)
    ok, detail = True, ""
    base = np.float32(CHECK_BASE * system.size * (system.size - 1) / 2)
    for i, b in enumerate(bufs):
        got = _numpy(system, b)
        expected = (pattern + np.float32(i)) * np.float32(system.size) + base
        if not np.array_equal(got, expected):
            j = int(np.flatnonzero(got != expected)[0])
            ok, detail = False, (f"tensor {i} element [{j}]: got {float(got[j])}, "
                                 f"expected {float(expected[j])}")
            break
    for b in bufs:
        b[:] = 0
    for _ in range(warmup):
        system.barrier()
        step_fn(bufs)
    times = _timed(system, step_fn, bufs, steps, 1)
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
    p.add_argument("--system", choices=sorted(SYSTEMS) + ["nccl"])
    p.add_argument("--plan", help="JSON plan written by benchmarks/allreduce.py")
    p.add_argument("--rank", type=int, default=0, help="gloo only")
    p.add_argument("--size", type=int, default=1, help="gloo only")
    p.add_argument("--port", type=int, default=0, help="gloo and nccl only")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--nccl-hostid", default=None,
                   help="nccl only: NCCL_HOSTID=<this>-<rank> (ranks sharing a GPU)")
    args = p.parse_args(argv)
    if not args.system or not args.plan:
        print("this is a helper of benchmarks/allreduce.py; run that instead")
        return 0
    plan = json.loads(args.plan)
    rank = os.environ.get("SPARK_HVD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
    rank = int(rank) if rank is not None else \
        (args.rank if args.system in ("gloo", "nccl") else "?")
    try:
        if args.system == "nccl" and args.device != "cuda":
            raise ValueError("--system nccl needs --device cuda")
        system = make_system(args)
        if hasattr(system, "cuda_batch"):
            system.cuda_batch = int(plan.get("cuda_batch") or 1)
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
        final = getattr(system, "final", None)
        if final:
            emit(kind="final", system=system.name, rank=rank, **final())
        system.close()
        emit(kind="done", system=args.system, rank=rank)
        return 0
    except BaseException as e:  # report it machine-readably, then fail
        emit(kind="error", system=args.system, rank=rank,
             error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        return 1


if __name__ == "__main__":
    sys.exit(main())
