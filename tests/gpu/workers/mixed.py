"""CPU and CUDA tensors in one job: interleaved, and in flight at the same time.

Usage: mixed.py --expect single|nccl|host

Each result must be right and stay on its input's device. host_staged_bytes counts CUDA
tensors only, so the NCCL path's "no host copy" holds with CPU tensors in the job. Last, a CUDA
tensor on one rank and a CPU tensor on the others ("Mismatched CPU/GPU device selection") is
refused on every rank.
"""

import torch

import spark_hvd.torch as hvd
from _data import dn, ints, put, reference
from _gpu import C, main

CPU = torch.device("cpu")


def body(args, device):
    rank, size = hvd.rank(), hvd.size()
    # Interleaved: one CPU op, one CUDA op, ... every kind.
    for i in range(6):
        for where in (CPU, device):
            tag = f"inter.{i}.{where.type}"
            dtype = (torch.float32, torch.int64, torch.bfloat16)[i % 3]
            xs = [ints(tag, r, (9, 2), -8, 9, dtype) for r in range(size)]
            got = hvd.allreduce(put(xs[rank], where), op=hvd.Sum, name=tag)
            C.same(got, reference(xs, "Sum"), f"interleaved allreduce {i} {dn(dtype)} on "
                   f"{where.type}", device=where)
            rows = [ints(f"{tag}.ag", r, (r + 1,), 0, 50, dtype) for r in range(size)]
            got = hvd.allgather(put(rows[rank], where), name=f"{tag}.ag")
            C.same(got, torch.cat(rows), f"interleaved allgather {i} on {where.type}",
                   device=where)
            got = hvd.broadcast(put(xs[rank], where), root_rank=size - 1, name=f"{tag}.bc")
            C.same(got, xs[size - 1], f"interleaved broadcast {i} on {where.type}",
                   device=where)

    # In flight at once: CPU and CUDA handles started before any is waited for, waited for in
    # an order unlike the start order.
    starts = []
    for i in range(8):
        where = (CPU, device)[i % 2]
        tag = f"flight.{i}.{where.type}"
        xs = [ints(tag, r, (257 + i,), -8, 9, torch.float32) for r in range(size)]
        if i % 4 < 2:
            h = hvd.allreduce_async(put(xs[rank], where), op=hvd.Sum, name=tag)
            want = reference(xs, "Sum")
        else:
            h = hvd.allgather_async(put(xs[rank], where), name=tag)
            want = torch.cat(xs)
        starts.append((i, where, h, want))
    t = put(ints("flight.inplace", rank, (64,), -8, 9, torch.float32), device)
    c = put(ints("flight.inplace", rank, (64,), -8, 9, torch.float32), CPU)
    h_t = hvd.allreduce_async_(t, op=hvd.Sum, name="flight.inplace.cuda")
    h_c = hvd.allreduce_async_(c, op=hvd.Sum, name="flight.inplace.cpu")
    for i, where, h, want in reversed(starts):
        C.same(hvd.synchronize(h), want, f"in flight with the other device: op {i} on "
               f"{where.type}", device=where)
    hvd.synchronize(h_c)
    hvd.synchronize(h_t)
    want = reference([ints("flight.inplace", r, (64,), -8, 9, torch.float32)
                      for r in range(size)], "Sum")
    C.same(c, want, "in-place CPU allreduce in flight with a CUDA one", device=CPU)
    C.same(t, want, "in-place CUDA allreduce in flight with a CPU one", device=device)

    # A grouped allreduce of CUDA tensors while a CPU one is in flight.
    cpu_xs = [ints("g.cpu", r, (100,), -8, 9, torch.float32) for r in range(size)]
    h_cpu = hvd.allreduce_async(put(cpu_xs[rank], CPU), op=hvd.Sum, name="g.cpu")
    gx = [[ints(f"g.cuda.{k}", r, (10 + k,), -8, 9, torch.float32) for r in range(size)]
          for k in range(4)]
    got = hvd.grouped_allreduce([put(x[rank], device) for x in gx], op=hvd.Sum, name="g.cuda")
    for k, x in enumerate(gx):
        C.same(got[k], reference(x, "Sum"), f"grouped CUDA allreduce tensor {k} with a CPU op "
               "in flight", device=device)
    C.same(hvd.synchronize(h_cpu), reference(cpu_xs, "Sum"), "the CPU op in flight",
           device=CPU)


def mismatch(args, device):
    """After the path check: a CUDA tensor on rank 0 and a CPU tensor on the others is refused
    on every rank, and the job goes on."""
    rank, size = hvd.rank(), hvd.size()
    if size < 2 or device.type != "cuda":
        return
    t = torch.ones(2, device=device) if rank == 0 else torch.ones(2)
    C.raises("a CUDA tensor on rank 0, CPU tensors elsewhere: refused on every rank",
             lambda: hvd.allreduce(t, op=hvd.Sum, name="mismatch.devices"),
             (ValueError, RuntimeError), ("CPU/GPU",))
    got = hvd.allreduce(torch.ones(3, device=device), op=hvd.Sum, name="after.mismatch")
    C.same(got, torch.full((3,), float(size)), "a CUDA allreduce after the refused one",
           device=device)


if __name__ == "__main__":
    main(body, after=mismatch)
