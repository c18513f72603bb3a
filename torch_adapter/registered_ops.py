"""unison's collectives as torch operators, in the `unison::` namespace.

torch.compile traces operators, not Python: a collective that is a
registered operator is one node of the compiled graph. Dynamo and
AOTAutograd learn its result's shape and dtype from the fake kernel here
and never look inside; the real kernel runs when the compiled program
reaches the node.

Order. Every operator takes a sequence tensor first and returns the next
one last (a new one-byte tensor, whose value means nothing). graph_ops
passes each collective the one its predecessor returned, so to the
compiler each collective depends on the one before it: the compiled
program runs them in the order the program called them, on every rank,
which the core's negotiation needs, and none is dropped for an unused
result, because the last sequence is a result of the graph. An ordered
effect (torch.library's register_effect) says the same in words, but
Inductor's reordering for peak memory did not keep it (torch 2.13: a
reducescatter ran ahead of the allreduce, allgather and broadcast called
before it); a data dependency every pass keeps. An operator that declared
it wrote the sequence would do as well, but could have no autograd formula.

The real kernels are the Python API's own front end (ops.py), so an
operator checks, names and fails exactly as `hvd.allreduce` does; they
can be called eagerly too (graph_ops' functions do that outside
torch.compile). Process sets are passed by id and reduction ops by their
code: an operator's schema holds numbers, strings and tensors only.

Gradients are unison.gradients' (Horovod's definitions). Where the
gradient's shape is one a fake kernel could not know from a plain
collective (allgather's rows of this rank, alltoall's rows sent back), the
backward is an operator of its own whose fake kernel gives the input's
shape, and whose real kernel is the eager Python API's backward. A
backward formula's collectives are ordered by autograd's graph, the same
on every rank, and each is given a sequence of its own.
"""
from typing import Optional

import torch

from unison import arguments, basics, gradients, process_sets
from unison.exceptions import InvalidArgumentError
from unison.torch import ops as _eager

Tensor = torch.Tensor


def _set(process_set_id):
    # int(): in a fake kernel the id may be a symbolic int (Dynamo makes an
    # int argument that changed between compiles symbolic), which has no
    # hash; int() of it pins the graph to this set.
    return process_sets.find(int(process_set_id))


def new_sequence():
    """A sequence tensor: the first in a program, the next one after each
    collective, and a fresh one for each collective of a backward formula."""
    return torch.zeros((), dtype=torch.int8)


def _fake_sequence():
    return torch.empty((), dtype=torch.int8)


def _contiguous_like(tensor):
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _rows_like(tensor, rows):
    if rows is None or rows < 0:   # known only when the collective has run
        rows = torch.library.get_ctx().new_dynamic_size()
    return tensor.new_empty((rows,) + tuple(tensor.shape[1:]))


# ---- allreduce ------------------------------------------------------------------

@torch.library.custom_op("unison::allreduce", mutates_args=())
def allreduce(sequence: Tensor, tensor: Tensor, name: Optional[str], op: int, prescale_factor: float,
              postscale_factor: float, process_set: int) -> tuple[Tensor, Tensor]:
    result = _eager._synchronize(_eager._front.allreduce_async(tensor, name, op, prescale_factor, postscale_factor,
                                                               _set(process_set)))
    return result, new_sequence()


@allreduce.register_fake
def _(sequence, tensor, name, op, prescale_factor, postscale_factor, process_set):
    return _contiguous_like(tensor), _fake_sequence()


@torch.library.custom_op("unison::allreduce_", mutates_args=("tensor",))
def allreduce_(sequence: Tensor, tensor: Tensor, name: Optional[str], op: int, prescale_factor: float,
               postscale_factor: float, process_set: int) -> Tensor:
    _eager._front.allreduce_(tensor, name, op, prescale_factor, postscale_factor, _set(process_set))
    return new_sequence()


@allreduce_.register_fake
def _(sequence, tensor, name, op, prescale_factor, postscale_factor, process_set):
    return _fake_sequence()


@torch.library.custom_op("unison::grouped_allreduce", mutates_args=())
def grouped_allreduce(sequence: Tensor, tensors: list[Tensor], name: Optional[str], op: int, prescale_factor: float,
                      postscale_factor: float, process_set: int) -> list[Tensor]:
    """The reduced tensors, then the next sequence."""
    results = list(_eager._synchronize(_eager._front.grouped_allreduce_async(
        tensors, name, op, prescale_factor, postscale_factor, _set(process_set))))
    return results + [new_sequence()]


@grouped_allreduce.register_fake
def _(sequence, tensors, name, op, prescale_factor, postscale_factor, process_set):
    return [_contiguous_like(t) for t in tensors] + [_fake_sequence()]


def _allreduce_settings(ctx, inputs, output):
    ctx.settings = inputs[2:]
    ctx.like = list(output[:-1] if isinstance(output, list) else output[:1])


def _allreduce_backward(ctx, grad, _sequence):
    name, op, prescale_factor, postscale_factor, process_set = ctx.settings
    gradients.check_differentiable(op, "allreduce")
    reduced, _ = torch.ops.unison.allreduce(new_sequence(), grad, gradients.grad_name(name), op, prescale_factor,
                                            postscale_factor, process_set)
    return (None, reduced) + (None,) * 5


def _grouped_allreduce_backward(ctx, grads):
    name, op, prescale_factor, postscale_factor, process_set = ctx.settings
    gradients.check_differentiable(op, "allreduce")
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads[:-1], ctx.like)]
    reduced = torch.ops.unison.grouped_allreduce(new_sequence(), grads, gradients.grad_name(name), op, prescale_factor,
                                                 postscale_factor, process_set)
    return (None, reduced[:-1]) + (None,) * 5


allreduce.register_autograd(_allreduce_backward, setup_context=_allreduce_settings)
grouped_allreduce.register_autograd(_grouped_allreduce_backward, setup_context=_allreduce_settings)


# ---- started collectives and the wait on them ----------------------------------------

# Started collectives: handle id -> the Python API's handle, which holds
# the tensors the core reads and writes until the wait. The compiled graph
# carries the id as a one-number tensor from the start to the wait, and the
# result stays out of the graph until the wait hands it out: a graph node's
# output must not be written afterwards, and an operator's output may not
# alias its input. (An operator that wrote its input would be given a copy
# under torch.compile's functionalization, written after it returned.)
_started = {}


def _handle_and_next(handle):
    _started[handle.id] = handle
    return torch.tensor(handle.id, dtype=torch.int64), new_sequence()


def _fake_handle_and_next(*_args):
    return torch.empty((), dtype=torch.int64), _fake_sequence()


def _finish(handle_tensor):
    handle_id = int(handle_tensor)
    if handle_id not in _started:
        raise InvalidArgumentError("unison: wait on handle %d, which no started collective has (waited twice?)"
                                   % handle_id)
    return _eager._synchronize(_started.pop(handle_id))


@torch.library.custom_op("unison::allreduce_start", mutates_args=())
def allreduce_start(sequence: Tensor, tensor: Tensor, name: Optional[str], op: int, prescale_factor: float,
                    postscale_factor: float, process_set: int) -> tuple[Tensor, Tensor]:
    """Starts an allreduce of `tensor` into a new tensor; returns the
    handle, for unison::wait, at once (and the next sequence)."""
    result = tensor.contiguous().clone()
    return _handle_and_next(_eager._front.allreduce_async_(result, name, op, prescale_factor, postscale_factor,
                                                           _set(process_set)))


@torch.library.custom_op("unison::allgather_start", mutates_args=())
def allgather_start(sequence: Tensor, tensor: Tensor, name: Optional[str], process_set: int) -> tuple[Tensor, Tensor]:
    return _handle_and_next(_eager._front.allgather_async(tensor, name, _set(process_set)))


@torch.library.custom_op("unison::broadcast_start", mutates_args=())
def broadcast_start(sequence: Tensor, tensor: Tensor, root_rank: int, name: Optional[str],
                    process_set: int) -> tuple[Tensor, Tensor]:
    return _handle_and_next(_eager._front.broadcast_async(tensor, root_rank, name, _set(process_set)))


@torch.library.custom_op("unison::alltoall_start", mutates_args=())
def alltoall_start(sequence: Tensor, tensor: Tensor, splits: Optional[list[int]], name: Optional[str],
                   process_set: int) -> tuple[Tensor, Tensor]:
    return _handle_and_next(_eager._front.alltoall_async(tensor, splits, name, _set(process_set)))


@torch.library.custom_op("unison::reducescatter_start", mutates_args=())
def reducescatter_start(sequence: Tensor, tensor: Tensor, name: Optional[str], op: int, prescale_factor: float,
                        postscale_factor: float, process_set: int, splits: Optional[list[int]] = None
                        ) -> tuple[Tensor, Tensor]:
    return _handle_and_next(_eager._front.reducescatter_async(tensor, name, op, prescale_factor, postscale_factor,
                                                              _set(process_set), splits))


for _start in (allreduce_start, allgather_start, broadcast_start, alltoall_start, reducescatter_start):
    _start.register_fake(_fake_handle_and_next)


@torch.library.custom_op("unison::wait", mutates_args=())
def wait(sequence: Tensor, handle: Tensor, like: Tensor, rows: Optional[int]) -> tuple[Tensor, Tensor]:
    """Waits for the started collective `handle` names and returns its
    result, or raises its error. The result is shaped as `like` (the
    tensor it started from), or with `rows` rows where given (-1: as many
    as the collective brought, allgather's)."""
    return _finish(handle), new_sequence()


@wait.register_fake
def _(sequence, handle, like, rows):
    return (_contiguous_like(like) if rows is None else _rows_like(like, rows)), _fake_sequence()


@torch.library.custom_op("unison::wait_alltoall", mutates_args=())
def wait_alltoall(sequence: Tensor, handle: Tensor, like: Tensor, process_set: int) -> tuple[Tensor, Tensor, Tensor]:
    """unison::wait for an alltoall: its output, the rows each rank sent here."""
    output, received = _finish(handle)
    return output, torch.tensor(received, dtype=torch.int32), new_sequence()


@wait_alltoall.register_fake
def _(sequence, handle, like, process_set):
    return (_rows_like(like, None), torch.empty((_set(process_set).size(),), dtype=torch.int32),
            _fake_sequence())


# ---- allgather -------------------------------------------------------------------

@torch.library.custom_op("unison::allgather", mutates_args=())
def allgather(sequence: Tensor, tensor: Tensor, name: Optional[str], process_set: int) -> tuple[Tensor, Tensor]:
    return (_eager._synchronize(_eager._front.allgather_async(tensor, name, _set(process_set))),
            new_sequence())


@allgather.register_fake
def _(sequence, tensor, name, process_set):
    # The ranks' first dimensions may differ: the total is known only when
    # the collective has run.
    return _rows_like(tensor, None), _fake_sequence()


@torch.library.custom_op("unison::allgather_backward", mutates_args=())
def allgather_backward(sequence: Tensor, grad: Tensor, rows: int, name: Optional[str],
                       process_set: int) -> tuple[Tensor, Tensor]:
    inputs = [torch.empty((rows,) + tuple(grad.shape[1:]), device="meta")]
    mine = gradients.allgather(_eager._grads, [grad.contiguous()], inputs, _set(process_set), name)[0]
    return mine.contiguous(), new_sequence()


@allgather_backward.register_fake
def _(sequence, grad, rows, name, process_set):
    return _rows_like(grad, rows), _fake_sequence()


def _allgather_settings(ctx, inputs, output):
    _, tensor, ctx.name, ctx.process_set = inputs
    ctx.rows = tensor.shape[0]


def _allgather_grad(ctx, grad, _sequence):
    mine, _ = torch.ops.unison.allgather_backward(new_sequence(), grad, ctx.rows, ctx.name, ctx.process_set)
    return None, mine, None, None


allgather.register_autograd(_allgather_grad, setup_context=_allgather_settings)


# ---- broadcast -------------------------------------------------------------------

@torch.library.custom_op("unison::broadcast", mutates_args=())
def broadcast(sequence: Tensor, tensor: Tensor, root_rank: int, name: Optional[str],
              process_set: int) -> tuple[Tensor, Tensor]:
    return (_eager._synchronize(_eager._front.broadcast_async(tensor, root_rank, name, _set(process_set))),
            new_sequence())


@broadcast.register_fake
def _(sequence, tensor, root_rank, name, process_set):
    return _contiguous_like(tensor), _fake_sequence()


@torch.library.custom_op("unison::broadcast_", mutates_args=("tensor",))
def broadcast_(sequence: Tensor, tensor: Tensor, root_rank: int, name: Optional[str], process_set: int) -> Tensor:
    _eager._synchronize(_eager._front.broadcast_async_(tensor, root_rank, name, _set(process_set)))
    return new_sequence()


@broadcast_.register_fake
def _(sequence, tensor, root_rank, name, process_set):
    return _fake_sequence()


def _broadcast_settings(ctx, inputs, output):
    _, _, ctx.root_rank, ctx.name, ctx.process_set = inputs


def _broadcast_grad(ctx, grad, _sequence):
    averaged, _ = torch.ops.unison.allreduce(new_sequence(), grad, gradients.grad_name(ctx.name), basics.Average, 1.0,
                                             1.0, ctx.process_set)
    if basics.rank() != ctx.root_rank:   # roots are global ranks, in a process set too
        averaged = torch.zeros_like(averaged)
    return None, averaged, None, None, None


broadcast.register_autograd(_broadcast_grad, setup_context=_broadcast_settings)


# ---- alltoall --------------------------------------------------------------------

@torch.library.custom_op("unison::alltoall", mutates_args=())
def alltoall(sequence: Tensor, tensor: Tensor, splits: Optional[list[int]], name: Optional[str],
             process_set: int) -> tuple[Tensor, Tensor, Tensor]:
    """The rows this rank received, how many each rank sent, the next sequence."""
    output, received = _eager._synchronize(_eager._front.alltoall_async(tensor, splits, name, _set(process_set)))
    return output, torch.tensor(received, dtype=torch.int32), new_sequence()


@alltoall.register_fake
def _(sequence, tensor, splits, name, process_set):
    return (_rows_like(tensor, None), torch.empty((_set(process_set).size(),), dtype=torch.int32),
            _fake_sequence())


@torch.library.custom_op("unison::alltoall_backward", mutates_args=())
def alltoall_backward(sequence: Tensor, grad: Tensor, received: Tensor, rows: int, name: Optional[str],
                      process_set: int) -> tuple[Tensor, Tensor]:
    sent_back = gradients.alltoall(_eager._grads, grad.contiguous(), received, _set(process_set), name)
    return sent_back.contiguous(), new_sequence()


@alltoall_backward.register_fake
def _(sequence, grad, received, rows, name, process_set):
    return _rows_like(grad, rows), _fake_sequence()


def _alltoall_settings(ctx, inputs, output):
    _, tensor, _, ctx.name, ctx.process_set = inputs
    ctx.rows = tensor.shape[0]
    ctx.save_for_backward(output[1])


def _alltoall_grad(ctx, grad, _received, _sequence):
    received, = ctx.saved_tensors
    sent_back, _ = torch.ops.unison.alltoall_backward(new_sequence(), grad, received, ctx.rows, ctx.name,
                                                      ctx.process_set)
    return None, sent_back, None, None, None


alltoall.register_autograd(_alltoall_grad, setup_context=_alltoall_settings)


# ---- reducescatter ---------------------------------------------------------------

@torch.library.custom_op("unison::reducescatter", mutates_args=())
def reducescatter(sequence: Tensor, tensor: Tensor, name: Optional[str], op: int, prescale_factor: float,
                  postscale_factor: float, process_set: int, splits: Optional[list[int]] = None
                  ) -> tuple[Tensor, Tensor]:
    result = _eager._synchronize(_eager._front.reducescatter_async(tensor, name, op, prescale_factor,
                                                                   postscale_factor, _set(process_set), splits))
    return result, new_sequence()


@reducescatter.register_fake
def _(sequence, tensor, name, op, prescale_factor, postscale_factor, process_set, splits=None):
    members = _set(process_set)
    if splits is not None and len(splits) == members.size():
        rows = int(splits[members.rank()])
    else:   # a scalar, refused by the real kernel naming the tensor, has none
        rows = arguments.scatter_rows(tensor.shape[0] if tensor.dim() else 0, members.size(), members.rank())
    return _rows_like(tensor, rows), _fake_sequence()


@torch.library.custom_op("unison::reducescatter_backward", mutates_args=())
def reducescatter_backward(sequence: Tensor, grad: Tensor, rows: int, name: Optional[str], op: int,
                           prescale_factor: float, postscale_factor: float, process_set: int) -> tuple[Tensor, Tensor]:
    gathered = gradients.reducescatter(_eager._grads, [grad.contiguous()], op, prescale_factor, postscale_factor,
                                       _set(process_set), name)[0]
    return gathered.contiguous(), new_sequence()


@reducescatter_backward.register_fake
def _(sequence, grad, rows, name, op, prescale_factor, postscale_factor, process_set):
    return _rows_like(grad, rows), _fake_sequence()


def _reducescatter_settings(ctx, inputs, output):
    ctx.rows = inputs[1].shape[0]
    ctx.settings = inputs[2:7]


def _reducescatter_grad(ctx, grad, _sequence):
    name, op, prescale_factor, postscale_factor, process_set = ctx.settings
    gathered, _ = torch.ops.unison.reducescatter_backward(new_sequence(), grad, ctx.rows, name, op, prescale_factor,
                                                          postscale_factor, process_set)
    return (None, gathered) + (None,) * 6


reducescatter.register_autograd(_reducescatter_grad, setup_context=_reducescatter_settings)


# ---- barrier ----------------------------------------------------------------------

@torch.library.custom_op("unison::barrier", mutates_args=())
def barrier(sequence: Tensor, process_set: int) -> Tensor:
    _eager.barrier(_set(process_set))
    return new_sequence()


@barrier.register_fake
def _(sequence, process_set):
    return _fake_sequence()
