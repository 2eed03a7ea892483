"""CUDA allreduces over several hosts with several ranks each (issue 33, part 4): the
hierarchical NCCL allreduce (reduce-scatter within the host, allreduce across hosts per lane,
allgather within the host) against the flat one.

Usage: hierarchical.py --expect nccl --hierarchical on|off|auto   (2 hosts x 2 ranks or more)

Every rank checks each result against the reduction it computes itself (exact: small integers,
power-of-two scalings), and that every rank holds the same bytes (a digest of each result,
allgathered). Sizes include ones that do not divide by the host's ranks (the fusion buffer is
padded) and fused groups. At the end the path counters say which allreduce ran:
``nccl_hierarchical_allreduces`` grew for ``on`` (every allreduce) and ``auto`` (the
bandwidth-bound ones), and stayed 0 for ``off``.
"""

import zlib

import torch

import spark_hvd.torch as hvd
from _data import dn, ints, normal, put, reference
from _gpu import DRY_RUN_ON_CPU, C, counters, main

# (dtype, op, prescale, postscale, elements): sums, averages and scalings of small integers
# are exact in every float type.
CASES = [
    (torch.float32, "Sum", 1.0, 1.0, 1),
    (torch.float32, "Sum", 1.0, 1.0, 1001),          # not a multiple of a host's ranks
    (torch.float32, "Average", 1.0, 1.0, 4096),
    (torch.float16, "Sum", 0.5, 4.0, 777),
    (torch.bfloat16, "Average", 2.0, 1.0, 1030),
    (torch.float64, "Max", 1.0, 1.0, 515),
    (torch.int32, "Sum", 1.0, 1.0, 333),
    (torch.int64, "Min", 1.0, 1.0, 64),
    (torch.int32, "Product", 1.0, 1.0, 99),
    (torch.float32, "Sum", 1.0, 1.0, 3 * 1024 * 1024 + 7),  # 12 MiB: bandwidth-bound
]
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Max": hvd.Max, "Min": hvd.Min,
       "Product": hvd.Product}


def digest(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


def same_on_every_rank(t: torch.Tensor, what: str) -> None:
    mine = torch.tensor([digest(t)], dtype=torch.int64)
    everyone = hvd.allgather(mine, name=f"digest.{what}").tolist()
    C.check(len(set(everyone)) == 1, f"{what}: bitwise equal on every rank",
            f"digests differ across ranks: {everyone}")


def body(args, device):
    size, rank = hvd.size(), hvd.rank()
    C.check(size >= 4 and hvd.local_size() >= 2 and size % hvd.local_size() == 0,
            f"{size} ranks, {hvd.local_size()} per host", "needs 2+ hosts of 2+ ranks each")
    for dtype, op, pre, post, n in CASES:
        tag = f"h.{dn(dtype)}.{op}.{n}"
        lo, hi = (-2, 3) if op == "Product" else (-8, 9)
        xs = {r: ints(tag, r, (n,), lo, hi, dtype) for r in range(size)}
        want = reference([(x.double() * pre).to(dtype) for x in xs.values()], op)
        want = (want.double() * post).to(dtype)
        got = hvd.allreduce(put(xs[rank], device), op=OPS[op], prescale_factor=pre,
                            postscale_factor=post, name=tag)
        C.same(got, want, f"allreduce {op} {dn(dtype)} x{n} prescale {pre} postscale {post}",
               device=device)
        same_on_every_rank(got, tag)
    # A fused group of odd sizes (one response, one padded fusion buffer).
    group = [{r: ints(f"g{i}", r, (5 + 37 * i,), -8, 9, torch.float32) for r in range(size)}
             for i in range(6)]
    got = hvd.grouped_allreduce([put(g[rank], device) for g in group], op=hvd.Sum, name="group")
    for i, g in enumerate(group):
        C.same(got[i], reference(list(g.values()), "Sum"), f"grouped allreduce tensor {i}",
               device=device)
        same_on_every_rank(got[i], f"group.{i}")
    # Rounded float data: the reduction order differs from a flat ring, but every rank must
    # still hold the same bytes.
    x = normal("rounded", rank, (1 << 20,), torch.float32)
    got = hvd.allreduce(put(x, device), op=hvd.Average, name="rounded")
    want = reference([normal("rounded", r, (1 << 20,), torch.float32) for r in range(size)],
                     "Average")
    C.same(got, want, "allreduce Average of N(0,1) float32 x1Mi", device=device, rtol=1e-5,
           atol=1e-5)
    same_on_every_rank(got, "rounded")


def after(args, device):
    if DRY_RUN_ON_CPU:
        return
    now = counters()  # body's CUDA allreduces are all counted (nothing on CUDA since)
    got = now.get("nccl_hierarchical_allreduces")
    C.check(got is not None, "gpu_counters() has nccl_hierarchical_allreduces",
            f"no such counter: {now}")
    if args.hierarchical == "on":
        C.check(got >= len(CASES) + 2, f"every allreduce ran hierarchically ({got})",
                f"nccl_hierarchical_allreduces is {got}, expected >= {len(CASES) + 2}")
    elif args.hierarchical == "auto":
        C.check(0 < got < len(CASES) + 2,
                f"automatic: the bandwidth-bound allreduces ran hierarchically ({got})",
                f"nccl_hierarchical_allreduces is {got}: expected some, not all")
    else:
        C.check(got == 0, "hierarchical allreduce off: none ran hierarchically",
                f"nccl_hierarchical_allreduces is {got}")


def extra(p):
    p.add_argument("--hierarchical", choices=("on", "off", "auto"), required=True)


if __name__ == "__main__":
    main(body, extra=extra, after=after)
