"""DistributedOptimizer and DistributedTrainer: Horovod's MXNet wrappers.

Both average gradients the cheap way: the reduction is a Sum (with
prescale 1/gradient_predivide_factor), and the division by the number of
ranks is folded into the optimizer's own gradient rescaling, which it
applies anyway. The allreduces are pushed to MXNet's engine without waiting
(ops.py), so each starts as soon as backward has written its gradient;
then they are waited on together, so that a failure is raised here.
"""
import warnings

import mxnet as mx

from unison.arguments import split_into_groups
from unison.compression import check_compressor
from unison.process_sets import global_process_set
from unison.mxnet.compression import Compression
from unison.mxnet.ops import Sum, _all_waited, _allreduce_async


def _allreduce_gradients(named_grads, gradient_predivide_factor, num_groups, process_set,
                         compression=Compression.none):
    """Sums each (name, gradient, priority) across ranks in place. With
    num_groups > 0 the gradients are named as members of that many groups;
    the core fuses whatever is ready together either way. A compressor
    that returns a new array (fp16) has that array reduced and the result
    written back into the gradient."""
    if num_groups > 0:
        renamed = []
        for g, group in enumerate(split_into_groups(named_grads, num_groups)):
            renamed += [("group.%d.%s" % (g, name), grad, priority) for name, grad, priority in group]
        named_grads = renamed
    sent = [(grad,) + compression.compress(grad) for _, grad, _ in named_grads]
    # settle=False: the allreduces are pushed while backward still runs, each
    # to start as soon as its gradient is written (see unison.mxnet.engine).
    with _all_waited() as ops:
        for (name, _, priority), (_, wire, _) in zip(named_grads, sent):
            ops.append(_allreduce_async(wire, wire, name, Sum, 1.0 / gradient_predivide_factor, 1.0, process_set,
                                        priority, settle=False))
    for grad, wire, ctx in sent:
        if wire is not grad:
            grad[:] = compression.decompress(wire, ctx)


def _averages_on_this_rank(process_set):
    """A rank outside the wrapper's process set is a plain local optimizer,
    as in Horovod: a script builds one on every rank and steps it
    everywhere. (Horovod's DistributedTrainer still divides such a rank's
    gradients by the set's size; here they are left as one process would
    have them.)"""
    return process_set.included()


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wraps an mx.optimizer.Optimizer: update() and update_multi_precision()
    first sum the gradients across ranks; the wrapped optimizer's
    rescale_grad carries the 1/size() of the average."""

    def __init__(self, optimizer, gradient_predivide_factor=1.0, num_groups=0,
                 process_set=global_process_set):
        # Not calling Optimizer.__init__: every setting lives on the wrapped
        # optimizer, and __getattr__ forwards to it.
        self._optimizer = optimizer
        self._gradient_predivide_factor = gradient_predivide_factor
        self._num_groups = num_groups
        self._process_set = process_set
        if _averages_on_this_rank(process_set):
            self._optimizer.rescale_grad *= gradient_predivide_factor / process_set.size()

    def __getattr__(self, item):
        return getattr(self.__dict__["_optimizer"], item)

    def __setattr__(self, key, value):
        # Settings go to the wrapped optimizer, which is the one that uses
        # them: gluon.Trainer.step() sets rescale_grad, and must reach it.
        if key.startswith("_"):
            object.__setattr__(self, key, value)
        else:
            setattr(self._optimizer, key, value)

    def create_state(self, index, weight):
        """The wrapped optimizer's state for weight `index`, as it makes it."""
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        """The wrapped optimizer's multi-precision state for weight `index`."""
        return self._optimizer.create_state_multi_precision(index, weight)

    def _reduce(self, index, grad):
        if self._process_set.size() == 1 or not _averages_on_this_rank(self._process_set):
            return
        if isinstance(index, (tuple, list)):
            named = [("optimizer.%s" % i, g, -n) for n, (i, g) in enumerate(zip(index, grad))]
        else:
            named = [("optimizer.%s" % index, grad, 0)]
        _allreduce_gradients(named, self._gradient_predivide_factor, self._num_groups, self._process_set)

    def update(self, index, weight, grad, state):
        """Sums the gradient over the process set's ranks (then divides as the wrapper was told), then
        lets the wrapped optimizer update the weight."""
        self._reduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        """As update(), for the wrapped optimizer's multi-precision update."""
        self._reduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr):
        """Sets the wrapped optimizer's learning rate."""
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult):
        """Sets the wrapped optimizer's per-parameter learning-rate multipliers."""
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        """Sets the wrapped optimizer's per-parameter weight-decay multipliers."""
        self._optimizer.set_wd_mult(args_wd_mult)


class DistributedTrainer(mx.gluon.Trainer):
    """A gluon.Trainer that sums gradients across ranks before each update
    (kvstore=None: unison replaces the kvstore), in Horovod's argument order.

    Args:
        params: the parameters to train (a ParameterDict, as `net.collect_params()` gives).
        optimizer: an optimizer's name or an mx.optimizer.Optimizer, as gluon.Trainer takes.
        optimizer_params: the optimizer's settings, as gluon.Trainer takes.
        compression: what the gradients travel as: Compression.none or Compression.fp16.
        gradient_predivide_factor: divides the gradients by this before the sum and by
            size / this after it.
        prefix: keeps the collectives of two trainers in one program apart.
        num_groups: how many fused groups the gradients are allreduced in (0: as the core fuses).
        process_set: the ranks that average; on a rank outside it, a plain local trainer."""

    def __init__(self, params, optimizer, optimizer_params=None, compression=Compression.none,
                 gradient_predivide_factor=1.0, prefix=None, num_groups=0, process_set=global_process_set):
        check_compressor(compression, "DistributedTrainer")
        if isinstance(optimizer, DistributedOptimizer):
            warnings.warn("DistributedTrainer reduces gradients itself; it was given a DistributedOptimizer "
                          "and uses the optimizer inside it instead")
            wrapper, optimizer = optimizer, optimizer._optimizer
            # Undo the wrapper's share of the averaging: this trainer applies its own.
            if _averages_on_this_rank(wrapper._process_set):
                optimizer.rescale_grad /= wrapper._gradient_predivide_factor / wrapper._process_set.size()
        # Gradients are matched across ranks by their place in this list. A
        # ParameterDict (or dict) keeps the network's registration order,
        # the same on every rank even where Gluon's per-process name counter
        # gave a rank other keys; a list is sorted by name, as Horovod does.
        if isinstance(params, (dict, mx.gluon.ParameterDict)):
            params = list(params.values())
        else:
            params = sorted(params, key=lambda p: p.name)
        self._compression = compression
        self._gradient_predivide_factor = gradient_predivide_factor
        self._process_set = process_set
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._prefix = prefix or ""
        self._num_groups = num_groups

    # Trainer.step() sets the optimizer's rescale_grad from _scale. Read at
    # each step, so that it follows the size of an elastic job.
    @property
    def _scale(self):
        if not _averages_on_this_rank(self._process_set):
            return self._unscaled
        return self._unscaled * self._gradient_predivide_factor / self._process_set.size()

    @_scale.setter
    def _scale(self, value):
        self._unscaled = value

    def _allreduce_grads(self):
        if self._process_set.size() == 1 or not _averages_on_this_rank(self._process_set):
            return
        trainable = [(i, p) for i, p in enumerate(self._params) if p.grad_req != "null"]
        if self._num_groups > 0:
            # Gradients of one dtype fuse; group within each dtype.
            by_dtype = {}
            for i, p in trainable:
                by_dtype.setdefault(p.list_grad()[0].dtype, []).append((i, p))
            trainable = [item for dtype in sorted(by_dtype, key=str) for item in by_dtype[dtype]]
        named = [("%strainer.%d" % (self._prefix, i), p.list_grad()[0], -i) for i, p in trainable]
        _allreduce_gradients(named, self._gradient_predivide_factor, self._num_groups, self._process_set,
                             self._compression)
