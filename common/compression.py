"""Gradient compression for allreduce, shared by the front ends: a
compressor turns a tensor into what goes over the wire and back.
`NoneCompressor` sends tensors as they are; each front end adds its own
`FP16Compressor` (the cast is framework code) and a `Compression` holder."""


class Compressor:
    """compress(tensor) -> (wire tensor, context); decompress(wire, context)."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


def compress_all(compression, tensors):
    """(wire tensors, contexts) for a list of tensors, in order."""
    wires, contexts = [], []
    for t in tensors:
        wire, ctx = compression.compress(t)
        wires.append(wire)
        contexts.append(ctx)
    return wires, contexts


def check_compressor(compression, where):
    """A clear error for a `compression` that is not a compressor: in
    Horovod's argument orders it sits where a number (a predivide factor)
    is easily passed by position."""
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError("unison: %s: compression must be a compressor such as Compression.none or "
                        "Compression.fp16, not %s %r" % (where, type(compression).__name__, compression))
