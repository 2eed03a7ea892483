"""Allreduces of tensors in the core's shared arenas (reduced in place where every member maps
them), checked exactly, and the torch DistributedOptimizer whose gradients live there.

    --mode numpy   arrays from shvd_shared_alloc on the ranks ARENA_RANKS names (default: all;
                   the others use ordinary memory; ENV_OF_RANK_<r>="NAME=VALUE ..." sets
                   variables on rank r alone): every dtype and op, fused and alone, in
                   place and not; 4 KiB chunks (SPARK_HVD_SHM_CHUNK_BYTES) split each member's
                   share into many pieces across tensor boundaries.
    --mode torch   an MLP trained 6 steps by DistributedOptimizer (gradients in the arenas
                   unless SPARK_HVD_SHARED_GRADIENTS=0); weights bitwise equal on every rank
                   (weights=<sha256>, for comparing jobs); a forked child allocates apart.
Prints OK with inplace=<allreduces this rank reduced in place> and held=<arena bytes>.
"""

import argparse
import ctypes
import hashlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _wutil import Checks, apply_rank_env  # noqa: E402

DTYPES = [np.uint8, np.int8, np.int32, np.int64, np.float16, np.float32, np.float64]


def shared_array(lib, shape, dtype):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    p = lib.shvd_shared_alloc(n)
    if not p:
        raise RuntimeError("shvd_shared_alloc returned NULL")
    return np.frombuffer((ctypes.c_char * n).from_address(p), dtype=dtype).reshape(shape)


def numpy_mode(c, hvd, lib):
    rank, size = hvd.rank(), hvd.size()
    arena_ranks = os.environ.get("ARENA_RANKS")
    in_arenas = arena_ranks is None or str(rank) in arena_ranks.split(",")

    def alloc(shape, dtype):
        return shared_array(lib, shape, dtype) if in_arenas else np.empty(shape, dtype)

    # Values that stay exact in every dtype once summed over ranks.
    def pattern(shape, dtype, r, salt):
        n = int(np.prod(shape))
        v = (np.arange(n) * 7 + salt + 3 * r) % 11
        return v.reshape(shape).astype(dtype)

    ops = [("sum", hvd.Sum), ("min", hvd.Min), ("max", hvd.Max), ("product", hvd.Product)]
    # Together above 256 KiB (where the arena path starts) even in one-byte dtypes.
    shapes = [(70001,), (300, 257), (3, 5, 4099), (1,), (12345,), (40000,)]
    for dtype in DTYPES:
        for opname, op in ops:
            if opname == "product" and np.dtype(dtype).itemsize < 4:
                continue  # 11^size overflows small integers differently per order
            for inplace in (True, False):
                tag = f"{np.dtype(dtype).name}/{opname}/{'in' if inplace else 'out'}"
                ins = [alloc(s, dtype) for s in shapes]
                for k, (a, s) in enumerate(zip(ins, shapes)):
                    a[...] = pattern(s, dtype, rank, k)
                outs = ins if inplace else [alloc(s, dtype) for s in shapes]
                handles = []
                for k, (a, o) in enumerate(zip(ins, outs)):
                    if inplace:
                        handles.append(hvd.allreduce_async_(a, op=op, name=f"{tag}.{k}"))
                    else:  # the output where this rank's allocator puts it, too
                        handles.append(hvd._allreduce_into(
                            a, o, a.ctypes.data, o.ctypes.data, None, f"{tag}.{k}", op, 1.0,
                            1.0, hvd.global_process_set))
                for k, (h, s) in enumerate(zip(handles, shapes)):
                    got = hvd.synchronize(h)
                    parts = [pattern(s, np.float64, r, k) for r in range(size)]
                    want = {"sum": sum(parts), "min": np.minimum.reduce(parts),
                            "max": np.maximum.reduce(parts),
                            "product": np.multiply.reduce(parts)}[opname].astype(dtype)
                    c.check(np.array_equal(got, want), f"{tag} tensor {k} differs")
    # Average: the core scales while reducing; float32, results bitwise equal on every rank.
    arrays = [alloc((1 << 17,), np.float32) for _ in range(3)]
    for k, a in enumerate(arrays):
        a[...] = np.linspace(-1, 1, a.size, dtype=np.float32) * (rank + 1) + k
    handles = [hvd.allreduce_async_(a, op=hvd.Average, name=f"avg.{k}")
               for k, a in enumerate(arrays)]
    for h in handles:
        hvd.synchronize(h)
    for k, a in enumerate(arrays):
        base = np.linspace(-1, 1, a.size, dtype=np.float64)
        want = base * sum(r + 1 for r in range(size)) / size + k
        c.check(np.allclose(a, want, rtol=1e-6, atol=1e-6), f"average {k} differs")
        digests = hvd.allgather_object(hashlib.sha256(a.tobytes()).hexdigest())
        c.check(len(set(digests)) == 1, f"average {k} not bitwise equal on every rank")


def torch_mode(c, hvd, lib):
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())
    for _ in range(6):
        x, y = torch.randn(64, 300, generator=g), torch.randint(0, 10, (64,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    digests = hvd.allgather_object(hashlib.sha256(weights.numpy().tobytes()).hexdigest())
    c.check(len(set(digests)) == 1, "weights differ between ranks")

    # A forked child (a DataLoader worker) gets a gradient-sized tensor from torch's memory,
    # not from the arenas it shares with this process: writing it leaves the parent alone.
    grad = model[0].weight.grad
    kept = grad.clone()
    pid = os.fork()
    if pid == 0:
        t = torch.empty_like(grad)
        t.fill_(123.0)
        os._exit(3 if lib.shvd_shared_free(ctypes.c_void_p(t.data_ptr())) else 0)
    _, status = os.waitpid(pid, 0)
    c.check(os.waitstatus_to_exitcode(status) == 0, "the forked child got arena memory")
    c.check(torch.equal(grad, kept), "the forked child's tensor changed the parent's gradient")
    return digests[0]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("numpy", "torch"), required=True)
    args = p.parse_args()
    apply_rank_env()  # to test that one rank can refuse
    if args.mode == "torch":
        import spark_hvd.torch as hvd
    else:
        import spark_hvd.numpy as hvd
    from spark_hvd.common._native import lib
    hvd.init()
    c = Checks(hvd.rank())
    before = lib.shvd_shared_inplace_allreduces()
    fields = {}
    if args.mode == "numpy":
        c.run("numpy", numpy_mode, c, hvd, lib)
    else:
        fields["weights"] = c.run("torch", torch_mode, c, hvd, lib)
    fields.update(inplace=lib.shvd_shared_inplace_allreduces() - before,
                  held=lib.shvd_shared_bytes())
    c.run("final barrier", hvd.barrier)
    hvd.shutdown()
    c.finish(**fields)


if __name__ == "__main__":
    main()
