"""Helpers of the GPU workers (tests/gpu/workers/*.py).

A worker runs as every rank of a job (``python -m spark_hvd.runner -np N python <worker>``) or
alone (``python <worker>``: ``hvd.init()`` with no launcher, size 1). It prints one line per
check, ``ok rank=R <what>``, and stops at the first failure: ``FAIL rank=R <what>: <why>``, then
exits with status 1 at once (``os._exit``: a peer blocked in a collective is ended by the
launcher, which stops the job when a rank fails). When every check passed it prints
``OK rank=R checks=N ...``.

``--expect`` says which path the job's CUDA collectives must take, checked against
``spark_hvd.common.gpu_counters()`` at the end:
  single  one rank (no peer): no CUDA tensor copied through host memory
  nccl    through NCCL: nccl_collectives grew, host_staged_bytes stayed 0
  host    ranks sharing a GPU, staged through host memory: host_staged_bytes grew
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch

import spark_hvd.torch as hvd

EXPECT = ("single", "nccl", "host")
# A dry run of a worker's logic on CPU tensors, for its author on a machine with no GPU: the
# device is the CPU, and the build flags and path counters are not checked.
DRY_RUN_ON_CPU = os.environ.get("GPU_SUITE_DRY_RUN_ON_CPU") == "1"


class Checker:
    def __init__(self):
        self.rank = 0
        self.count = 0

    def ok(self, what: str) -> None:
        self.count += 1
        print(f"ok rank={self.rank} {what}", flush=True)

    def fail(self, what: str, why: str) -> None:
        print(f"FAIL rank={self.rank} {what}: {why}", flush=True)
        sys.stderr.flush()
        os._exit(1)

    def check(self, cond, what: str, why: str = "condition is False") -> None:
        if cond:
            self.ok(what)
        else:
            self.fail(what, why)

    def on_device(self, t, device, what: str) -> None:
        if not isinstance(t, torch.Tensor):
            self.fail(what, f"expected a tensor, got {type(t).__name__}")
        if t.device != device:
            self.fail(what, f"result is on {t.device}, expected {device}")

    def same(self, got, expected, what: str, device=None, rtol=0.0, atol=0.0) -> None:
        """``got`` equals ``expected`` (exactly, or within rtol/atol), has its dtype and shape
        and, when ``device`` is given, lives there."""
        if device is not None:
            self.on_device(got, device, what)
        if not isinstance(got, torch.Tensor):
            self.fail(what, f"expected a tensor, got {type(got).__name__}")
        if got.dtype != expected.dtype:
            self.fail(what, f"dtype {got.dtype}, expected {expected.dtype}")
        if tuple(got.shape) != tuple(expected.shape):
            self.fail(what, f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
        g = got.detach().cpu()
        e = expected.detach().cpu().to(g.dtype)
        if rtol == 0.0 and atol == 0.0:
            good = torch.equal(g, e)
        else:
            good = torch.allclose(g.double(), e.double(), rtol=rtol, atol=atol)
        if not good:
            gd, ed = g.double().reshape(-1), e.double().reshape(-1)
            bad = ((gd - ed).abs() > atol + rtol * ed.abs()).nonzero().reshape(-1)
            i = int(bad[0]) if bad.numel() else 0
            self.fail(what, f"{bad.numel()} of {gd.numel()} elements differ (rtol={rtol}, "
                            f"atol={atol}); first at flat index {i}: got {gd[i].item()!r}, "
                            f"expected {ed[i].item()!r}; max abs diff "
                            f"{(gd - ed).abs().max().item() if gd.numel() else 0.0!r}")
        self.ok(what)

    def raises(self, what: str, fn, types, words) -> None:
        """``fn()`` raises one of ``types`` whose message names every word of ``words``
        (case-insensitive)."""
        try:
            fn()
        except types as e:
            msg = str(e).lower()
            missing = [w for w in words if w.lower() not in msg]
            if missing:
                self.fail(what, f"{type(e).__name__} {str(e)!r} does not name {missing}")
            self.ok(f"{what} ({type(e).__name__}: {str(e)[:160]})")
            return
        except Exception as e:  # noqa: BLE001
            self.fail(what, f"expected {' or '.join(t.__name__ for t in types)}, got "
                            f"{type(e).__name__}: {e}")
        self.fail(what, "nothing was raised")


C = Checker()


def parse_args(argv=None, extra=None):
    p = argparse.ArgumentParser()
    p.add_argument("--expect", choices=EXPECT, required=True)
    if extra:
        extra(p)
    return p.parse_args(argv)


def setup(**init_kwargs):
    """hvd.init(), this rank's GPU; returns the torch device. Every rank of a one-GPU machine
    gets cuda:0."""
    hvd.init(**init_kwargs)
    C.rank = hvd.rank()
    if DRY_RUN_ON_CPU:
        print(f"info rank={C.rank} DRY RUN ON THE CPU: nothing about the GPU path is checked",
              flush=True)
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if n < 1:
        C.fail("setup", "torch.cuda.device_count() is 0")
    torch.cuda.set_device(hvd.local_rank() % n)
    device = torch.device("cuda", torch.cuda.current_device())
    # Exact float32 arithmetic in the references (no TF32 in matmuls and convolutions).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"info rank={C.rank} size={hvd.size()} local_rank={hvd.local_rank()} device={device} "
          f"({torch.cuda.get_device_name(device)}) devices={n} torch={torch.__version__} "
          f"SPARK_HVD_SHARED_GPU={os.environ.get('SPARK_HVD_SHARED_GPU', '(unset)')}",
          flush=True)
    return device


def counters() -> dict:
    if DRY_RUN_ON_CPU:
        return {"nccl_collectives": 0, "host_staged_bytes": 0}
    try:
        from spark_hvd.common import gpu_counters
    except ImportError:
        try:  # where the lead's core defines it, if spark_hvd.common does not export it yet
            from spark_hvd.common.basics import gpu_counters
            print(f"info rank={C.rank} spark_hvd.common does not export gpu_counters; "
                  "used spark_hvd.common.basics.gpu_counters", flush=True)
        except ImportError as e:
            C.fail("gpu_counters", f"spark_hvd.common.gpu_counters is missing ({e})")
    try:
        got = dict(gpu_counters())
    except Exception as e:  # noqa: BLE001
        C.fail("gpu_counters", f"gpu_counters() raised {type(e).__name__}: {e}")
    for key in ("nccl_collectives", "host_staged_bytes"):
        if key not in got:
            C.fail("gpu_counters", f"gpu_counters() has no {key!r}: {got}")
    return got


def check_path(expect: str, before: dict) -> dict:
    """The job's CUDA collectives took the path ``expect`` says (counters since ``before``)."""
    after = counters()
    if DRY_RUN_ON_CPU:
        return after
    nccl = after["nccl_collectives"] - before["nccl_collectives"]
    staged = after["host_staged_bytes"] - before["host_staged_bytes"]
    info = f"nccl_collectives +{nccl}, host_staged_bytes +{staged} (now {after})"
    if expect in ("nccl", "single"):
        C.check(staged == 0, f"no host copy of a CUDA tensor: {info}",
                "CUDA tensors were copied through host memory on the NCCL path")
    if expect == "nccl":
        C.check(nccl > 0, f"collectives ran through NCCL: {info}",
                "nccl_collectives did not grow")
    if expect == "host":
        C.check(staged > 0, f"shared GPU, host path: CUDA tensors staged through host: {info}",
                "host_staged_bytes did not grow although SPARK_HVD_SHARED_GPU selects the "
                "host path for ranks sharing a GPU")
    if expect == "single":
        print(f"info rank={C.rank} single rank: {info}", flush=True)
    return after


def build_flags() -> None:
    if DRY_RUN_ON_CPU:
        return
    C.check(hvd.nccl_built() is True or hvd.nccl_built() == 1, "hvd.nccl_built() is True",
            f"hvd.nccl_built() returned {hvd.nccl_built()!r}")
    C.check(hvd.cuda_built() is True or hvd.cuda_built() == 1, "hvd.cuda_built() is True",
            f"hvd.cuda_built() returned {hvd.cuda_built()!r}")


def main(body, extra=None, after=None) -> None:
    """Runs ``body(args, device)``, the path check (the counters over ``body``), then
    ``after(args, device)`` (checks whose host traffic is not a collective's, e.g. pickled
    objects, or that end in an error), shutdown and the final marker; any exception is a
    failure with its traceback."""
    args = parse_args(extra=extra)
    try:
        device = setup(**getattr(body, "init_kwargs", {}))
        before = counters()
        body(args, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        check_path(args.expect, before)
        if after is not None:
            after(args, device)
        hvd.barrier()
        hvd.shutdown()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - any exception is a failure
        C.fail("unexpected exception", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    print(f"OK rank={C.rank} checks={C.count}", flush=True)
