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
import contextlib
import threading

import mxnet as mx
import numpy as np

from unison import arguments, collective, frontend
from unison import handles as _handles
from unison.exceptions import InvalidArgumentError, UnsupportedError
from unison.handles import Handle
from unison.process_sets import global_process_set
from unison._native import ffi, lib
from unison.compression import compress_all
from unison.mxnet.compression import Compression
from unison.mxnet.engine import bridge, data_pointer, plain_layout

from unison.basics import Adasum, Average, Max, Min, Product, Sum  # noqa: E402,F401  (hvd.Sum, ... as Horovod's)

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


class MXNetTensors(frontend.Tensors):
    """NDArrays, as far as the shared checks need to see them: MXNet's
    collectives start on its engine threads (engine.py), so they take the
    front end's checks and enqueue from there."""

    def dtype_key(self, tensor):
        return tensor.dtype

    def dtype_name(self, tensor):
        return np.dtype(tensor.dtype).name

    def check(self, tensor, name):
        if not isinstance(tensor, mx.nd.NDArray):
            raise InvalidArgumentError("unison: tensor %r must be an mxnet NDArray, got %s"
                                       % (name, type(tensor).__name__))
        if tensor.context.device_type != "cpu":
            raise UnsupportedError("unison: tensor %r is on %s; this build moves CPU arrays only"
                                   % (name, tensor.context))
        if tensor.stype != "default":
            raise InvalidArgumentError("unison: tensor %r has storage type %s; pass a dense NDArray"
                                       % (name, tensor.stype))

    def shape(self, tensor):
        return tuple(tensor.shape)


_front = frontend.FrontEnd(MXNetTensors())


def _dtype_code(tensor, name):
    return _front.dtype_code(tensor, name)


def _pointer(array, name):
    return ffi.cast("void*", data_pointer(array, name)) if array.size else ffi.NULL


def _push(name, reads, writes, enqueue, priority, settle=True):
    """Pushes a core op on arrays the engine orders; `enqueue()` runs on an
    engine thread and returns the core's handle id. settle: see
    engine.bridge.push (the public functions wait for their result
    anyway, so waiting for their arrays first costs them nothing)."""
    def start():
        return Handle(enqueue(), name, (reads, writes), lambda _: None)
    return bridge.push(name, reads, writes, start, priority, settle)


# ---- allreduce ----------------------------------------------------------------

def _allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor, process_set, priority,
                     settle=True):
    prepared = _front.prepare("allreduce", tensor, name, op, prescale_factor, postscale_factor)
    name = _name("allreduce", name)

    def enqueue():
        return collective.enqueue(lib.UNISON_ALLREDUCE, name, prepared.code, prepared.shape,
                                  _pointer(tensor, name), _pointer(output, name), reduce_op=op,
                                  prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                  process_set=process_set)
    reads = [] if output is tensor else [tensor]
    return _push(name, reads, [output], enqueue, priority, settle)


def allreduce(tensor, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set, op=None, compression=Compression.none):
    """A new NDArray: `tensor` reduced across the ranks of the process set (Average by
    default, as in Horovod), ordered by MXNet's engine after the array's writers.

    Args:
        tensor: a CPU NDArray, the same shape and dtype on every rank.
        average: Horovod's older flag (True: Average, False: Sum); `op` replaces it.
        name: what ranks match this array by; where None, one is made in call order, so every rank
            must make its calls in the same order.
        priority: the priority MXNet's engine gives the pushed op.
        process_set: the ranks that take part; every rank by default.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.
        op: Average, Sum, Min, Max, Product or Adasum.
        compression: Compression.none or Compression.fp16.

    Raises:
        MismatchError: ranks gave the same name different shapes, dtypes or arguments (every rank of
            the set gets it, naming the tensor, the ranks and what each sent).
        InvalidArgumentError: an argument this collective cannot take (an op for this dtype, a GPU
            array, a process set this rank is not in), on the rank that gave it.
        RankFailedError: a rank of the set died or stopped answering.
        ShutDownError: a rank shut unison down while the op waited.
    """
    return grouped_allreduce([tensor], average, name, priority, prescale_factor, postscale_factor,
                             process_set, op, compression)[0]


def allreduce_(tensor, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set, op=None):
    """Reduces `tensor` across the ranks in place and returns it. Takes allreduce's
    arguments (but compression) and raises what it raises.
    """
    op = arguments.resolve_op(op, average)
    _allreduce_async(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set, priority).wait()
    return tensor


def _grouped(tensors, name, kind="grouped_allreduce"):
    """(tensor, core name) pairs, as arguments.member_names names them; an
    unnamed group gets a name in program order first (see _name)."""
    return list(zip(tensors, arguments.member_names(name or _name(kind, None), len(tensors))))


def grouped_allreduce(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set, op=None,
                      compression=Compression.none):
    """New NDArrays, each of `tensors` reduced across the ranks as one unit, so that the
    core fuses them. Takes allreduce's arguments, for the whole list, and raises what it raises.
    """
    op = arguments.resolve_op(op, average)
    for t in tensors:   # before any output is made for them
        _front.prepare("allreduce", t, name, op, prescale_factor, postscale_factor)
    wires, contexts = compress_all(compression, tensors)
    outputs = [mx.nd.empty(t.shape, ctx=t.context, dtype=t.dtype) for t in wires]
    with _all_waited() as ops:
        for (t, n), out in zip(_grouped(wires, name), outputs):
            ops.append(_allreduce_async(t, out, n, op, prescale_factor, postscale_factor, process_set, priority))
    return [compression.decompress(out, ctx) for out, ctx in zip(outputs, contexts)]


def grouped_allreduce_(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set, op=None):
    """Reduces every NDArray in `tensors` in place, as one unit (none starts before
    all are enqueued; they are negotiated and fused together). Takes allreduce_'s arguments;
    the engine orders each array's later readers after its allreduce."""
    op = arguments.resolve_op(op, average)
    with _all_waited() as ops:
        for t, n in _grouped(tensors, name):
            ops.append(_allreduce_async(t, t, n, op, prescale_factor, postscale_factor, process_set, priority))
    return tensors


@contextlib.contextmanager
def _all_waited():
    """Yields a list for the ops pushed inside, and on leaving waits for
    every one of them, then raises the first failure: none is left running
    on arrays the caller may reuse. It waits also when a later push raised
    (that error is the one raised): each op is completed only by the thread
    that waits for it (unison.mxnet.engine), so one left unwaited would keep
    MXNet's hold on its arrays."""
    ops = []
    try:
        yield ops
    except BaseException:
        _wait_for_every(ops)
        raise
    failure = _wait_for_every(ops)
    if failure is not None:
        raise failure


def _wait_for_every(ops):
    """Waits for each op; returns the first failure, or None."""
    failure = None
    for op in ops:
        try:
            op.wait()
        except Exception as e:  # noqa: BLE001 - returned to the caller
            failure = failure or e
    return failure


# ---- broadcast ----------------------------------------------------------------

def _broadcast_async(tensor, root_rank, name, process_set, priority):
    prepared = _front.prepare("broadcast", tensor, name)
    name = _name("broadcast", name)

    def enqueue():
        p = _pointer(tensor, name)
        return collective.enqueue(lib.UNISON_BROADCAST, name, prepared.code, prepared.shape, p, p,
                                  root_rank=root_rank, process_set=process_set)
    return _push(name, [], [tensor], enqueue, priority)


def broadcast_(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """Overwrites `tensor` with rank `root_rank`'s, in place, and returns it. Takes
    broadcast's arguments and raises what it raises.
    """
    _broadcast_async(tensor, root_rank, name, process_set, priority).wait()
    return tensor


def _copy(tensor):
    # Without numpy shape semantics MXNet's operators take a 0 in a shape,
    # or an empty shape, for "unknown", so copy() fails on zero-size and
    # scalar arrays; those few bytes go through numpy instead.
    if tensor.ndim == 0 or tensor.size == 0:
        return mx.nd.array(tensor.asnumpy(), ctx=tensor.context, dtype=tensor.dtype)
    return tensor.copy()


def broadcast(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """A new NDArray holding rank `root_rank`'s `tensor`, on every rank of the process set.

    Args:
        tensor: the same shape and dtype on every rank (only the root's values are read).
        root_rank: the global rank that sends; it must be in the process set.
        name: what ranks match this array by; where None, one is made in call order, so every rank
            must make its calls in the same order.
        priority: the priority MXNet's engine gives the pushed op.
        process_set: the ranks that take part; every rank by default.

    Raises what allreduce raises, and InvalidArgumentError for a root_rank outside the process set.
    """
    return broadcast_(_copy(tensor), root_rank, name, priority, process_set)


# ---- reducescatter ------------------------------------------------------------

def _reducescatter_async(tensor, name, op, prescale_factor, postscale_factor, process_set, priority):
    """(output NDArray, pushed op)."""
    prepared = _front.prepare("reducescatter", tensor, name, op, prescale_factor, postscale_factor)
    rows = arguments.scatter_rows(tensor.shape[0], process_set.size(), process_set.rank())
    output = mx.nd.empty((rows,) + tuple(tensor.shape[1:]), ctx=tensor.context, dtype=tensor.dtype)
    name = _name("reducescatter", name)

    def enqueue():
        return collective.enqueue(lib.UNISON_REDUCESCATTER, name, prepared.code, prepared.shape,
                                  _pointer(tensor, name), _pointer(output, name), reduce_op=op,
                                  prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                  process_set=process_set,
                                  output_bytes=output.size * np.dtype(output.dtype).itemsize)
    return output, _push(name, [tensor], [output], enqueue, priority)


def reducescatter(tensor, op=Average, name=None, priority=0, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0, compression=Compression.none):
    """This rank's rows of `tensor` reduced across the process set: the first dimension
    split as evenly as possible, the first ranks taking one more row when it does not divide.

    Args:
        tensor: the same shape and dtype on every rank.
        op: Average (the default) or Sum.

    The other arguments (name, priority, process_set, prescale_factor, postscale_factor,
    compression) are allreduce's.

    Raises what allreduce raises.
    """
    return grouped_reducescatter([tensor], op, name, priority, process_set, prescale_factor, postscale_factor,
                                 compression)[0]


def grouped_reducescatter(tensors, op=Average, name=None, priority=0, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0, compression=Compression.none):
    """Each tensor reduce-scattered; the core fuses them."""
    for t in tensors:   # before any output is made for them
        _front.prepare("reducescatter", t, name, op, prescale_factor, postscale_factor)
    wires, contexts = compress_all(compression, tensors)
    outputs = []
    with _all_waited() as ops:
        for t, n in _grouped(wires, name, "grouped_reducescatter"):
            output, pushed = _reducescatter_async(t, n, op, prescale_factor, postscale_factor, process_set,
                                                  priority)
            outputs.append(output)
            ops.append(pushed)
    return [compression.decompress(out, ctx) for out, ctx in zip(outputs, contexts)]


# ---- ops whose output shape only negotiation tells ----------------------------

def _to_ndarray(tensor):
    def adopt(owned, nbytes, shape):
        dtype = np.dtype(tensor.dtype)
        values = np.frombuffer(ffi.buffer(owned, nbytes), dtype=dtype) if nbytes else np.zeros(0, dtype=dtype)
        return mx.nd.array(values.reshape(shape), ctx=tensor.context, dtype=tensor.dtype)
    return adopt


def _start_now(tensor, kind, name, op_code, process_set, splits=None):
    """Starts a core op on `tensor` once MXNet has finished writing it; the
    handle's result is the core's output as a new NDArray (one copy), with
    the received splits for alltoall."""
    prepared = _front.prepare(kind, tensor, name)
    counts = arguments.split_counts(splits, name)
    plain_layout([tensor])  # waits for MXNet to finish writing it
    name = _name(kind, name)
    handle_id = collective.enqueue(op_code, name, prepared.code, prepared.shape, _pointer(tensor, name),
                                   splits=counts, process_set=process_set)
    adopt = _to_ndarray(tensor)
    ranks = process_set.size()

    def finish(hid):
        output = adopt(*_handles.result_buffer(hid))
        if op_code == lib.UNISON_ALLTOALL:
            return output, mx.nd.array(_handles.received_splits(hid, ranks), dtype=np.int32)
        return output
    return Handle(handle_id, name, (tensor,), finish)


def allgather(tensor, name=None, priority=0, process_set=global_process_set):
    """Every rank's `tensor` concatenated on the first dimension, in rank order.

    Args:
        tensor: an NDArray whose first dimension may differ between ranks; its other dimensions
            and its dtype must not.
        name: what ranks match this array by; where None, one is made in call order, so every rank
            must make its calls in the same order.
        priority: the priority MXNet's engine gives the pushed op.
        process_set: the ranks that take part; every rank by default.

    Raises what allreduce raises.
    """
    return _handles.synchronize(_start_now(tensor, "allgather", name, lib.UNISON_ALLGATHER, process_set))


def grouped_allgather(tensors, name=None, priority=0, process_set=global_process_set):
    """Each tensor allgathered; started together, so the core fuses them."""
    handles = [_start_now(t, "allgather", n, lib.UNISON_ALLGATHER, process_set)
               for t, n in _grouped(tensors, name, "grouped_allgather")]
    return _handles.synchronize(_handles.HandleGroup(handles))


def alltoall(tensor, splits=None, name=None, priority=0, process_set=global_process_set):
    """Sends rows `splits[i]` of `tensor` to rank i and returns the rows received, in rank
    order, as Horovod's MXNet alltoall.

    Args:
        tensor: the rows to scatter, dtype and trailing dimensions the same on every rank.
        splits: how many rows go to each rank of the set (a list or an NDArray); where None,
            equal parts.
        name: what ranks match this array by; where None, one is made in call order, so every rank
            must make its calls in the same order.
        priority: the priority MXNet's engine gives the pushed op.
        process_set: the ranks that take part; every rank by default.

    Returns:
        The received rows; with `splits`, also how many came from each rank.

    Raises what allreduce raises.
    """
    if isinstance(splits, mx.nd.NDArray):
        splits = splits.asnumpy()
    output, received = _handles.synchronize(
        _start_now(tensor, "alltoall", name, lib.UNISON_ALLTOALL, process_set, splits))
    return output if splits is None else (output, received)


def barrier(process_set=global_process_set):
    """Returns once every rank has called barrier()."""
    collective.barrier(process_set)


def join():
    """Declares this rank out of data; returns the last rank to join."""
    return collective.join()
