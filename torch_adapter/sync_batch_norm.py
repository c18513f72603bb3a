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
import torch

from unison import basics
from unison import process_sets
from unison.process_sets import global_process_set
from unison.torch.ops import Sum, allgather, allreduce, remembers_its_caller, runs_for_its_caller


def _channel_view(t, ndim):
    """A per-channel vector shaped to broadcast against an (N, C, ...) input."""
    return t.view((1, -1) + (1,) * (ndim - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    @remembers_its_caller
    def forward(ctx, x, weight, bias, eps, process_set, name):
        dims = [0] + list(range(2, x.dim()))
        # Statistics in float32 at least: a float16 sum over a large batch overflows.
        stats_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        xs = x.to(stats_dtype)
        count = x.numel() // x.size(1)
        if count:
            mean = xs.mean(dims)
            m2 = (xs - _channel_view(mean, x.dim())).square().sum(dims)
        else:
            mean = xs.new_zeros(x.size(1))
            m2 = xs.new_zeros(x.size(1))
        mine = torch.cat([xs.new_tensor([float(count)]), mean, m2]).unsqueeze(0)
        every = allgather(mine, name=name + ".stats" if name else None, process_set=process_set)
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
        ctx.save_for_backward(x_hat, weight, invstd)
        ctx.mark_non_differentiable(global_mean, var, total)
        ctx.settings = (total, process_set, name, weight is not None, bias is not None, x.dtype)
        return y.to(x.dtype), global_mean, var, total

    @staticmethod
    @runs_for_its_caller
    def backward(ctx, grad_y, _grad_mean, _grad_var, _grad_total):
        x_hat, weight, invstd = ctx.saved_tensors
        total, process_set, name, has_weight, has_bias, x_dtype = ctx.settings
        dims = [0] + list(range(2, x_hat.dim()))
        dy = grad_y.to(x_hat.dtype)
        local_dy = dy.sum(dims)
        local_dy_xhat = (dy * x_hat).sum(dims)
        sums = allreduce(torch.stack([local_dy, local_dy_xhat]), op=Sum,
                         name=name + ".grad" if name else None, process_set=process_set)
        mean_dy = _channel_view(sums[0] / total, x_hat.dim())
        mean_dy_xhat = _channel_view(sums[1] / total, x_hat.dim())
        scale = invstd if weight is None else invstd * weight.to(x_hat.dtype)
        grad_x = _channel_view(scale, x_hat.dim()) * (dy - mean_dy - x_hat * mean_dy_xhat)
        grad_weight = local_dy_xhat.to(weight.dtype) if has_weight else None
        grad_bias = local_dy.to(weight.dtype if has_weight else x_dtype) if has_bias else None
        return grad_x.to(x_dtype), grad_weight, grad_bias, None, None, None


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
        self._check_input_dim(input)
        if not self.training or not basics.is_initialized() or self.process_set.size() == 1:
            return super().forward(input)   # local statistics are the global ones, or unused
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        y, mean, var, total = _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.eps,
                                                           self.process_set, self.name)
        if self.track_running_stats:
            momentum = self._momentum()
            unbiased = var * (total / (total - 1)) if total > 1 else var
            with torch.no_grad():
                self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype),
                                                         alpha=momentum)
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
