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

    @staticmethod
    def _is_floating(tensor):
        return tensor.dtype.is_floating

    @staticmethod
    def _dtype(tensor):
        return tensor.dtype

    @staticmethod
    def _cast(tensor, dtype):
        return tf.cast(tensor, dtype)


class Compression:
    """The built-in compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
