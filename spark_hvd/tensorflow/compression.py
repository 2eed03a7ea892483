"""Gradient compression for TF tensors (the rules live in ``spark_hvd.common.compression``).

    tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16)

Subclass :class:`Compressor` (static ``compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx) -> tensor``) for a custom scheme.
"""

import tensorflow as tf

from ..common import compression as _common
from ..common.compression import Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class FP16Compressor(_common.FP16Compressor):
    """Sends floating-point tensors as float16 and casts results back to their dtype."""

    _wire_dtype = tf.float16
    _is_floating = staticmethod(lambda dtype: dtype.is_floating)
    _cast = staticmethod(tf.cast)


class Compression(_common.Compression):
    """The built-in compressors: ``Compression.none`` and ``Compression.fp16``."""

    fp16 = FP16Compressor
