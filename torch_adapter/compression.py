"""Gradient compression for allreduce: what goes over the wire.

`Compression.none` sends tensors as they are; `Compression.fp16` sends
floating-point tensors as float16 and restores their dtype afterwards,
halving the bytes moved at the cost of precision.
"""
import torch

from unison.compression import Compressor, NoneCompressor  # noqa: F401


class FP16Compressor(Compressor):
    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """The compressors, under Horovod's names."""
    none = NoneCompressor
    """Sends tensors as they are."""
    fp16 = FP16Compressor
    """Sends floating-point tensors as float16 and restores their dtype after the collective."""
