"""Gradient compression for torch tensors (the rules live in ``spark_hvd.common.compression``).

    opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.fp16)

Subclass :class:`Compressor` (static ``compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx) -> tensor``) for a custom scheme.
"""

import torch

from ..common import compression as _common
from ..common.compression import Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class FP16Compressor(_common.FP16Compressor):
    """Sends floating-point tensors as float16 and casts results back to their dtype."""

    _wire_dtype = torch.float16
    _is_floating = staticmethod(lambda dtype: dtype.is_floating_point)
    _cast = staticmethod(torch.Tensor.to)


class Compression(_common.Compression):
    """The built-in compressors: ``Compression.none`` and ``Compression.fp16``."""

    fp16 = FP16Compressor
