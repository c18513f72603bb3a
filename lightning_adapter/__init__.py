"""unison.lightning: a strategy for Lightning 2.x, for the jobs Lightning's
`HorovodStrategy` ran before Lightning 2.0 removed it.

    import unison.lightning  # also registers strategy="unison"
    trainer = lightning.pytorch.Trainer(strategy=unison.lightning.UnisonStrategy(), ...)

    unisonrun -np 4 python train.py

As with Horovod's strategy, the launcher starts the processes (unisonrun,
mpirun, srun, torchrun, or a Ray or Spark job that runs unison), one per
device, and the strategy joins the job they form; it starts no processes of
its own. Each process trains on its shard of every dataloader (Lightning
adds the distributed sampler, sized by unison), and:

- at setup, rank 0's parameters and optimizer state are broadcast, so every
  rank starts alike, resumed from a checkpoint or not;
- every optimizer is wrapped in unison.torch's DistributedOptimizer, which
  averages gradients as backward makes them, every `accumulate_grad_batches`
  passes (its backward_passes_per_step);
- the learning rate of each optimizer, and its schedulers' base rates, are
  multiplied by the number of ranks, as Horovod's strategy did: N ranks
  averaging N shards' gradients take the step one process takes on the
  whole global batch, whose size grew N times. `scale_learning_rate=False`
  keeps the rates as configured;
- `reduce`, `all_gather`, `broadcast`, `barrier` (and so `self.log(...,
  sync_dist=True)`, metrics and checkpoint saving) go through unison.

Lightning ships as `lightning` (lightning.pytorch) and as
`pytorch_lightning`, two copies whose classes do not mix: the strategy
subclasses the one your Trainer comes from. It takes `lightning.pytorch`
where that is installed, else `pytorch_lightning`.
"""
import contextlib
import functools

import torch

import unison.torch as hvd

try:
    from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import rank_zero_only
except ImportError:  # only the older package name is installed
    from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry
    from pytorch_lightning.trainer.states import TrainerFn
    from pytorch_lightning.utilities import rank_zero_only

__all__ = ["UnisonStrategy"]

# Lightning names reductions by string or by torch.distributed.ReduceOp.
_REDUCTIONS = {None: hvd.Average, "mean": hvd.Average, "avg": hvd.Average, "average": hvd.Average,
               "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min, "product": hvd.Product, "prod": hvd.Product}


def _joined():
    """unison.torch, with this process in its job: the Trainer asks for ranks
    before any hook runs, so the job is joined at the first question."""
    if not hvd.is_initialized():
        hvd.init()
    return hvd


def _reduction(reduce_op):
    name = reduce_op
    if isinstance(reduce_op, torch.distributed.ReduceOp if torch.distributed.is_available() else ()):
        name = str(reduce_op).rsplit(".", 1)[-1]
    key = name.lower() if isinstance(name, str) else name
    if key not in _REDUCTIONS:
        raise ValueError("unison.lightning: reduce_op=%r: unison reduces by one of %s"
                         % (reduce_op, ", ".join(sorted(k for k in _REDUCTIONS if k))))
    return _REDUCTIONS[key]


def _count_steps_for_schedulers(original, distributed):
    """torch's LR schedulers wrap the step() of the optimizer they are made
    with, to warn when scheduler.step() runs before any optimizer.step().
    Lightning made them with the optimizer the DistributedOptimizer
    replaces, so the replacement's step() is wrapped alike; where a torch
    no longer marks the optimizer it wraps, nothing is done (at worst, that
    torch warns once)."""
    if not hasattr(original.step, "_wrapped_by_lr_sched") or hasattr(distributed.step, "_wrapped_by_lr_sched"):
        return
    step = distributed.step

    @functools.wraps(step)
    def counted(*args, **kwargs):
        distributed._opt_called = True
        return step(*args, **kwargs)
    counted._wrapped_by_lr_sched = True
    distributed.step = counted


class UnisonStrategy(ParallelStrategy):
    """Data-parallel training over the ranks of a unison job (see the
    module's documentation)."""

    strategy_name = "unison"
    """The name `Trainer(strategy=...)` takes for this strategy once `unison.lightning` is imported."""

    def __init__(self, accelerator=None, parallel_devices=None, checkpoint_io=None, precision_plugin=None,
                 scale_learning_rate=True):
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=None,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self.scale_learning_rate = scale_learning_rate

    # ---- who this process is: unison's job, not Lightning's cluster environment

    @property
    def global_rank(self):
        """This process's rank in the unison job."""
        return _joined().rank()

    @property
    def local_rank(self):
        """This process's rank among the job's ranks on its host."""
        return _joined().local_rank()

    @property
    def node_rank(self):
        """This host's place among the job's hosts (unison's cross rank)."""
        return _joined().cross_rank()

    @property
    def world_size(self):
        """How many ranks the job has."""
        return _joined().size()

    @property
    def is_distributed(self):
        """True: Lightning then gives each dataloader a distributed sampler."""
        # Lightning asks this of strategies it does not know, to decide
        # whether each dataloader gets a DistributedSampler.
        return True

    @property
    def distributed_sampler_kwargs(self):
        """The sampler's arguments: every rank of the job, this process's rank among them."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def root_device(self):
        """The device this process trains on: the CPU, or the GPU its local rank picks."""
        # One device per process, chosen by its local rank, as Horovod's
        # scripts pin it; a CUDA_VISIBLE_DEVICES that leaves each process
        # one device makes that device 0.
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cuda":
            return torch.device("cuda", self.local_rank % max(torch.cuda.device_count(), 1))
        return devices[0]

    def set_world_ranks(self):
        """Joins the unison job as the Trainer is made, so that rank-zero-only output knows its rank."""
        # The Trainer calls this as it is made: the job joins here, so that
        # rank-zero-only logging and progress bars know their rank at once.
        rank_zero_only.rank = self.global_rank

    def setup_environment(self):
        """Joins the unison job (init() if it has not been called), then Lightning's own set-up."""
        _joined()
        super().setup_environment()

    def model_to_device(self):
        """Moves the model to root_device."""
        if self.model is not None:
            self.model.to(self.root_device)

    def setup(self, trainer):
        """Broadcasts rank 0's parameters and optimizer state, scales the learning rates by the world
        size (unless scale_learning_rate=False), and wraps each optimizer in a DistributedOptimizer
        that averages the gradients over the ranks, every accumulate_grad_batches steps."""
        super().setup(trainer)
        model = self.lightning_module
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if self.scale_learning_rate:
            for optimizer in self.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] *= self.world_size
            for config in self.lr_scheduler_configs:
                config.scheduler.base_lrs = [lr * self.world_size for lr in config.scheduler.base_lrs]
        wrapped = []
        for optimizer in self.optimizers:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
            distributed = hvd.DistributedOptimizer(
                optimizer, named_parameters=[(n, p) for n, p in model.named_parameters() if id(p) in trained],
                backward_passes_per_step=trainer.accumulate_grad_batches)
            # The schedulers move to the wrapped optimizer (its param groups
            # are the original's dicts, so the rates they set are read
            # either way), and its steps are counted for them.
            for config in self.lr_scheduler_configs:
                if config.scheduler.optimizer is optimizer:
                    config.scheduler.optimizer = distributed
                    _count_steps_for_schedulers(optimizer, distributed)
            wrapped.append(distributed)
        self.optimizers = wrapped

    # ---- collectives ---------------------------------------------------------

    def reduce(self, tensor, group=None, reduce_op="mean"):
        """The tensor reduced over every rank (mean unless told otherwise);
        anything but a tensor comes back as it is, as with DDP."""
        self._refuse_group(group)
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return hvd.allreduce(tensor, op=_reduction(reduce_op))

    def all_gather(self, tensor, group=None, sync_grads=False):
        """Every rank's tensor, stacked in rank order along a new first
        dimension. Gradients flow back through it only with sync_grads."""
        self._refuse_group(group)
        with contextlib.nullcontext() if sync_grads else torch.no_grad():
            return hvd.allgather(tensor.unsqueeze(0))

    def broadcast(self, obj, src=0):
        """Rank `src`'s object, on every rank (pickled, as broadcast_object sends it)."""
        return hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, name=None):
        """Returns once every rank has reached it."""
        hvd.barrier()

    @staticmethod
    def _refuse_group(group):
        if group is not None:
            raise ValueError("unison.lightning: group=%r: a torch.distributed process group is not unison's; "
                             "unison reduces over the whole job here" % (group,))


# override: a second import (a reload, or the module reached under two
# names) registers the same strategy again rather than failing.
StrategyRegistry.register(UnisonStrategy.strategy_name, UnisonStrategy,
                          description="Data-parallel training over a unison job's ranks", override=True)
