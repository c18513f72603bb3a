"""The collectives on torch tensors, with Horovod's torch API.

Contiguous tensors go to the core by pointer, with no copy; a
non-contiguous one is copied to a contiguous tensor first (and an in-place
op copies the result back). CUDA tensors go the same way, with their
device and the current stream: the core runs their collectives on the GPU
(NCCL, or staged through host memory where NCCL cannot serve) in order
with the stream, so the caller never waits for the device. The shared
front end (unison.frontend) does
the checks, the core calls and the handles; this module says what a torch
tensor is and adds autograd: the blocking forms of allreduce, allgather,
broadcast, alltoall and reducescatter (grouped ones too) are autograd
functions whose gradients are unison.gradients', Horovod's definitions.

While TorchDynamo traces (torch.compile), each collective hands over to
its namesake in graph_ops.py, which makes it a `unison::` operator of the
compiled graph (registered_ops.py); eagerly, that costs one check.
"""
import functools
import threading

import torch

from unison import arguments, collective, frontend, gradients
from unison.arguments import member_name as _member_name
from unison.compression import compress_all
from unison.dtypes import label as _label
from unison.exceptions import InvalidArgumentError, UnsupportedError
from unison.handles import GraphNode, Handle, HandleGroup, poll  # noqa: F401
from unison.handles import synchronize as _synchronize
from unison.process_sets import global_process_set
from unison._native import ffi
from unison.torch import fast_path
from unison.torch.compression import Compression

from unison.basics import Adasum, Average, Max, Min, Product, Sum  # noqa: E402,F401  (hvd.Sum, ... as Horovod's)
_HOST, _STRIDED, _VOID_P = collective.HOST, torch.strided, ffi.typeof("void*")
# True while TorchDynamo traces: the public collectives then hand over to
# graph_ops, whose calls become unison:: operators in the compiled graph.
_compiling = torch.compiler.is_compiling


class _DeviceResult:
    """A result the core allocated in device memory, as torch can adopt it
    (__cuda_array_interface__); unison_free gives the memory back when the
    tensor made from it is gone."""

    def __init__(self, owned, nbytes):
        self.owned = owned
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 2,
                                         "data": (int(ffi.cast("uintptr_t", owned)), False)}


def _sign_in_a_flag(tensor):
    """Whether `tensor` is a conjugate or negative view (z.conj(),
    z.conj().imag): torch keeps the sign of its values in a flag, not in
    memory, and the core reads and writes memory. Such a view is always a
    view, so a tensor with no _base is never one."""
    return tensor.is_conj() or tensor.is_neg()


class TorchTensors(frontend.Tensors):
    """Torch tensors, on the CPU or a CUDA device, for the shared front end."""

    def dtype_key(self, tensor):
        return tensor.dtype

    def dtype_name(self, tensor):
        return str(tensor.dtype)[len("torch."):]

    def check(self, tensor, name):
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError("unison: tensor %s must be a torch.Tensor, got %s"
                                       % (_label(name), type(tensor).__name__))
        if not (tensor.is_cpu or tensor.is_cuda):   # two flags: reading .device.type builds an object per call
            raise UnsupportedError("unison: tensor %s is on %s; unison moves CPU and CUDA tensors"
                                   % (_label(name), tensor.device))
        if tensor.is_nested:
            raise InvalidArgumentError("unison: tensor %s is a nested tensor; pass a dense one (its components, "
                                       "or torch.nested.to_padded_tensor)" % _label(name))
        if tensor.layout != torch.strided:
            raise InvalidArgumentError("unison: tensor %s has layout %s; pass a dense tensor (or use "
                                       "sparse_allreduce_async)" % (_label(name), tensor.layout))

    def placement(self, tensor):
        if not tensor.is_cuda:
            return collective.HOST
        device = tensor.device.index
        return device, ffi.cast("void*", torch.cuda.current_stream(device).cuda_stream)

    def readable(self, tensor):
        if tensor._base is not None and _sign_in_a_flag(tensor):
            return tensor.detach().resolve_conj().resolve_neg().contiguous()
        return tensor.detach().contiguous()

    def shape(self, tensor):
        return tensor.shape

    def pointer(self, tensor):
        return ffi.cast("void*", tensor.data_ptr()) if tensor.numel() else ffi.NULL

    def empty_like(self, tensor):
        return torch.empty_like(tensor)

    def writable(self, tensor, name):
        # Only a non-contiguous tensor costs a copy, and its result is
        # copied back when the op completes. A contiguous one is its own
        # buffer: the core writes it through its pointer, which autograd
        # never sees, so no detached alias is needed.
        if tensor.is_contiguous() and not (tensor._base is not None and _sign_in_a_flag(tensor)):
            return tensor, None
        target = self.readable(tensor)

        def finish(_):
            with torch.no_grad():
                tensor.copy_(target)
            return tensor
        return target, finish

    def in_place(self, tensor, name):
        # A contiguous dense CPU tensor that is no view, every gradient's
        # case, in as few reads of its attributes as it takes; the rest go
        # the general way (views, for _sign_in_a_flag).
        if (type(tensor) is torch.Tensor and tensor.is_cpu and tensor.layout == _STRIDED and tensor._base is None
                and tensor.is_contiguous()):
            pointer = ffi.cast(_VOID_P, tensor.data_ptr()) if tensor.numel() else ffi.NULL
            return tensor, None, tensor.dtype, tensor.shape, pointer, _HOST
        return super().in_place(tensor, name)

    def adopt(self, owned, nbytes, shape, like):
        if nbytes == 0:
            return torch.zeros(shape, dtype=like.dtype, device=like.device)
        if like.is_cuda:
            raw = torch.as_tensor(_DeviceResult(owned, nbytes), device=like.device)  # keeps `owned` alive
            return raw.view(like.dtype).reshape(shape)
        raw = torch.frombuffer(ffi.buffer(owned, nbytes), dtype=torch.uint8)  # keeps `owned` alive
        return raw.view(like.dtype).reshape(shape)


# In-place allreduces (every gradient's) start through the compiled path
# where it builds (fast_path.py): the per-tensor work in C++.
_fast = fast_path.load()
_front = frontend.FrontEnd(TorchTensors(), _fast)


# ---- autograd ------------------------------------------------------------------

class _TorchGradients(gradients.GradientOps):
    """unison.gradients' building blocks, as torch collectives that are
    themselves differentiable (so double backward works)."""

    def grouped_allreduce(self, tensors, op, prescale_factor, postscale_factor, process_set, name):
        return list(_GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set,
                                            *[t.contiguous() for t in tensors]))

    def grouped_allgather(self, tensors, process_set, name):
        return list(_GroupedAllgather.apply(name, process_set, *[t.contiguous() for t in tensors]))

    def alltoall(self, tensor, splits, process_set, name):
        return _Alltoall.apply(tensor.contiguous(), splits, name, process_set)[0]

    def my_rows(self, tensor, process_set, name):
        rows = _synchronize(_front.allgather_async(torch.tensor([tensor.shape[0]], dtype=torch.int64), name,
                                                  process_set))
        return int(rows[:process_set.rank()].sum()), tensor.shape[0]

    def narrow(self, tensor, start, length):
        return tensor.narrow(0, start, length)

    def scale(self, tensor, factor):
        return tensor * factor

    def zeros_like(self, tensor):
        return torch.zeros_like(tensor)


_grads = _TorchGradients()


def remembers_its_caller(forward):
    """For an autograd Function's forward with collectives in its backward:
    notes the thread that ran it, which is, as a rule, the thread that will
    call backward() and wait in it."""
    @functools.wraps(forward)
    def noting(ctx, *args):
        ctx.unison_caller = threading.get_native_id()
        return forward(ctx, *args)
    return noting


def runs_for_its_caller(backward):
    """The backward of such a Function. On a GPU PyTorch runs it on its
    thread for the device while the caller waits in backward(): its
    collectives run as a graph node on the caller's behalf, so that the
    deadlock test counts that thread, and not the device's, as blocked
    (native/caller_activity.h). On the CPU the caller runs it itself."""
    @functools.wraps(backward)
    def on_behalf(ctx, *grads):
        with GraphNode(ctx.unison_caller):
            return backward(ctx, *grads)
    return on_behalf


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    @remembers_its_caller
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.settings = (op, prescale_factor, postscale_factor, process_set)
        return tuple(_synchronize(_front.grouped_allreduce_async(tensors, name, op, prescale_factor,
                                                                postscale_factor, process_set)))

    @staticmethod
    @runs_for_its_caller
    def backward(ctx, *grad_outputs):
        return (None,) * 5 + tuple(gradients.allreduce(_grads, list(grad_outputs), *ctx.settings))


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    @remembers_its_caller
    def forward(ctx, name, process_set, *tensors):
        # The backward reads only the inputs' shapes. Kept as shapes, not
        # saved tensors, which the first backward frees: each output's own
        # backward (g.backward() for each g returned) must work, as in Horovod.
        ctx.process_set = process_set
        ctx.shapes = [t.shape for t in tensors]
        return tuple(_synchronize(_front.grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    @runs_for_its_caller
    def backward(ctx, *grad_outputs):
        inputs = [torch.empty(shape, device="meta") for shape in ctx.shapes]
        return (None, None) + tuple(gradients.allgather(_grads, list(grad_outputs), inputs, ctx.process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    @remembers_its_caller
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _synchronize(_front.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    @runs_for_its_caller
    def backward(ctx, grad_output):
        return gradients.broadcast(_grads, [grad_output], ctx.root_rank, ctx.process_set)[0], None, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    @remembers_its_caller
    def forward(ctx, tensor, splits, name, process_set):
        output, received = _synchronize(_front.alltoall_async(tensor, splits, name, process_set))
        received = torch.tensor(received, dtype=torch.int32)
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    @runs_for_its_caller
    def backward(ctx, grad_output, _unused):
        return gradients.alltoall(_grads, grad_output, ctx.received, ctx.process_set), None, None, None


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    @remembers_its_caller
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.settings = (op, prescale_factor, postscale_factor, process_set)
        return tuple(_synchronize(_front.grouped_reducescatter_async(tensors, name, op, prescale_factor,
                                                                    postscale_factor, process_set)))

    @staticmethod
    @runs_for_its_caller
    def backward(ctx, *grad_outputs):
        return (None,) * 5 + tuple(gradients.reducescatter(_grads, list(grad_outputs), *ctx.settings))


# ---- allreduce ----------------------------------------------------------------

def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts an allreduce of `tensor` into a new tensor; returns a handle."""
    if _compiling():
        return _graph.allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    op = arguments.resolve_op(op, average)
    return _front.allreduce_async(tensor, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Starts an in-place allreduce of `tensor`; returns a handle."""
    if _compiling():
        return _graph.allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                       process_set)
    if op is None or average is not None:  # a gradient's call names its op: no call for it
        op = arguments.resolve_op(op, average)
    if _fast is not None and process_set is global_process_set:  # every gradient's call, in C++
        handle = _fast.allreduce_async_(tensor, name, op, prescale_factor, postscale_factor, 0)
        if handle is not None:
            return handle
    return _front.allreduce_async_(tensor, name, op, prescale_factor, postscale_factor, process_set)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduces `tensor` across the ranks of the process set into a new tensor (Average by
    default, as in Horovod). Differentiable: the gradient is the same reduction of the gradients.

    Args:
        tensor: a CPU or CUDA tensor, the same shape and dtype on every rank.
        average: Horovod's older flag (True: Average, False: Sum); `op` replaces it.
        name: what ranks match this tensor by; where None, one is made in call order, so every
            rank must make its calls in the same order.
        compression: Compression.none or Compression.fp16 (sent as float16, returned in its dtype).
        op: Average, Sum, Min, Max, Product or Adasum.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.
        process_set: the ranks that take part; every rank by default.

    Returns:
        A new tensor holding the result.

    Raises:
        NotInitializedError: init() has not been called.
        MismatchError: ranks gave the same name different shapes, dtypes or arguments (every rank of
            the set gets it, naming the tensor, the ranks and what each sent).
        InvalidArgumentError: an argument this collective cannot take (an op for this dtype, a process
            set this rank is not in), on the rank that gave it.
        RankFailedError: a rank of the set died or stopped answering.
        ShutDownError: a rank shut unison down while the op waited.
    """
    if _compiling():
        return _graph.allreduce(tensor, average, name, compression, op, prescale_factor, postscale_factor,
                                process_set)
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor, postscale_factor,
                             process_set)[0]


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Reduces `tensor` across the process set in place and returns it (Average by
    default). Takes allreduce's arguments."""
    if _compiling():
        return _graph.allreduce_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    op = arguments.resolve_op(op, average)
    return _front.allreduce_(tensor, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """One handle for the allreduce of every tensor in the list; they are
    enqueued together, so the core fuses them."""
    if _compiling():
        return _graph.grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                              process_set)
    op = arguments.resolve_op(op, average)
    return _front.grouped_allreduce_async(tensors, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Starts an in-place allreduce of every tensor in `tensors` as one unit
    (negotiated and fused together) and returns one handle for synchronize()."""
    if _compiling():
        return _graph.grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                               process_set)
    op = arguments.resolve_op(op, average)
    return _front.grouped_allreduce_async(tensors, name, op, prescale_factor, postscale_factor, process_set,
                                          in_place=True)


# The optimizers' reductions of gradients this rank did not compute:
# zeros stand in for them, and the result is None where no rank computed
# one (FrontEnd.allreduce_placeholder_async_). Not Horovod's API.

def placeholder_allreduce_async_(tensor, name, op, prescale_factor, postscale_factor, process_set):
    return _front.allreduce_placeholder_async_(tensor, name, op, prescale_factor, postscale_factor, process_set)


def placeholder_reducescatter_async(tensor, name, op, process_set, splits, output):
    return _front.reducescatter_async(tensor, name, op, 1.0, 1.0, process_set, splits, output, placeholder=True)


def grouped_gradient_allreduce_async_(tensors, name, op, prescale_factor, postscale_factor, process_set,
                                      placeholders):
    return _front.grouped_allreduce_async(tensors, name, op, prescale_factor, postscale_factor, process_set,
                                          in_place=True, placeholders=placeholders)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduces every tensor in `tensors` as one unit: none starts before all are enqueued, and
    they are negotiated and fused together. Takes allreduce's arguments, for the whole list, and
    raises what it raises; if one tensor is refused, none starts. Differentiable.
    """
    if _compiling():
        return _graph.grouped_allreduce(tensors, average, name, compression, op, prescale_factor,
                                        postscale_factor, process_set)
    op = arguments.resolve_op(op, average)
    compressed, contexts = compress_all(compression, tensors)
    reduced = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set, *compressed)
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """Reduces every tensor in `tensors` in place, as one unit, and returns them."""
    if _compiling():
        return _graph.grouped_allreduce_(tensors, average, name, op, prescale_factor, postscale_factor,
                                         process_set)
    return _synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


class _SparseHandle(HandleGroup):
    """Horovod's sparse_allreduce_async returns a callable: calling it waits
    and gives the result. This handle is that, and works with synchronize()."""
    __slots__ = ()

    def __call__(self):
        return _synchronize(self)


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Allreduce of a sparse COO tensor: the ranks' indices and values are
    allgathered and summed where they coincide (averaged for Average)."""
    if op not in (Sum, Average):
        raise UnsupportedError("unison: sparse allreduce supports Sum and Average, got op %s"
                               % arguments.op_name(op))
    sparse = tensor.coalesce()
    indices = _front.allgather_async(sparse.indices().t().contiguous(), name=_member_name(name or "sparse", 0),
                                     process_set=process_set)
    values = _front.allgather_async(sparse.values().contiguous(), name=_member_name(name or "sparse", 1),
                                    process_set=process_set)
    count = process_set.size()

    def finish(results):
        gathered_indices, gathered_values = results
        if op == Average:
            gathered_values = gathered_values / count
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, tensor.shape,
                                       check_invariants=True).coalesce()
    return _SparseHandle([indices, values], finish)


# ---- allgather ----------------------------------------------------------------

def allgather_async(tensor, name=None, process_set=global_process_set, output=None):
    """Starts concatenating every rank's `tensor` along the first dimension
    (which may differ between ranks); returns a handle. With `output` (a
    contiguous tensor of the same dtype with room for every rank's rows),
    the rows land there; `tensor` may be this rank's own rows of it."""
    if _compiling():
        if output is not None:
            _no_output()
        return _graph.allgather_async(tensor, name, process_set)
    return _front.allgather_async(tensor, name, process_set, output)


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenates every rank's `tensor` along the first dimension, in rank order.
    Differentiable: the gradient is this rank's rows of the rank-averaged incoming gradient.

    Args:
        tensor: a tensor whose first dimension may differ between ranks; its other dimensions and
            its dtype must not.
        name: what ranks match this tensor by (see allreduce).
        process_set: the ranks that take part; every rank by default.

    Returns:
        A new tensor of every rank's rows.

    Raises what allreduce raises.
    """
    if _compiling():
        return _graph.allgather(tensor, name, process_set)
    return _GroupedAllgather.apply(name, process_set, tensor)[0]


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Starts an allgather of every tensor in `tensors` as one unit and returns
    a handle whose result is the list of gathered tensors."""
    if _compiling():
        return _graph.grouped_allgather_async(tensors, name, process_set)
    return _front.grouped_allgather_async(tensors, name, process_set)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Each tensor allgathered; enqueued together so they fuse. Differentiable."""
    if _compiling():
        return _graph.grouped_allgather(tensors, name, process_set)
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# ---- broadcast ----------------------------------------------------------------

def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts copying root_rank's `tensor` into a new tensor on every rank."""
    if _compiling():
        return _graph.broadcast_async(tensor, root_rank, name, process_set)
    return _front.broadcast_async(tensor, root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts a broadcast into `tensor` itself from rank `root_rank` (a global rank
    in the process set) and returns a handle for synchronize()."""
    if _compiling():
        return _graph.broadcast_async_(tensor, root_rank, name, process_set)
    return _front.broadcast_async_(tensor, root_rank, name, process_set)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Returns rank `root_rank`'s `tensor` on every rank of the process set, as a new tensor.
    Differentiable: the root gets the rank-averaged gradient, the other ranks zeros, as in Horovod.

    Args:
        tensor: the same shape and dtype on every rank (only the root's values are read).
        root_rank: the global rank that sends; it must be in the process set.
        name: what ranks match this tensor by (see allreduce).
        process_set: the ranks that take part; every rank by default.

    Raises what allreduce raises, and InvalidArgumentError for a root_rank outside the process set.
    """
    if _compiling():
        return _graph.broadcast(tensor, root_rank, name, process_set)
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrites `tensor` with rank `root_rank`'s on every rank of the set, and returns it."""
    if _compiling():
        return _graph.broadcast_(tensor, root_rank, name, process_set)
    return _synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---- alltoall -----------------------------------------------------------------

def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts sending rows splits[i] of `tensor` to rank i. synchronize()
    returns (output, received_splits)."""
    if _compiling():
        return _graph.alltoall_async(tensor, splits, name, process_set)
    handle = _front.alltoall_async(tensor, splits, name, process_set)
    gathered = handle._finish

    def finish(hid):
        output, received = gathered(hid)
        return output, torch.tensor(received, dtype=torch.int32)
    handle._finish = finish
    return handle


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Sends rows `splits[i]` of `tensor` to rank i and concatenates, in rank order, what every
    rank sent here. Differentiable: the gradient goes back by the reverse alltoall.

    Args:
        tensor: the rows to scatter, dtype and trailing dimensions the same on every rank.
        splits: how many rows go to each rank of the set (integers summing to the first dimension);
            where None, the first dimension is split evenly.
        name: what ranks match this tensor by (see allreduce).
        process_set: the ranks that take part; every rank by default.

    Returns:
        The received rows; with `splits`, also a tensor of how many came from each rank.

    Raises what allreduce raises.
    """
    if _compiling():
        return _graph.alltoall(tensor, splits, name, process_set)
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# ---- reducescatter -------------------------------------------------------------

def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0, splits=None, output=None):
    """Starts reducing `tensor` across ranks, this rank keeping its rows of
    the result: the first dimension split as evenly as possible, the first
    ranks taking one more row, or splits[rank] rows where `splits` (the
    same list on every rank) gives each rank's count. With `output` (a
    contiguous tensor of the same dtype with room for them) the rows land
    there instead of in a new tensor."""
    if _compiling():
        if output is not None:
            _no_output()
        return _graph.reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor, splits)
    return _front.reducescatter_async(tensor, name, op, prescale_factor, postscale_factor, process_set, splits,
                                      output)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces `tensor` across the process set and returns this rank's rows of the result: the
    first dimension split as evenly as possible, the first ranks taking one more row when it does
    not divide. Differentiable: the gradient is the allgather of the gradients.

    Args:
        tensor: the same shape and dtype on every rank.
        name: what ranks match this tensor by (see allreduce).
        compression: Compression.none or Compression.fp16.
        op: Average (the default) or Sum.
        process_set: the ranks that take part; every rank by default.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.

    Raises what allreduce raises.
    """
    if _compiling():
        return _graph.reducescatter(tensor, name, compression, op, process_set, prescale_factor,
                                    postscale_factor)
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor,
                                 postscale_factor)[0]


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Starts a reducescatter of every tensor in `tensors` as one unit and
    returns a handle whose result is the list of this rank's parts."""
    if _compiling():
        return _graph.grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor,
                                                  postscale_factor)
    return _front.grouped_reducescatter_async(tensors, name, op, prescale_factor, postscale_factor,
                                              process_set)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Each tensor reduce-scattered; enqueued together so they fuse. Differentiable."""
    if _compiling():
        return _graph.grouped_reducescatter(tensors, name, compression, op, process_set, prescale_factor,
                                            postscale_factor)
    compressed, contexts = compress_all(compression, tensors)
    reduced = _GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor, process_set, *compressed)
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


# ---- barrier and join -----------------------------------------------------------

def barrier(process_set=global_process_set):
    """Returns once every rank of the process set has called barrier().

    Raises:
        RankFailedError: a rank of the set died or stopped answering.
        ShutDownError: a rank shut unison down while this one waited.
    """
    if _compiling():
        return _graph.barrier(process_set)
    collective.barrier(process_set)


def join(device=-1):
    """Declares that this rank has no more data. Until every rank has joined, it takes part in the
    others' allreduces with zeros (Average still divides by the full size), and their allgathers,
    broadcasts, alltoalls and reducescatters fail with a MismatchError naming the joined ranks.

    Args:
        device: Horovod's argument, accepted and unused.

    Returns:
        The rank that joined last, the same on every rank.
    """
    return collective.join()


def synchronize(handle):
    """Waits for the op that `handle` (from an `_async` call) stands for and returns its
    result: a tensor, a list for a grouped call, (output, splits) for an alltoall with splits.

    Raises:
        UnisonError: the op's own error (see allreduce), once; the handle is then spent.
    """
    if _compiling():
        return _graph.synchronize(handle)
    return _synchronize(handle)


def _no_output():
    # Reached only while Dynamo traces, so the error names torch.compile.
    raise UnsupportedError("unison: under torch.compile, allgather_async and reducescatter_async take no output "
                           "(a compiled node's result is a tensor of its own); call them outside the compiled "
                           "function, or copy the result into your tensor")


from unison.torch import graph_ops as _graph  # noqa: E402  (graph_ops' operators call this module's front end)
