"""SyncBatchNorm: batch normalisation whose batch statistics are those of
the whole global batch, every rank's shard together.

Forward: each rank reduces its shard to (count, mean, sum of squared
deviations) per channel; one allgather brings every rank's triple, and the
triples are merged with the pairwise-update formula (Chan et al.), which
stays accurate where sum-of-squares minus square-of-sum would cancel. Ranks
may hold different batch sizes, an empty one included.

Backward: the input gradient of batch norm needs two channel sums over the
global batch (of dy*w and of dy*w*(x - mean)); one allreduce brings them.
The weight and bias gradients are left as this rank's sums, as for any
other parameter: the optimizer's gradient averaging makes them global.
"""
from typing import Optional

import torch

from unison import basics
from unison import process_sets
from unison.process_sets import global_process_set
from unison.torch import graph_ops, registered_ops
from unison.torch.ops import Sum, allgather, allreduce, remembers_its_caller, runs_for_its_caller


def _channel_view(t, ndim):
    """A per-channel vector shaped to broadcast against an (N, C, ...) input."""
    return t.view((1, -1) + (1,) * (ndim - 2))


def _stats_dtype(x):
    # Statistics in float32 at least: a float16 sum over a large batch overflows.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _statistics(x, weight, bias, eps, process_set, name):
    """(y, global mean, global variance, global count, x_hat, invstd) of
    a training-mode forward over every rank's batch; over this rank's
    alone where process_set is None (a job of one rank, or before init)."""
    dims = [0] + list(range(2, x.dim()))
    stats_dtype = _stats_dtype(x)
    xs = x.to(stats_dtype)
    count = x.numel() // x.size(1)
    if count:
        mean = xs.mean(dims)
        m2 = (xs - _channel_view(mean, x.dim())).square().sum(dims)
    else:
        mean = xs.new_zeros(x.size(1))
        m2 = xs.new_zeros(x.size(1))
    mine = torch.cat([xs.new_tensor([float(count)]), mean, m2]).unsqueeze(0)
    every = mine if process_set is None else allgather(mine, name=name + ".stats" if name else None,
                                                       process_set=process_set)
    counts, means, m2s = every[:, :1], every[:, 1:1 + x.size(1)], every[:, 1 + x.size(1):]
    total = counts.sum()
    if total.item() == 0:
        raise ValueError("unison.SyncBatchNorm: every rank's batch is empty")
    global_mean = (counts * means).sum(0) / total
    global_m2 = (m2s + counts * (means - global_mean).square()).sum(0)
    var = global_m2 / total
    invstd = torch.rsqrt(var + eps)

    x_hat = (xs - _channel_view(global_mean, x.dim())) * _channel_view(invstd, x.dim())
    y = x_hat
    if weight is not None:
        y = y * _channel_view(weight.to(stats_dtype), x.dim())
    if bias is not None:
        y = y + _channel_view(bias.to(stats_dtype), x.dim())
    return y.to(x.dtype), global_mean, var, total, x_hat, invstd


def _input_gradient(grad_y, x_hat, weight, invstd, total, process_set, name, x_dtype):
    """(grad_x, this rank's grad_weight sum, this rank's grad_bias sum), the
    last two in x_hat's dtype; this rank's batch alone where process_set is
    None, as in _statistics."""
    dims = [0] + list(range(2, x_hat.dim()))
    dy = grad_y.to(x_hat.dtype)
    local_dy = dy.sum(dims)
    local_dy_xhat = (dy * x_hat).sum(dims)
    sums = torch.stack([local_dy, local_dy_xhat])
    if process_set is not None:
        sums = allreduce(sums, op=Sum, name=name + ".grad" if name else None, process_set=process_set)
    mean_dy = _channel_view(sums[0] / total, x_hat.dim())
    mean_dy_xhat = _channel_view(sums[1] / total, x_hat.dim())
    scale = invstd if weight is None else invstd * weight.to(x_hat.dtype)
    grad_x = _channel_view(scale, x_hat.dim()) * (dy - mean_dy - x_hat * mean_dy_xhat)
    return grad_x.to(x_dtype), local_dy_xhat, local_dy


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    @remembers_its_caller
    def forward(ctx, x, weight, bias, eps, process_set, name):
        y, global_mean, var, total, x_hat, invstd = _statistics(x, weight, bias, eps, process_set, name)
        ctx.save_for_backward(x_hat, weight, invstd)
        ctx.mark_non_differentiable(global_mean, var, total)
        ctx.settings = (total, process_set, name, weight is not None, bias is not None, x.dtype)
        return y, global_mean, var, total

    @staticmethod
    @runs_for_its_caller
    def backward(ctx, grad_y, _grad_mean, _grad_var, _grad_total):
        x_hat, weight, invstd = ctx.saved_tensors
        total, process_set, name, has_weight, has_bias, x_dtype = ctx.settings
        grad_x, local_dy_xhat, local_dy = _input_gradient(grad_y, x_hat, weight, invstd, total, process_set,
                                                          name, x_dtype)
        grad_weight = local_dy_xhat.to(weight.dtype) if has_weight else None
        grad_bias = local_dy.to(weight.dtype if has_weight else x_dtype) if has_bias else None
        return grad_x, grad_weight, grad_bias, None, None, None


# ---- the same, as a torch operator for torch.compile (registered_ops.py says why;
# its first argument and last result keep it in order with the collectives) ----

Tensor = torch.Tensor


@torch.library.custom_op("unison::sync_batch_norm", mutates_args=())
def _sync_batch_norm(sequence: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                     process_set: int, name: Optional[str]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, mean, var, total, invstd, the next sequence). In a job of one
    rank, or before init(), the statistics are this rank's own, as in
    plain batch norm."""
    y, mean, var, total, _, invstd = _statistics(x, weight, bias, eps, _synced(process_set), name)
    return y, mean, var, total, invstd, registered_ops.new_sequence()


def _synced(process_set_id):
    """The set whose batches the statistics cover, or None for this rank's
    own: in a job of one rank, or before init(), as plain batch norm."""
    if not basics.is_initialized():
        return None
    members = process_sets.find(process_set_id)
    return members if members.size() > 1 else None


@_sync_batch_norm.register_fake
def _(sequence, x, weight, bias, eps, process_set, name):
    channels = x.new_empty((x.size(1),), dtype=_stats_dtype(x))
    return (torch.empty_like(x, memory_format=torch.contiguous_format), channels, torch.empty_like(channels),
            x.new_empty((), dtype=_stats_dtype(x)), torch.empty_like(channels), torch.empty((), dtype=torch.int8))


@torch.library.custom_op("unison::sync_batch_norm_backward", mutates_args=())
def _sync_batch_norm_backward(grad_y: Tensor, x: Tensor, mean: Tensor, invstd: Tensor, weight: Optional[Tensor],
                              total: Tensor, process_set: int, name: Optional[str]) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_x, grad_weight, grad_bias); the last two in weight's dtype (x's without one)."""
    x_hat = (x.to(mean.dtype) - _channel_view(mean, x.dim())) * _channel_view(invstd, x.dim())
    grad_x, grad_weight, grad_bias = _input_gradient(grad_y, x_hat, weight, invstd, total, _synced(process_set),
                                                     name, x.dtype)
    like = weight if weight is not None else x
    return grad_x, grad_weight.to(like.dtype), grad_bias.to(like.dtype)


@_sync_batch_norm_backward.register_fake
def _(grad_y, x, mean, invstd, weight, total, process_set, name):
    like = weight if weight is not None else x
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            like.new_empty((x.size(1),)), like.new_empty((x.size(1),)))


def _sync_batch_norm_settings(ctx, inputs, output):
    _, x, weight, bias, _, ctx.process_set, ctx.name = inputs
    _, mean, var, total, invstd, _ = output
    ctx.save_for_backward(x, weight, mean, invstd, total)
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(mean, var, total, invstd)


def _sync_batch_norm_grad(ctx, grad_y, _mean, _var, _total, _invstd, _sequence):
    x, weight, mean, invstd, total = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = torch.ops.unison.sync_batch_norm_backward(
        grad_y, x, mean, invstd, weight, total, ctx.process_set, ctx.name)
    return (None, grad_x, grad_weight if weight is not None else None, grad_bias if ctx.has_bias else None,
            None, None, None)


_sync_batch_norm.register_autograd(_sync_batch_norm_grad, setup_context=_sync_batch_norm_settings)


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """A drop-in for torch.nn.BatchNorm1d/2d/3d whose training-mode
    statistics cover the global batch. In eval mode, or in a job of one
    rank, it is plain batch norm. `name` prefixes its collectives; left
    None they are numbered, which is deterministic as long as every rank
    runs its layers in the same order (they must, for the statistics to
    pair up)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 process_set=global_process_set, name=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device,
                         dtype=dtype)
        if basics.is_initialized():
            process_sets.check_member(process_set, "SyncBatchNorm")
        self.process_set = process_set
        self.name = name

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError("unison.SyncBatchNorm: expected an (N, C, ...) input with at least 2 "
                             "dimensions, got %d" % input.dim())

    def _momentum(self):
        """The running-stat update weight for this step, as _BatchNorm defines it."""
        if self.momentum is not None:
            return self.momentum
        return 1.0 / float(self.num_batches_tracked)   # cumulative average

    def forward(self, input):
        """Normalizes `input` (N, C, ...) by the statistics of the global batch: every rank's
        in the process set while training, the running statistics in eval mode. Raises ValueError
        for an input of fewer than 2 dimensions."""
        self._check_input_dim(input)
        if torch.compiler.is_compiling():
            return self._compiled_forward(input)
        if not self.training or not basics.is_initialized() or self.process_set.size() == 1:
            return super().forward(input)   # local statistics are the global ones, or unused
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        y, mean, var, total = _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.eps,
                                                           self.process_set, self.name)
        self._track(mean, var, total)
        return y

    def _track(self, mean, var, total):
        """Updates the running statistics with this step's global ones; the
        variance unbiased over the global count, as tensor arithmetic, so
        that Dynamo traces it whole."""
        if not self.track_running_stats:
            return
        momentum = self._momentum()
        unbiased = var * torch.where(total > 1, total / (total - 1), torch.ones_like(total))
        with torch.no_grad():
            self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
            self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)

    def _compiled_forward(self, input):
        """forward() as TorchDynamo traces it: one unison::sync_batch_norm
        node, which also takes the place of plain batch norm in a job of one
        rank (Dynamo cannot ask the core how many ranks there are, and the
        answer must not be baked into the graph)."""
        if not self.training:
            return super().forward(input)
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        y, mean, var, total, _ = graph_ops.run(torch.ops.unison.sync_batch_norm, input, self.weight, self.bias,
                                               self.eps, self.process_set.process_set_id, self.name)
        self._track(mean, var, total)
        return y

    @classmethod
    def convert_sync_batchnorm(cls, module, process_set=global_process_set):
        """`module` with every BatchNorm*d replaced by a SyncBatchNorm that
        carries over its parameters and running statistics."""
        converted = module
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_set=process_set)
            if module.affine:
                converted.weight = module.weight
                converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
        for child_name, child in module.named_children():
            converted.add_module(child_name, cls.convert_sync_batchnorm(child, process_set))
        return converted
