"""unison.numpy: the collectives on numpy arrays.

Framework-neutral, and the reference every adapter is tested against.
Arrays go to the core by pointer; a non-contiguous input is copied to a
contiguous one first. Each op has a blocking form, an `_async` form that
returns a handle for synchronize()/poll(), and in-place `_` forms where
the result has the input's shape. The work is done by the shared front
end (frontend.py); this module says what a numpy array is.
"""
import numpy as np

from unison import arguments, collective, frontend
from unison.basics import Adasum, Average, Max, Min, Product, Sum, size  # noqa: F401
from unison.exceptions import InvalidArgumentError
from unison.handles import Handle, poll, synchronize  # noqa: F401
from unison._native import ffi

_HOST = collective.HOST


class NumpyTensors(frontend.Tensors):
    """numpy arrays for the shared front end."""

    def dtype_key(self, array):
        return array.dtype

    def dtype_name(self, array):
        return array.dtype.name

    def check(self, array, name):
        if not isinstance(array, np.ndarray):
            raise InvalidArgumentError("unison: tensor %r must be a numpy array, got %s"
                                       % (name or "(unnamed)", type(array).__name__))

    def readable(self, array):
        return np.asarray(array, order="C")  # ascontiguousarray would make a scalar 1-d

    def shape(self, array):
        return array.shape

    def pointer(self, array):
        return ffi.from_buffer(array) if array.size else ffi.NULL

    def empty_like(self, array):
        return np.empty_like(array)

    def writable(self, array, name):
        flags = array.flags
        if flags.c_contiguous and flags.writeable:
            return array, None
        raise InvalidArgumentError(
            "unison: in-place op on %r needs a writable C-contiguous numpy array" % (name or "(unnamed)"))

    def in_place(self, array, name):
        if type(array) is np.ndarray:   # subclasses take the general path
            flags = array.flags
            if flags.c_contiguous and flags.writeable:
                return array, None, array.dtype, array.shape, ffi.from_buffer(array) if array.size else ffi.NULL, _HOST
        return super().in_place(array, name)

    def adopt(self, owned, nbytes, shape, like):
        if nbytes == 0:
            return np.zeros(shape, dtype=like.dtype)
        return np.frombuffer(ffi.buffer(owned, nbytes), dtype=like.dtype).reshape(shape)


front_end = frontend.FrontEnd(NumpyTensors())
"""The shared front end (unison.frontend) bound to numpy's arrays; the
functions below are its public form."""


def _array(tensor):
    return tensor if isinstance(tensor, np.ndarray) else np.asarray(tensor)


# ---- allreduce ----------------------------------------------------------------

def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None):
    """Starts an allreduce of `tensor` and returns a handle for synchronize() or poll();
    the tensor must not change until it completes. Takes allreduce's arguments, and raises
    what it raises."""
    op = arguments.resolve_op(op, average)
    return front_end.allreduce_async(_array(tensor), name, op, prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None):
    """Starts an in-place allreduce: `tensor` (a writable, contiguous array) receives
    the result. Returns a handle for synchronize() or poll(). Takes allreduce's arguments, and raises
    what it raises."""
    op = arguments.resolve_op(op, average)
    return front_end.allreduce_async_(tensor, name, op, prescale_factor, postscale_factor, process_set)


def allreduce(tensor, average=None, name=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=None):
    """Reduces `tensor` across ranks and returns the result as a new array
    (Average by default, as in Horovod).

    Args:
        tensor: a numpy array (or anything `np.asarray` takes), the same shape and dtype on every rank.
        average: Horovod's old flag; `op` replaces it.
        name: the name ranks match this tensor by; generated in call order where None.
        op: Average (the default), Sum, Min, Max, Product or Adasum.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.
        process_set: the ranks that take part (every rank by default).

    Raises:
        MismatchError: ranks gave the same name different shapes, dtypes or ops.
        InvalidArgumentError: an op or dtype this reduction does not take.
        RankFailedError: a rank of the set died or stopped answering.
    """
    return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                       process_set))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None):
    """Reduces `tensor` across ranks in place and returns it. Takes allreduce's arguments, and raises
    what it raises."""
    op = arguments.resolve_op(op, average)
    return front_end.allreduce_(tensor, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None):
    """Starts an allreduce of every array in `tensors` as one unit: none starts
    before all are enqueued, and they are negotiated and fused together. Returns one handle
    whose result is the list of reduced arrays. Takes allreduce's arguments."""
    op = arguments.resolve_op(op, average)
    return front_end.grouped_allreduce_async([_array(t) for t in tensors], name, op, prescale_factor,
                                             postscale_factor, process_set)


def grouped_allreduce(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=None):
    """Reduces every array in `tensors` as one unit (see grouped_allreduce_async) and
    returns the list of results."""
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                               process_set))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=None):
    """Reduces every array in `tensors` in place, as one unit, and returns them."""
    op = arguments.resolve_op(op, average)
    return synchronize(front_end.grouped_allreduce_async(tensors, name, op, prescale_factor, postscale_factor,
                                                         process_set, in_place=True))


# ---- allgather ----------------------------------------------------------------

def allgather_async(tensor, name=None, process_set=None, output=None):
    """Starts an allgather (see allgather) and returns a handle for synchronize()."""
    return front_end.allgather_async(_array(tensor), name, process_set, output)


def allgather(tensor, name=None, process_set=None, output=None):
    """Concatenates every rank's tensor along the first dimension, which may
    differ between ranks, into a new array or into `output` (contiguous,
    of the same dtype, with room for every rank's rows; `tensor` may be
    this rank's own rows of it)."""
    return synchronize(allgather_async(tensor, name, process_set, output))


def grouped_allgather(tensors, name=None, process_set=None):
    """Allgathers every array in `tensors` as one unit and returns the list of results."""
    return synchronize(front_end.grouped_allgather_async([_array(t) for t in tensors], name, process_set))


# ---- broadcast ----------------------------------------------------------------

def broadcast_async(tensor, root_rank, name=None, process_set=None):
    """Starts a broadcast of rank `root_rank`'s `tensor` (a global rank, in the
    process set) and returns a handle; the result is a new array."""
    return front_end.broadcast_async(_array(tensor), root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    """Starts a broadcast into `tensor` itself (writable and contiguous) from
    rank `root_rank`, and returns a handle."""
    return front_end.broadcast_async_(tensor, root_rank, name, process_set)


def broadcast(tensor, root_rank, name=None, process_set=None):
    """Returns rank `root_rank`'s `tensor` on every rank of the process set.

    Raises:
        MismatchError: ranks gave different shapes, dtypes or roots.
        InvalidArgumentError: `root_rank` is not in the process set."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """Overwrites `tensor` with rank `root_rank`'s on every rank, and returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---- alltoall -----------------------------------------------------------------

def alltoall_async(tensor, splits=None, name=None, process_set=None):
    """Starts an alltoall (see alltoall) and returns a handle for synchronize()."""
    handle = front_end.alltoall_async(_array(tensor), splits, name, process_set)
    gathered = handle._finish

    def finish(hid):
        output, received = gathered(hid)
        return output if splits is None else (output, np.asarray(received, dtype=np.int64))
    handle._finish = finish
    return handle


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Sends rows splits[i] of `tensor` to rank i and concatenates what every
    rank sent here. Without splits the first dimension is divided evenly and
    only the output is returned; with splits, (output, received_splits)."""
    return synchronize(alltoall_async(tensor, splits, name, process_set))


# ---- reducescatter -------------------------------------------------------------

def reducescatter_async(tensor, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                        process_set=None, splits=None, output=None):
    """Starts a reducescatter (see reducescatter) and returns a handle."""
    return front_end.reducescatter_async(_array(tensor), name, op, prescale_factor, postscale_factor,
                                         process_set, splits, output)


def reducescatter(tensor, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                  process_set=None, splits=None, output=None):
    """Reduces `tensor` across ranks and returns this rank's rows of the
    result: the first dimension split as evenly as possible, the first ranks
    taking one more row when it does not divide, or splits[rank] rows when
    `splits` (the same on every rank) gives each rank's count. With
    `output` (contiguous, of the same dtype, with room for them) the rows
    land there."""
    return synchronize(reducescatter_async(tensor, op, name, prescale_factor, postscale_factor, process_set,
                                           splits, output))


def grouped_reducescatter(tensors, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0,
                          process_set=None):
    """Reducescatters every array in `tensors` as one unit and returns the list
    of this rank's parts."""
    return synchronize(front_end.grouped_reducescatter_async([_array(t) for t in tensors], name, op,
                                                             prescale_factor, postscale_factor, process_set))


# ---- barrier and join -----------------------------------------------------------

def barrier(process_set=None):
    """Returns once every rank has called barrier()."""
    collective.barrier(process_set)


def join(process_set=None):
    """Declares that this rank has no more data: until every rank has
    joined, it takes part in the others' allreduces with zeros. Returns the
    rank that joined last. Average still divides by the full size."""
    return collective.join(process_set)


# The public API: what the API reference documents and `import *` gives
# (NumpyTensors and front_end are the shared front end's plumbing).
__all__ = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "allgather", "allgather_async", "grouped_allgather", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "barrier", "join", "poll", "synchronize", "Handle", "Sum", "Average", "Min", "Max",
    "Product", "Adasum", "size",
]
