"""The gradients of the collectives, defined once, as Horovod defines them.

torch's autograd functions and TensorFlow's custom gradients both call
these, each passing a `GradientOps` that runs collectives and a few tensor
operations in its framework (in TensorFlow possibly as graph nodes). Lists
go in and out, so a grouped op's gradients stay one grouped op and fuse.

- allreduce: the same allreduce (op and factors) of the gradients. Sum and
  Average are linear, so this is their gradient when each rank's loss is
  summed; Min, Max and Product have no such rule, and a wrong gradient is
  worse than none, so they raise.
- allgather: this rank's rows of the rank-averaged gradient.
- broadcast: the rank-averaged gradient on the root, zero elsewhere.
- alltoall: the gradient sent back along the splits each rank received.
- reducescatter: the allgather of the gradients, times the set's size for
  Sum, times the prescale and postscale factors.
"""
from unison import basics
from unison.arguments import Adasum, Average, Sum, op_name
from unison.exceptions import UnsupportedError


class GradientOps:
    """What the definitions need from a framework."""

    # `name` is the forward op's name with ".grad" added (None when the
    # forward op had none): the core's name for the gradient's collective.
    def grouped_allreduce(self, tensors, op, prescale_factor, postscale_factor, process_set, name):
        raise NotImplementedError

    def grouped_allgather(self, tensors, process_set, name):
        raise NotImplementedError

    def alltoall(self, tensor, splits, process_set, name):
        raise NotImplementedError

    def my_rows(self, tensor, process_set, name):
        """(first row of this rank's part, its row count) in an allgather of
        `tensor` over the set."""
        raise NotImplementedError

    def narrow(self, tensor, start, length):
        raise NotImplementedError

    def scale(self, tensor, factor):
        raise NotImplementedError

    def zeros_like(self, tensor):
        raise NotImplementedError


def check_differentiable(op, collective):
    """Raises unless `op`'s reduction has a gradient (Sum, Average, Adasum)."""
    if op not in (Sum, Average, Adasum):
        raise UnsupportedError("unison: the gradient of %s is defined for Sum, Average and Adasum; got %s"
                               % (collective, op_name(op)))


def grad_name(name):
    """The name of the gradient's collective: None stays None."""
    return None if name is None else name + ".grad"


def allreduce(ops, grads, op, prescale_factor, postscale_factor, process_set, name=None):
    check_differentiable(op, "allreduce")
    return ops.grouped_allreduce(grads, op, prescale_factor, postscale_factor, process_set, grad_name(name))


def allgather(ops, grads, inputs, process_set, name=None):
    averaged = ops.grouped_allreduce(grads, Average, 1.0, 1.0, process_set, grad_name(name))
    out = []
    for i, (g, x) in enumerate(zip(averaged, inputs)):
        start, rows = ops.my_rows(x, process_set, None if name is None else "%s.grad.rows.%d" % (name, i))
        out.append(ops.narrow(g, start, rows))
    return out


def broadcast(ops, grads, root_rank, process_set, name=None):
    averaged = ops.grouped_allreduce(grads, Average, 1.0, 1.0, process_set, grad_name(name))
    if basics.rank() == root_rank:  # roots are global ranks, in a process set too
        return averaged
    return [ops.zeros_like(g) for g in averaged]


def alltoall(ops, grad, received_splits, process_set, name=None):
    return ops.alltoall(grad, received_splits, process_set, grad_name(name))


def reducescatter(ops, grads, op, prescale_factor, postscale_factor, process_set, name=None):
    check_differentiable(op, "reducescatter")
    if op == Adasum:
        raise UnsupportedError("unison: reducescatter does not take Adasum")
    gathered = ops.grouped_allgather(grads, process_set, grad_name(name))
    factor = prescale_factor * postscale_factor * (process_set.size() if op == Sum else 1)
    return gathered if factor == 1.0 else [ops.scale(g, factor) for g in gathered]
