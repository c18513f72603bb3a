"""The collectives on MXNet NDArrays, with Horovod's MXNet signatures.

allreduce, broadcast and reducescatter, whose output shapes are known
before any rank talks, are pushed to MXNet's engine (engine.py explains the
ordering) and read and write the arrays' memory in place: no copy through
numpy. allgather and alltoall, whose output shapes only negotiation tells,
wait for their input, run, and copy the core's result into a new NDArray.

Unlike Horovod's MXNet ops, the public functions return once the result is
ready, so a mismatch or a dead rank is raised here, at the call, as a
Python exception. DistributedTrainer and DistributedOptimizer push their
allreduces without waiting, so they overlap backward inside the engine.
"""
import threading

import mxnet as mx
import numpy as np

from unison import basics, collective
from unison import handles as _handles
from unison.exceptions import InvalidArgumentError, UnsupportedError
from unison.handles import Handle
from unison.process_sets import global_process_set
from unison._native import ffi, lib
from unison.mxnet.engine import bridge, data_pointer

Sum, Average, Min, Max, Product, Adasum = (basics.Sum, basics.Average, basics.Min, basics.Max,
                                           basics.Product, basics.Adasum)

_DTYPES = {
    np.dtype(np.uint8): lib.UNISON_UINT8,
    np.dtype(np.int8): lib.UNISON_INT8,
    np.dtype(np.int32): lib.UNISON_INT32,
    np.dtype(np.int64): lib.UNISON_INT64,
    np.dtype(np.float16): lib.UNISON_FLOAT16,
    np.dtype(np.float32): lib.UNISON_FLOAT32,
    np.dtype(np.float64): lib.UNISON_FLOAT64,
}

# Ops pushed to the engine may start in any order on its threads, so their
# names are fixed here, in program order, which every rank shares.
_counter_lock = threading.Lock()
_counters = {}


def _name(kind, name):
    if name:
        return name
    with _counter_lock:
        _counters[kind] = _counters.get(kind, 0) + 1
        return "%s.mx.%d" % (kind, _counters[kind])


def _dtype_code(tensor, name):
    if not isinstance(tensor, mx.nd.NDArray):
        raise InvalidArgumentError("unison: tensor %r must be an mxnet NDArray, got %s"
                                   % (name, type(tensor).__name__))
    if tensor.context.device_type != "cpu":
        raise UnsupportedError("unison: tensor %r is on %s; this build moves CPU arrays only"
                               % (name, tensor.context))
    if tensor.stype != "default":
        raise InvalidArgumentError("unison: tensor %r has storage type %s; pass a dense NDArray"
                                   % (name, tensor.stype))
    code = _DTYPES.get(np.dtype(tensor.dtype))
    if code is None:
        raise InvalidArgumentError("unison: tensor %r has dtype %s, which unison does not reduce or move; "
                                   "supported: %s" % (name, np.dtype(tensor.dtype),
                                                      ", ".join(str(d) for d in _DTYPES)))
    return code


def _pointer(array):
    return ffi.cast("void*", data_pointer(array)) if array.size else ffi.NULL


def _push(name, reads, writes, enqueue, priority):
    """Pushes a core op on arrays the engine orders; `enqueue()` runs on an
    engine thread and returns the core's handle id."""
    def start():
        return Handle(enqueue(), name, (reads, writes), lambda _: None)
    return bridge.push(name, reads, writes, start, priority)


# ---- allreduce ----------------------------------------------------------------

def _allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor, process_set, priority):
    code = _dtype_code(tensor, name)
    if op == Adasum:
        raise UnsupportedError("unison: Adasum is not implemented for MXNet")
    name = _name("allreduce", name)
    shape = tensor.shape

    def enqueue():
        return collective.enqueue(lib.UNISON_ALLREDUCE, name, code, shape, _pointer(tensor), _pointer(output),
                                  reduce_op=op, prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, process_set=process_set)
    reads = [] if output is tensor else [tensor]
    return _push(name, reads, [output], enqueue, priority)


def allreduce(tensor, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set, op=None):
    """A new NDArray: `tensor` reduced across ranks (Average by default)."""
    op = collective.resolve_op(op, average)
    _dtype_code(tensor, name)
    output = mx.nd.empty(tensor.shape, ctx=tensor.context, dtype=tensor.dtype)
    _allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor, process_set, priority).wait()
    return output


def allreduce_(tensor, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set, op=None):
    """Reduces `tensor` in place; returns it."""
    op = collective.resolve_op(op, average)
    _allreduce_async(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set, priority).wait()
    return tensor


def _grouped(tensors, name):
    base = _name("grouped_allreduce", name)
    return [(t, "%s.%d" % (base, i)) for i, t in enumerate(tensors)]


def grouped_allreduce(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set, op=None):
    """New NDArrays, each tensor reduced; the core fuses them."""
    op = collective.resolve_op(op, average)
    for t in tensors:
        _dtype_code(t, name)
    outputs = [mx.nd.empty(t.shape, ctx=t.context, dtype=t.dtype) for t in tensors]
    ops = [_allreduce_async(t, out, n, op, prescale_factor, postscale_factor, process_set, priority)
           for (t, n), out in zip(_grouped(tensors, name), outputs)]
    _wait_all(ops)
    return outputs


def grouped_allreduce_(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set, op=None):
    op = collective.resolve_op(op, average)
    ops = [_allreduce_async(t, t, n, op, prescale_factor, postscale_factor, process_set, priority)
           for t, n in _grouped(tensors, name)]
    _wait_all(ops)
    return tensors


def _wait_all(ops):
    """Waits for every op, then raises the first failure: none is left
    running on arrays the caller may reuse."""
    failure = None
    for op in ops:
        try:
            op.wait()
        except Exception as e:  # noqa: BLE001 - re-raised below
            failure = failure or e
    if failure is not None:
        raise failure


# ---- broadcast ----------------------------------------------------------------

def _broadcast_async(tensor, root_rank, name, process_set, priority):
    code = _dtype_code(tensor, name)
    name = _name("broadcast", name)
    shape = tensor.shape

    def enqueue():
        p = _pointer(tensor)
        return collective.enqueue(lib.UNISON_BROADCAST, name, code, shape, p, p, root_rank=root_rank,
                                  process_set=process_set)
    return _push(name, [], [tensor], enqueue, priority)


def broadcast_(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """Overwrites `tensor` with root_rank's, in place; returns it."""
    _broadcast_async(tensor, root_rank, name, process_set, priority).wait()
    return tensor


def broadcast(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """A new NDArray holding root_rank's `tensor`."""
    return broadcast_(tensor.copy(), root_rank, name, priority, process_set)


# ---- reducescatter ------------------------------------------------------------

def reducescatter(tensor, op=Average, name=None, priority=0, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """This rank's part of the first dimension of `tensor` reduced across
    ranks: rows split as evenly as possible, the first ranks taking one more."""
    code = _dtype_code(tensor, name)
    if len(tensor.shape) == 0:
        raise InvalidArgumentError("unison: reducescatter of %r needs at least one dimension" % name)
    size, rank = basics.size(), basics.rank()
    rows = tensor.shape[0]
    mine = rows // size + (1 if rank < rows % size else 0)
    output = mx.nd.empty((mine,) + tuple(tensor.shape[1:]), ctx=tensor.context, dtype=tensor.dtype)
    name = _name("reducescatter", name)
    shape = tensor.shape

    def enqueue():
        return collective.enqueue(lib.UNISON_REDUCESCATTER, name, code, shape, _pointer(tensor),
                                  _pointer(output), reduce_op=op, prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, process_set=process_set)
    _push(name, [tensor], [output], enqueue, priority).wait()
    return output


# ---- ops whose output shape only negotiation tells ----------------------------

def _run_now(tensor, kind, name, op_code, **options):
    """Runs a core op on `tensor` once MXNet has finished writing it and
    returns the core-allocated result as a new NDArray (one copy)."""
    code = _dtype_code(tensor, name)
    tensor.wait_to_read()
    name = _name(kind, name)
    handle_id = collective.enqueue(op_code, name, code, tensor.shape, _pointer(tensor), **options)

    def finish(hid):
        owned, nbytes, shape = _handles.result_buffer(hid)
        values = np.frombuffer(ffi.buffer(owned, nbytes), dtype=np.dtype(tensor.dtype)) if nbytes else \
            np.zeros(0, dtype=np.dtype(tensor.dtype))
        return mx.nd.array(values.reshape(shape), ctx=tensor.context, dtype=tensor.dtype)
    return _handles.synchronize(Handle(handle_id, name, (tensor,), finish))


def allgather(tensor, name=None, priority=0, process_set=global_process_set):
    """Every rank's `tensor` concatenated on the first dimension, in rank
    order (first dimensions may differ)."""
    if len(tensor.shape) == 0:
        raise InvalidArgumentError("unison: allgather of %r needs at least one dimension" % name)
    return _run_now(tensor, "allgather", name, lib.UNISON_ALLGATHER, process_set=process_set)


def alltoall(tensor, splits=None, name=None, priority=0, process_set=global_process_set):
    """Sends splits[i] rows of `tensor` to rank i (equal parts if None);
    returns the rows received, in rank order."""
    if splits is not None:
        splits = [int(s) for s in (splits.asnumpy() if isinstance(splits, mx.nd.NDArray) else splits)]
    return _run_now(tensor, "alltoall", name, lib.UNISON_ALLTOALL, splits=splits, process_set=process_set)


def barrier(process_set=global_process_set):
    """Returns once every rank has called barrier()."""
    handle_id = collective.enqueue(lib.UNISON_BARRIER, "barrier", process_set=process_set)
    _handles.synchronize(Handle(handle_id, "barrier", (), lambda _: None))


def join():
    """Declares this rank out of data; returns the last rank to join."""
    handle_id = collective.enqueue(lib.UNISON_JOIN, "join")
    return _handles.synchronize(Handle(handle_id, "join", (), _handles.join_rank))
