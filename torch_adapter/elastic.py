"""unison.torch.elastic (hvd.elastic): elastic training for PyTorch.

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...
        state.commit()

See unison.elastic for what happens when a rank dies or hosts change.
"""
import copy
import math

import torch

from unison import basics, elastic
from unison.elastic import HostsUpdatedInterrupt, State, run  # noqa: F401
from unison.torch.functions import (
    allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters)


class ObjectState(elastic.ObjectState):
    """Picklable values (tensors included) kept as attributes."""

    def __init__(self, bcast_object=broadcast_object, get_rank=basics.rank, **kwargs):
        super().__init__(bcast_object, get_rank, **kwargs)


class ElasticSampler(torch.utils.data.Sampler):
    """A DistributedSampler that survives a change of ranks mid-epoch.

    Each epoch visits the dataset in one order (shuffled by seed + epoch).
    The sampler remembers which samples the job has processed this epoch;
    when the job re-forms, the rest are sharded over the new ranks, so no
    sample is skipped and none is seen twice, whatever the sizes.

    record_batch(batch_idx, batch_size) marks batch `batch_idx` of every
    rank as processed, not only this rank's: ranks train in step, so after
    a commit every rank holds the same record, and a rank that dies takes
    none of the job's progress with it. set_epoch() to a new epoch starts it
    afresh; to the current epoch (a resumed one) it keeps the progress."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices = set()
        self.reset()

    def set_epoch(self, epoch):
        """Starts epoch `epoch` afresh, or, for the current epoch (a resumed one), keeps what was processed."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Records that every rank has processed batch `batch_idx` of `batch_size` samples of its shard."""
        start, end = batch_idx * batch_size, (batch_idx + 1) * batch_size
        for shard in self._shards:
            self.processed_indices.update(shard[start:end])

    def record_indices(self, indices):
        """Records the dataset indices in `indices` as processed."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self):
        """The epoch and the indices processed in it, for a commit or a checkpoint."""
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict):
        """Takes the epoch and processed indices back from state_dict()'s output, and reshards."""
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def reset(self):
        """Shards what is left of the epoch over the current ranks."""
        replicas, rank = (basics.size(), basics.rank()) if basics.is_initialized() else (1, 0)
        self._reshard(replicas, rank)

    def _reshard(self, num_replicas, rank):
        order = list(range(len(self.dataset)))
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(order), generator=generator).tolist()
        remaining = [i for i in order if i not in self.processed_indices]
        self.num_replicas, self.rank = num_replicas, rank
        self.num_samples = int(math.ceil(len(remaining) / num_replicas)) if remaining else 0
        # As DistributedSampler: every rank gets as many samples (the first
        # few repeat) so that ranks run the same number of steps.
        padded = remaining + remaining[:self.num_samples * num_replicas - len(remaining)]
        self._shards = [padded[r::num_replicas] for r in range(num_replicas)]
        self.indices = self._shards[rank]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return self.num_samples


class TorchState(ObjectState):
    """A model, its optimizer, ElasticSamplers and other values, kept and
    restored together. Modules, optimizers and samplers given as keywords
    are kept as such; anything else as a picklable value."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kinds = (torch.nn.Module, torch.optim.Optimizer, ElasticSampler)
        self._handled = {name: value for name, value in dict(kwargs, model=model, optimizer=optimizer).items()
                         if isinstance(value, kinds)}
        for name, value in self._handled.items():
            setattr(self, name, value)
        plain = {name: value for name, value in kwargs.items() if name not in self._handled}
        self._handled_saved = {}
        super().__init__(**plain)
        self._save_handled()

    def _save_handled(self):
        self._handled_saved = {name: copy.deepcopy(value.state_dict()) for name, value in self._handled.items()}

    def save(self):
        """Keeps a copy of each model's, optimizer's and sampler's state (and the other values) as the commit."""
        self._save_handled()
        super().save()

    def restore(self):
        """Sets each model, optimizer and sampler (and the other values) back to their last commit."""
        for name, value in self._handled.items():
            value.load_state_dict(copy.deepcopy(self._handled_saved[name]))
        super().restore()

    def sync(self):
        """Sets every rank's models and optimizers to rank 0's, merges the samplers' records of the epoch
        over the ranks, and commits the result."""
        for name, value in self._handled.items():
            if isinstance(value, torch.nn.Module):
                broadcast_parameters(value.state_dict(), root_rank=0, prefix="elastic.%s" % name)
            elif isinstance(value, torch.optim.Optimizer):
                broadcast_optimizer_state(value, root_rank=0)
            else:
                # Every rank's record of the epoch, merged: after a failure
                # each survivor restored its own last commit.
                records = allgather_object(value.state_dict(), name="elastic.%s" % name)
                merged = records[0]  # rank 0's epoch is the job's
                for record in records[1:]:
                    if record["epoch"] == merged["epoch"]:
                        merged["processed_indices"] = sorted(set(merged["processed_indices"]) |
                                                             set(record["processed_indices"]))
                value.load_state_dict(merged)
        super().sync()
        # A newcomer's commit is the state it just received, not its own start.
        self.save()

    def reset(self):
        """Reshards the samplers over the ranks of the new round (the job re-formed)."""
        # Without a sync (hosts were only removed), samplers still reshard.
        for value in self._handled.values():
            if isinstance(value, ElasticSampler):
                value.reset()
