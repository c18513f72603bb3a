"""The collectives on torch tensors, with Horovod's torch API.

Contiguous CPU tensors go to the core by pointer, with no copy; a
non-contiguous one is copied to a contiguous tensor first (and an in-place
op copies the result back). Every Handle keeps its tensors alive until the
op completes. The blocking forms of allreduce, allgather, broadcast,
alltoall and reducescatter are autograd functions with Horovod's gradients.
"""
import torch

from unison import basics, collective
from unison import handles as _handles
from unison.exceptions import InvalidArgumentError, UnsupportedError
from unison.handles import Handle, HandleGroup, poll, synchronize  # noqa: F401
from unison.process_sets import global_process_set
from unison._native import ffi, lib
from unison.torch.compression import Compression

Sum, Average, Min, Max, Product, Adasum = (basics.Sum, basics.Average, basics.Min, basics.Max,
                                           basics.Product, basics.Adasum)

_DTYPES = {
    torch.uint8: lib.UNISON_UINT8,
    torch.int8: lib.UNISON_INT8,
    torch.int16: lib.UNISON_INT16,
    torch.int32: lib.UNISON_INT32,
    torch.int64: lib.UNISON_INT64,
    torch.float16: lib.UNISON_FLOAT16,
    torch.bfloat16: lib.UNISON_BFLOAT16,
    torch.float32: lib.UNISON_FLOAT32,
    torch.float64: lib.UNISON_FLOAT64,
    torch.bool: lib.UNISON_BOOL,
}


def _label(name):
    return repr(name) if name else "(unnamed)"


def _dtype_code(tensor, name):
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError("unison: tensor %s must be a torch.Tensor, got %s"
                                   % (_label(name), type(tensor).__name__))
    if tensor.device.type != "cpu":
        raise UnsupportedError("unison: tensor %s is on %s; this build moves CPU tensors only"
                               % (_label(name), tensor.device))
    if tensor.layout != torch.strided:
        raise InvalidArgumentError("unison: tensor %s has layout %s; pass a dense tensor (or use "
                                   "sparse_allreduce_async)" % (_label(name), tensor.layout))
    code = _DTYPES.get(tensor.dtype)
    if code is None:
        raise InvalidArgumentError("unison: tensor %s has dtype %s, which unison does not reduce or move; "
                                   "supported: %s" % (_label(name), tensor.dtype,
                                                      ", ".join(str(d) for d in _DTYPES)))
    return code


def _pointer(tensor):
    return ffi.cast("void*", tensor.data_ptr()) if tensor.numel() else ffi.NULL


def _source(tensor):
    """The tensor's values as a contiguous tensor the core can read."""
    return tensor.detach().contiguous()


def _from_core(handle_id, dtype):
    """The core-allocated result of a completed op as a tensor that owns it."""
    owned, nbytes, shape = _handles.result_buffer(handle_id)
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.frombuffer(ffi.buffer(owned, nbytes), dtype=torch.uint8)  # keeps `owned` alive
    return raw.view(dtype).reshape(shape)


def _in_place_target(tensor):
    """(contiguous buffer holding `tensor`'s values that the core reads and
    overwrites, finisher that returns `tensor`). Only a non-contiguous
    tensor costs a copy, and its result is copied back."""
    if tensor.is_contiguous():
        target = tensor.detach()
        return target, lambda _: tensor
    target = tensor.detach().contiguous()

    def finish(_):
        with torch.no_grad():
            tensor.copy_(target)
        return tensor
    return target, finish


def _scale_check(op, prescale_factor, postscale_factor):
    if op == Adasum and (prescale_factor != 1.0 or postscale_factor != 1.0):
        raise InvalidArgumentError("unison: Adasum takes no scale factors")


# ---- allreduce ----------------------------------------------------------------

def _allreduce_async(tensor, code, source, target, finish, name, op, prescale_factor, postscale_factor,
                     process_set):
    if op == Adasum:
        return _adasum_async(source, target, finish, name, process_set)
    handle_id = collective.enqueue(
        lib.UNISON_ALLREDUCE, name, code, source.shape, _pointer(source), _pointer(target),
        reduce_op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        process_set=process_set)
    return Handle(handle_id, name, (tensor, source, target), finish)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts an allreduce of `tensor` into a new tensor; returns a handle."""
    op = collective.resolve_op(op, average)
    _scale_check(op, prescale_factor, postscale_factor)
    code = _dtype_code(tensor, name)
    source = _source(tensor)
    target = torch.empty_like(source)
    return _allreduce_async(tensor, code, source, target, lambda _: target, name, op, prescale_factor,
                            postscale_factor, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Starts an in-place allreduce of `tensor`; returns a handle."""
    op = collective.resolve_op(op, average)
    _scale_check(op, prescale_factor, postscale_factor)
    code = _dtype_code(tensor, name)
    target, finish = _in_place_target(tensor)
    return _allreduce_async(tensor, code, target, target, finish, name, op, prescale_factor,
                            postscale_factor, process_set)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.settings = (op, prescale_factor, postscale_factor, process_set)
        return synchronize(allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor,
                                           process_set))

    @staticmethod
    def backward(ctx, grad_output):
        op, prescale_factor, postscale_factor, process_set = ctx.settings
        _differentiable_reduce(op, "allreduce")
        grad = allreduce(grad_output, op=op, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor, process_set=process_set)
        return grad, None, None, None, None, None


def _differentiable_reduce(op, what):
    # The sum (and average) of the ranks' tensors is linear in each of them,
    # so its gradient is the same reduction of the gradients. Min, Max and
    # Product have no such rule here, and a wrong gradient is worse than none.
    if op not in (Sum, Average, Adasum):
        raise UnsupportedError("unison: the gradient of %s is defined for Sum and Average only" % what)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduces `tensor` across ranks (Average by default) into a new tensor.
    Differentiable: the gradient is the same reduction of the gradients."""
    op = collective.resolve_op(op, average)
    compressed, context = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, context)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


def _member_name(name, i):
    return None if name is None else "%s.%d" % (name, i)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """One handle for the allreduce of every tensor in the list; they are
    enqueued together, so the core fuses them."""
    return HandleGroup([allreduce_async(t, average, _member_name(name, i), op, prescale_factor,
                                        postscale_factor, process_set) for i, t in enumerate(tensors)])


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    return HandleGroup([allreduce_async_(t, average, _member_name(name, i), op, prescale_factor,
                                         postscale_factor, process_set) for i, t in enumerate(tensors)])


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.settings = (op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op, prescale_factor,
                                                         postscale_factor, process_set)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        op, prescale_factor, postscale_factor, process_set = ctx.settings
        _differentiable_reduce(op, "grouped_allreduce")
        grads = synchronize(grouped_allreduce_async([g.contiguous() for g in grad_outputs], None, None, op,
                                                    prescale_factor, postscale_factor, process_set))
        return (None, None, None, None, None) + tuple(grads)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    op = collective.resolve_op(op, average)
    compressed, contexts = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    reduced = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set, *compressed)
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Allreduce of a sparse COO tensor: the ranks' indices and values are
    allgathered and summed where they coincide (averaged for Average)."""
    if op not in (Sum, Average):
        raise UnsupportedError("unison: sparse allreduce supports Sum and Average, got op %r" % op)
    sparse = tensor.coalesce()
    indices = allgather_async(sparse.indices().t().contiguous(), name=_member_name(name or "sparse", 0),
                              process_set=process_set)
    values = allgather_async(sparse.values().contiguous(), name=_member_name(name or "sparse", 1),
                             process_set=process_set)
    count = basics.size()

    def finish(results):
        gathered_indices, gathered_values = results
        if op == Average:
            gathered_values = gathered_values / count
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, tensor.shape,
                                       check_invariants=True).coalesce()
    return HandleGroup([indices, values], finish)


# ---- allgather ----------------------------------------------------------------

def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts concatenating every rank's `tensor` along the first dimension
    (which may differ between ranks); returns a handle."""
    code = _dtype_code(tensor, name)
    source = _source(tensor)
    handle_id = collective.enqueue(lib.UNISON_ALLGATHER, name, code, source.shape, _pointer(source),
                                   process_set=process_set)
    dtype = tensor.dtype
    return Handle(handle_id, name, (tensor, source), lambda hid: _from_core(hid, dtype))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        gathered = synchronize(allgather_async(tensor, name, process_set))
        ctx.rows = tensor.shape[0]
        ctx.process_set = process_set
        return gathered

    @staticmethod
    def backward(ctx, grad_output):
        # As Horovod: average the gradient over ranks, keep this rank's rows.
        reduced = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        rows = synchronize(allgather_async(torch.tensor([ctx.rows], dtype=torch.int64),
                                           process_set=ctx.process_set))
        offset = int(rows[:basics.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenates every rank's tensor along the first dimension.
    Differentiable: this rank's rows of the rank-averaged gradient."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    return HandleGroup([allgather_async(t, _member_name(name, i), process_set) for i, t in enumerate(tensors)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    return synchronize(grouped_allgather_async(tensors, name, process_set))


# ---- broadcast ----------------------------------------------------------------

def _broadcast_async(tensor, code, source, target, finish, root_rank, name, process_set):
    handle_id = collective.enqueue(lib.UNISON_BROADCAST, name, code, source.shape, _pointer(source),
                                   _pointer(target), root_rank=root_rank, process_set=process_set)
    return Handle(handle_id, name, (tensor, source, target), finish)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts copying root_rank's `tensor` into a new tensor on every rank."""
    code = _dtype_code(tensor, name)
    source = _source(tensor)
    target = torch.empty_like(source)
    return _broadcast_async(tensor, code, source, target, lambda _: target, root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    code = _dtype_code(tensor, name)
    target, finish = _in_place_target(tensor)
    return _broadcast_async(tensor, code, target, target, finish, root_rank, name, process_set)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        # As Horovod: the root's input receives the rank-averaged gradient,
        # the others' inputs none.
        reduced = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        if basics.rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """root_rank's `tensor`, on every rank, as a new tensor. Differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---- alltoall -----------------------------------------------------------------

def _split_list(splits):
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return [int(s) for s in splits.reshape(-1).tolist()]
    return [int(s) for s in splits]


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts sending rows splits[i] of `tensor` to rank i. synchronize()
    returns (output, received_splits)."""
    code = _dtype_code(tensor, name)
    source = _source(tensor)
    handle_id = collective.enqueue(lib.UNISON_ALLTOALL, name, code, source.shape, _pointer(source),
                                   splits=_split_list(splits), process_set=process_set)
    dtype, count = tensor.dtype, basics.size()

    def finish(hid):
        received = torch.tensor(_handles.received_splits(hid, count), dtype=torch.int32)
        return _from_core(hid, dtype), received
    return Handle(handle_id, name, (tensor, source), finish)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        ctx.process_set = process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = synchronize(alltoall_async(grad_output.contiguous(), ctx.received,
                                             process_set=ctx.process_set))
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Scatters rows of `tensor` to the ranks and gathers what they sent
    here. Returns the output, and with `splits` also the received splits.
    Differentiable: the gradient goes back by the reverse alltoall."""
    return _Alltoall.apply(tensor, splits, name, process_set)


# ---- reducescatter -------------------------------------------------------------

def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Starts reducing `tensor` across ranks, this rank keeping its rows of
    the result (the first dimension split as evenly as possible, the first
    ranks taking one more row)."""
    code = _dtype_code(tensor, name)
    if op not in (Sum, Average, Min, Max, Product):
        raise UnsupportedError("unison: reducescatter supports Sum, Average, Min, Max and Product")
    source = _source(tensor)
    handle_id = collective.enqueue(lib.UNISON_REDUCESCATTER, name, code, source.shape, _pointer(source),
                                   reduce_op=op, prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor, process_set=process_set)
    dtype = tensor.dtype
    return Handle(handle_id, name, (tensor, source), lambda hid: _from_core(hid, dtype))


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.settings = (op, process_set, prescale_factor * postscale_factor)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                               postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        # Each rank's rows of the sum came from every rank's same rows, so
        # every rank's input gets all ranks' output gradients, gathered.
        op, process_set, factor = ctx.settings
        _differentiable_reduce(op, "reducescatter")
        grad = synchronize(allgather_async(grad_output.contiguous(), process_set=process_set))
        if op == Average:
            factor /= basics.size()
        return (grad * factor if factor != 1.0 else grad), None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """This rank's rows of the reduction of `tensor` across ranks.
    Differentiable: the gradient is the allgather of the gradients."""
    compressed, context = compression.compress(tensor)
    reduced = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(reduced, context)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    return HandleGroup([reducescatter_async(t, _member_name(name, i), op, process_set, prescale_factor,
                                            postscale_factor) for i, t in enumerate(tensors)])


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    compressed, contexts = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    reduced = synchronize(grouped_reducescatter_async(list(compressed), name, op, process_set,
                                                      prescale_factor, postscale_factor))
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


# ---- Adasum ---------------------------------------------------------------------

def _adasum_pair(a, b):
    """Adasum of two gradients: their sum, less the part along each other,
    so orthogonal gradients add and parallel ones average."""
    dot = torch.dot(a, b)
    a_sq, b_sq = torch.dot(a, a), torch.dot(b, b)
    a_weight = 1.0 - dot / (2 * a_sq) if a_sq > 0 else 1.0
    b_weight = 1.0 - dot / (2 * b_sq) if b_sq > 0 else 1.0
    return a_weight * a + b_weight * b


def adasum_combine(parts):
    """Adasum of the ranks' gradients, in rank order, as a binary tree:
    neighbours pair up level by level, an odd one out waiting a level.
    Computed in float64 by every rank from the same inputs, so every rank
    gets the same bits."""
    level = [p.reshape(-1).to(torch.float64) for p in parts]
    while len(level) > 1:
        level = [_adasum_pair(level[i], level[i + 1]) if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]
    return level[0]


def _adasum_async(source, target, finish, name, process_set):
    # Adasum needs dot products between whole gradients of different ranks,
    # which an elementwise reduction cannot give: every rank allgathers the
    # gradient and combines the parts itself. That moves size x the bytes
    # of an allreduce; Adasum is used for its convergence, at small sizes.
    if not source.dtype.is_floating_point:
        raise InvalidArgumentError("unison: Adasum of %s needs a floating-point tensor, got %s"
                                   % (_label(name), source.dtype))
    gathered = allgather_async(source.reshape(1, -1), name=name, process_set=process_set)
    shape, dtype = source.shape, source.dtype

    def combine(results):
        combined = adasum_combine(list(results[0])).to(dtype).reshape(shape)
        with torch.no_grad():
            target.copy_(combined)
        return finish(None)
    return HandleGroup([gathered], combine)


# ---- barrier and join -----------------------------------------------------------

def barrier(process_set=global_process_set):
    """Returns once every rank has called barrier()."""
    handle_id = collective.enqueue(lib.UNISON_BARRIER, "barrier", process_set=process_set)
    synchronize(Handle(handle_id, "barrier", (), lambda _: None))


def join(device=-1):
    """Declares this rank out of data: until every rank has joined, it takes
    part in the others' allreduces with zeros. Returns the last rank to join."""
    handle_id = collective.enqueue(lib.UNISON_JOIN, "join")
    return synchronize(Handle(handle_id, "join", (), _handles.join_rank))
