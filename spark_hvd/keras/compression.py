"""Gradient compression for Keras 3 tensors of any backend (the rules live in
``spark_hvd.common.compression``): casts go through ``keras.ops``, so one compressor serves
TensorFlow, torch and JAX tensors, and inside a traced or compiled step.

    opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.fp16)
"""

import keras

from ..common import compression as _common
from ..common.compression import Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


def _wide_float(dtype):
    """Floating point, other than float16 itself (which travels as it is)."""
    name = keras.backend.standardize_dtype(dtype)
    return name in ("float32", "float64", "bfloat16")


class FP16Compressor(_common.FP16Compressor):
    """Sends floating-point tensors as float16 and casts results back to their dtype."""

    _wire_dtype = "float16"
    _is_floating = staticmethod(_wide_float)
    _cast = staticmethod(keras.ops.cast)

    @classmethod
    def decompress(cls, tensor, ctx):
        """Casts ``tensor`` back to the dtype recorded by :meth:`compress`."""
        if ctx is not None and keras.backend.standardize_dtype(tensor.dtype) != \
                keras.backend.standardize_dtype(ctx):
            return cls._cast(tensor, ctx)
        return tensor


class Compression(_common.Compression):
    """The built-in compressors: ``Compression.none`` and ``Compression.fp16``."""

    fp16 = FP16Compressor
