"""Deterministic inputs of the GPU workers: every rank can rebuild every other rank's input, so
it computes the expected result itself (on the CPU, in float64 or int64).

Values are small integers wherever the check is exact: sums, minima, maxima, products, halves
and power-of-two scalings of them are exact in every float type, float16 and bfloat16 included.
"""

from __future__ import annotations

import zlib

import torch

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64, torch.uint8, torch.int8]
DTYPES = FLOATS + INTS


def dn(dtype) -> str:
    return str(dtype).replace("torch.", "")


def gen(tag: str, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{tag}|{rank}".encode()))


def ints(tag: str, rank: int, shape, lo: int, hi: int, dtype) -> torch.Tensor:
    """Integers in [lo, hi) as ``dtype``, on the CPU."""
    return torch.randint(lo, hi, tuple(shape), generator=gen(tag, rank)).to(dtype)


def normal(tag: str, rank: int, shape, dtype) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen(tag, rank), dtype=torch.float64).to(dtype)


def value_range(dtype, op: str) -> tuple[int, int]:
    """Inputs for ``op`` that cannot overflow ``dtype`` with up to 4 ranks."""
    if op == "Product":
        return (0, 3) if dtype == torch.uint8 else (-2, 3)
    if dtype == torch.uint8:
        return 0, 50
    if dtype == torch.int8:
        return -25, 25
    return -8, 9


def reference(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of the CPU tensors ``xs`` with ``op``, in ``xs[0]``'s dtype (exact for
    the inputs of :func:`value_range`; Average of integers is made exact by the caller)."""
    dtype = xs[0].dtype
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    s = torch.stack([x.to(wide) for x in xs])
    if op == "Sum":
        r = s.sum(0)
    elif op == "Average":
        r = s.sum(0) / len(xs) if dtype.is_floating_point else s.sum(0) // len(xs)
    elif op == "Min":
        r = s.min(0).values
    elif op == "Max":
        r = s.max(0).values
    elif op == "Product":
        r = s.prod(0)
    else:
        raise ValueError(op)
    return r.to(dtype)


def tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol) for reductions of N(0, 1) inputs over a few ranks."""
    return {torch.float16: (1e-2, 1e-2), torch.bfloat16: (4e-2, 4e-2),
            torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12)}[dtype]


def put(x: torch.Tensor, device) -> torch.Tensor:
    """A copy of ``x`` on ``device`` (a copy even when ``x`` is there already)."""
    return x.to(device, copy=True)
