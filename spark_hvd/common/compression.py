"""Gradient compression, shared by the framework adapters.

A compressor turns a tensor into the one that travels (``compress`` returns it with a context)
and back (``decompress``). The rules are Horovod's: ``none`` sends the tensor as is; ``fp16``
sends floating-point tensors as float16 and casts the result back to the original dtype,
leaving integer and bool tensors untouched. An adapter's ``FP16Compressor`` only names its
framework's float16 dtype and two primitives (is a dtype floating point, cast a tensor), and
its ``Compression`` subclasses :class:`Compression` with that ``fp16``.
"""


class Compressor:
    """Interface for compressing and decompressing a tensor (subclass it for custom schemes)."""

    @staticmethod
    def compress(tensor):
        """Returns ``(tensor to send, context needed by decompress)``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Returns the received ``tensor`` restored with ``ctx``."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor):
        """Returns ``(tensor, None)``."""
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        """Returns ``tensor``."""
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes), restores the dtype after.

    Framework adapters subclass it and set ``_wire_dtype`` (their float16),
    ``_is_floating(dtype)`` and ``_cast(tensor, dtype)``.
    """

    _wire_dtype = None

    @classmethod
    def compress(cls, tensor):
        """Returns ``(float16 tensor, original dtype)``; non-float tensors pass unchanged."""
        dtype = tensor.dtype
        if cls._is_floating(dtype) and dtype != cls._wire_dtype:
            return cls._cast(tensor, cls._wire_dtype), dtype
        return tensor, dtype

    @classmethod
    def decompress(cls, tensor, ctx):
        """Casts ``tensor`` back to the dtype recorded by :meth:`compress`."""
        if ctx is not None and tensor.dtype != ctx:
            return cls._cast(tensor, ctx)
        return tensor

    @staticmethod
    def _is_floating(dtype):
        raise NotImplementedError

    @staticmethod
    def _cast(tensor, dtype):
        raise NotImplementedError


class Compression:
    """The built-in compressors: ``Compression.none`` and ``Compression.fp16`` (each adapter's
    subclass sets its own ``fp16``)."""

    none = NoneCompressor
    fp16 = FP16Compressor


def compressed(compression, tensors, collective, *args):
    """``collective(tensors, *args)`` (a list in, a list out) run on the tensors as
    ``compression`` sends them; returns its outputs decompressed (``[]`` for no tensors).
    The framework adapters' allreduce and reducescatter, single and grouped, go through here."""
    pairs = [compression.compress(t) for t in tensors]
    if not pairs:
        return []
    outs = collective([c for c, _ in pairs], *args)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]
