"""Gradient compression for allreduce: what goes over the wire.

`Compression.none` sends tensors as they are; `Compression.fp16` sends
floating-point tensors as float16 and restores their dtype afterwards,
halving the bytes moved at the cost of precision.
"""
import tensorflow as tf

from unison.compression import Compressor, NoneCompressor  # noqa: F401


class FP16Compressor(Compressor):
    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """The compressors, under Horovod's names."""
    none = NoneCompressor
    """Sends tensors as they are."""
    fp16 = FP16Compressor
    """Sends floating-point tensors as float16 and restores their dtype after the collective."""
