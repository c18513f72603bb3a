"""unison.numpy: the collectives on numpy arrays.

Framework-neutral, and the reference every adapter is tested against.
Arrays go to the core by pointer; a non-contiguous input is copied to a
contiguous one first. Each op has a blocking form, an `_async` form that
returns a handle for synchronize()/poll(), and in-place `_` forms where
the result has the input's shape.
"""
import numpy as np

from unison import collective
from unison.basics import Adasum, Average, Max, Min, Product, Sum, size  # noqa: F401
from unison.exceptions import InvalidArgumentError
from unison.handles import Handle, poll, synchronize  # noqa: F401
from unison import handles as _handles
from unison._native import ffi, lib

_DTYPES = {
    np.dtype(np.uint8): lib.UNISON_UINT8,
    np.dtype(np.int8): lib.UNISON_INT8,
    np.dtype(np.int16): lib.UNISON_INT16,
    np.dtype(np.int32): lib.UNISON_INT32,
    np.dtype(np.int64): lib.UNISON_INT64,
    np.dtype(np.float16): lib.UNISON_FLOAT16,
    np.dtype(np.float32): lib.UNISON_FLOAT32,
    np.dtype(np.float64): lib.UNISON_FLOAT64,
    np.dtype(np.bool_): lib.UNISON_BOOL,
}
try:  # numpy has no bfloat16; ml_dtypes (used by JAX and TensorFlow) does
    import ml_dtypes

    _DTYPES[np.dtype(ml_dtypes.bfloat16)] = lib.UNISON_BFLOAT16
except ImportError:
    pass


def _dtype_code(array, name):
    code = _DTYPES.get(array.dtype)
    if code is None:
        raise InvalidArgumentError(
            "unison: tensor %r has dtype %s, which unison does not reduce or move; supported: %s"
            % (name or "(unnamed)", array.dtype, ", ".join(sorted(str(d) for d in _DTYPES))))
    return code


def _contiguous(tensor):
    return np.asarray(tensor, order="C")  # ascontiguousarray would make a scalar 1-d


def _in_place_target(tensor, name):
    if isinstance(tensor, np.ndarray):
        flags = tensor.flags
        if flags.c_contiguous and flags.writeable:
            return tensor
    raise InvalidArgumentError(
        "unison: in-place op on %r needs a writable C-contiguous numpy array" % (name or "(unnamed)"))


def _pointer(array):
    return ffi.from_buffer(array) if array.size else ffi.NULL


def _core_allocated(dtype):
    """Finisher for ops whose output the core allocated."""
    def finish(handle_id):
        owned, nbytes, shape = _handles.result_buffer(handle_id)
        if nbytes == 0:
            return np.zeros(shape, dtype=dtype)
        return np.frombuffer(ffi.buffer(owned, nbytes), dtype=dtype).reshape(shape)
    return finish


# ---- allreduce ----------------------------------------------------------------

def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None):
    array = _contiguous(tensor)
    output = np.empty_like(array)
    return _allreduce(array, output, average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None):
    array = _in_place_target(tensor, name)
    return _allreduce(array, array, average, name, op, prescale_factor, postscale_factor, process_set)


_ALLREDUCE = lib.UNISON_ALLREDUCE


def _allreduce(array, output, average, name, op, prescale_factor, postscale_factor, process_set):
    # The path every gradient takes, so it is kept short: see collective.py.
    reduce_op = op if op is not None and average is None else collective.resolve_op(op, average)
    code = _DTYPES.get(array.dtype)
    if code is None:
        _dtype_code(array, name)  # raises, naming the tensor
    input_pointer = _pointer(array)
    handle_id = collective.enqueue(
        _ALLREDUCE, name, code, array.shape,
        input_pointer, input_pointer if output is array else _pointer(output), reduce_op,
        prescale_factor, postscale_factor, 0, None, process_set)
    return Handle(handle_id, name, (array, output), None, output)


def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=None):
    """Reduces `tensor` across all ranks (Average by default, as Horovod)."""
    return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                       process_set))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None):
    base = name or "grouped_allreduce"
    return [allreduce_async(t, average, "%s.%d" % (base, i) if name else None, op,
                            prescale_factor, postscale_factor, process_set) for i, t in enumerate(tensors)]


def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=None):
    return [synchronize(h) for h in grouped_allreduce_async(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set)]


# ---- allgather ----------------------------------------------------------------

def allgather_async(tensor, name=None, process_set=None):
    array = _contiguous(tensor)
    handle_id = collective.enqueue(lib.UNISON_ALLGATHER, name, _dtype_code(array, name), array.shape,
                                   _pointer(array), process_set=process_set)
    return Handle(handle_id, name, (array,), _core_allocated(array.dtype))


def allgather(tensor, name=None, process_set=None):
    """Concatenates every rank's tensor along the first dimension, which may
    differ between ranks."""
    return synchronize(allgather_async(tensor, name, process_set))


# ---- broadcast ----------------------------------------------------------------

def broadcast_async(tensor, root_rank, name=None, process_set=None):
    array = _contiguous(tensor)
    output = np.empty_like(array)
    return _broadcast(array, output, root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    array = _in_place_target(tensor, name)
    return _broadcast(array, array, root_rank, name, process_set)


def _broadcast(array, output, root_rank, name, process_set):
    handle_id = collective.enqueue(lib.UNISON_BROADCAST, name, _dtype_code(array, name), array.shape,
                                   _pointer(array), _pointer(output), root_rank=root_rank,
                                   process_set=process_set)
    return Handle(handle_id, name, (array, output), lambda _: output)


def broadcast(tensor, root_rank, name=None, process_set=None):
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor, root_rank, name=None, process_set=None):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---- alltoall -----------------------------------------------------------------

def alltoall_async(tensor, splits=None, name=None, process_set=None):
    array = _contiguous(tensor)
    split_list = None if splits is None else [int(s) for s in np.asarray(splits).reshape(-1)]
    handle_id = collective.enqueue(lib.UNISON_ALLTOALL, name, _dtype_code(array, name), array.shape,
                                   _pointer(array), splits=split_list, process_set=process_set)
    gather = _core_allocated(array.dtype)
    count = size()

    def finish(hid):
        output = gather(hid)
        if splits is None:
            return output
        return output, np.asarray(_handles.received_splits(hid, count), dtype=np.int64)
    return Handle(handle_id, name, (array,), finish)


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Sends rows splits[i] of `tensor` to rank i and concatenates what every
    rank sent here. Without splits the first dimension is divided evenly and
    only the output is returned; with splits, (output, received_splits)."""
    return synchronize(alltoall_async(tensor, splits, name, process_set))


# ---- reducescatter -------------------------------------------------------------

def reducescatter_async(tensor, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                        process_set=None):
    array = _contiguous(tensor)
    handle_id = collective.enqueue(lib.UNISON_REDUCESCATTER, name, _dtype_code(array, name), array.shape,
                                   _pointer(array), reduce_op=op, prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor, process_set=process_set)
    return Handle(handle_id, name, (array,), _core_allocated(array.dtype))


def reducescatter(tensor, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                  process_set=None):
    """Reduces `tensor` across ranks and returns this rank's rows of the
    result: the first dimension split as evenly as possible, the first ranks
    taking one more row when it does not divide."""
    return synchronize(reducescatter_async(tensor, op, name, prescale_factor, postscale_factor, process_set))


def grouped_reducescatter(tensors, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                          process_set=None):
    base = name or "grouped_reducescatter"
    handles = [reducescatter_async(t, op, "%s.%d" % (base, i) if name else None, prescale_factor,
                                   postscale_factor, process_set) for i, t in enumerate(tensors)]
    return [synchronize(h) for h in handles]


def grouped_allgather(tensors, name=None, process_set=None):
    base = name or "grouped_allgather"
    handles = [allgather_async(t, "%s.%d" % (base, i) if name else None, process_set)
               for i, t in enumerate(tensors)]
    return [synchronize(h) for h in handles]


# ---- barrier and join -----------------------------------------------------------

def barrier(process_set=None):
    """Returns once every rank has called barrier()."""
    handle_id = collective.enqueue(lib.UNISON_BARRIER, "barrier", process_set=process_set)
    synchronize(Handle(handle_id, "barrier", (), lambda _: None))


def join(process_set=None):
    """Declares that this rank has no more data: until every rank has
    joined, it takes part in the others' collectives with zeros (allreduce,
    reducescatter) or nothing (allgather, alltoall). Returns the rank that
    joined last. Average still divides by the full size."""
    handle_id = collective.enqueue(lib.UNISON_JOIN, "join", process_set=process_set)
    return synchronize(Handle(handle_id, "join", (), _handles.join_rank))
