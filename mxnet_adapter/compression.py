"""Gradient compression for allreduce: what goes over the wire.

`Compression.none` sends arrays as they are; `Compression.fp16` sends
floating-point arrays as float16 and restores their dtype afterwards,
halving the bytes moved at the cost of precision.
"""
import numpy as np

from unison.compression import Compressor, NoneCompressor  # noqa: F401


class FP16Compressor(Compressor):
    @staticmethod
    def compress(tensor):
        dtype = np.dtype(tensor.dtype)
        if dtype.kind == "f" and dtype != np.float16:
            return tensor.astype(np.float16), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.astype(ctx)


class Compression:
    """The compressors, under Horovod's names."""
    none = NoneCompressor
    """Sends tensors as they are."""
    fp16 = FP16Compressor
    """Sends floating-point tensors as float16 and restores their dtype after the collective."""
