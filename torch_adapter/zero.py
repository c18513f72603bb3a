"""ZeroRedundancyOptimizer: optimizer state sharded across ranks (ZeRO
stage 1, with its gradient traffic cut as in stage 2).

Every rank owns a subset of the parameters, chosen by a balanced partition
by size, and keeps the wrapped optimizer's state for those only, so an Adam
whose state is twice the model takes 2/N of the model per rank. One step:

  1. gradients are averaged across ranks, but each rank receives only the
     part it owns: one reducescatter per dtype over a flat buffer laid out
     owner by owner (each owner's segment padded to the longest). Where the
     padding would make that cost more than an allreduce of the unpadded
     buffer (one parameter dominating the model), an allreduce is used.
  2. each rank steps its own parameters with its shard of the optimizer.
  3. one allgather per dtype shares every owner's updated parameters.

Parameters are assigned whole, never split: the wrapped optimizer sees
ordinary parameters, so any torch.optim class works, including those whose
update is not elementwise.

Checkpoints: consolidate_state_dict(to) gathers every shard onto rank `to`
in the format of a plain optimizer over all the parameters; load_state_dict
takes that format and keeps this rank's part. The format does not depend
on the number of ranks, so a checkpoint resumes at another world size, or
in a single process with the plain optimizer class.
"""
import torch

from unison.process_sets import global_process_set
from unison.torch.functions import allgather_object
from unison.torch.ops import Average, allgather, allreduce, reducescatter


def _partition(sizes, nranks, loads=None):
    """Owner rank of each parameter: largest first, each to the least loaded
    rank (lowest rank on ties), so every rank computes the same answer."""
    loads = list(loads) if loads is not None else [0] * nranks
    owners = [None] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(nranks), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += sizes[i]
    return owners, loads


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """ZeroRedundancyOptimizer(params, optimizer_class, process_set=global_process_set, **defaults)

    `params` are tensors or param-group dicts, as for any optimizer;
    `defaults` are optimizer_class's keyword arguments. Use it in place of
    both DistributedOptimizer and the plain optimizer: step() averages the
    gradients itself. After step(), only the gradients of this rank's own
    parameters hold the average; the others hold this rank's own.

    `optim` is this rank's wrapped optimizer; `param_groups` are the global
    groups, and changes to their settings (a learning-rate scheduler's, say)
    reach `optim` at the next step.
    """

    def __init__(self, params, optimizer_class, process_set=global_process_set, **defaults):
        self._process_set = process_set
        self._optimizer_class = optimizer_class
        self._owner = {}            # parameter -> owner's index in the process set
        self._loads = [0] * process_set.size()
        self.optim = None
        self._consolidated = None
        super().__init__(params, defaults)   # calls add_param_group for each group
        self.optim = optimizer_class([self._local_group(g) for g in self.param_groups], **defaults)
        # The global groups take every setting the class fills in, so they,
        # and the consolidated state, read as a plain optimizer's would.
        self.defaults = self.optim.defaults
        for group, local in zip(self.param_groups, self.optim.param_groups):
            group.update((k, v) for k, v in local.items() if k != "params")

    # ---- partition ------------------------------------------------------------

    def _local_group(self, group):
        local = {k: v for k, v in group.items() if k != "params"}
        local["params"] = [p for p in group["params"] if self._owner[p] == self._process_set.rank()]
        return local

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        new = [p for p in group["params"] if p not in self._owner]
        owners, self._loads = _partition([p.numel() for p in new], self._process_set.size(), self._loads)
        self._owner.update(zip(new, owners))
        if self.optim is not None:   # a group added after construction
            self.optim.add_param_group(self._local_group(group))

    def _params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def _segments(self, params):
        """params split by owner: one list per rank of the process set, each
        in the parameters' own order."""
        segments = [[] for _ in range(self._process_set.size())]
        for p in params:
            segments[self._owner[p]].append(p)
        return segments

    def _by_dtype(self, params):
        groups = {}
        for p in params:
            groups.setdefault(p.dtype, []).append(p)
        return groups

    # ---- one step -------------------------------------------------------------

    def gradient_reduction(self, lengths):
        """'reducescatter' or 'allreduce': which moves fewer bytes for owner
        segments of these lengths. A reducescatter of the padded buffer moves
        about max(lengths) per rank and step of the ring; an allreduce moves
        twice the unpadded total divided by the number of ranks."""
        nranks = len(lengths)
        return "reducescatter" if nranks * max(lengths) < 2 * sum(lengths) else "allreduce"

    def _reduce_gradients(self):
        """Averages each owned parameter's gradient across ranks."""
        me = self._process_set.rank()
        trainable = [p for p in self._params() if p.requires_grad]
        for dtype, params in self._by_dtype(trainable).items():
            segments = self._segments(params)
            lengths = [sum(p.numel() for p in segment) for segment in segments]
            grads = [[(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in segment]
                     for segment in segments]
            if self.gradient_reduction(lengths) == "reducescatter":
                padded, longest = [], max(lengths)
                for segment_grads, length in zip(grads, lengths):
                    padded += segment_grads
                    if length < longest:
                        padded.append(torch.zeros(longest - length, dtype=dtype))
                mine = reducescatter(torch.cat(padded), op=Average, process_set=self._process_set)
            else:
                every = allreduce(torch.cat([g for segment_grads in grads for g in segment_grads]),
                                  op=Average, process_set=self._process_set)
                mine = every[sum(lengths[:me]):sum(lengths[:me + 1])]
            offset = 0
            for p in segments[me]:
                p.grad = mine[offset:offset + p.numel()].view_as(p)
                offset += p.numel()

    def _share_parameters(self):
        """Every owner's updated parameters onto every rank."""
        me = self._process_set.rank()
        for dtype, params in self._by_dtype(self._params()).items():
            segments = self._segments(params)
            own = [p.detach().reshape(-1) for p in segments[me]]
            every = allgather(torch.cat(own) if own else torch.zeros(0, dtype=dtype),
                              process_set=self._process_set)
            with torch.no_grad():
                offset = 0
                for p in (p for segment in segments for p in segment):
                    p.copy_(every[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def _push_settings(self):
        """Carries changes to the global groups' settings (a scheduler's lr)
        over to this rank's optimizer."""
        for group, local in zip(self.param_groups, self.optim.param_groups):
            for key, value in group.items():
                if key != "params":
                    local[key] = value

    @torch.no_grad()
    def step(self, closure=None):
        """Averages the gradients, steps this rank's shard, shares the result.
        A closure is evaluated once, before the exchange, for its loss and
        gradients (optimizers that call it many times per step, like LBFGS,
        need every rank's gradients each time and are not supported)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._process_set.size() > 1:
            self._reduce_gradients()
        self._push_settings()
        self.optim.step()
        if self._process_set.size() > 1:
            self._share_parameters()
        self._consolidated = None
        return loss

    # ---- checkpoints ----------------------------------------------------------

    def consolidate_state_dict(self, to=0):
        """Gathers every rank's shard of the state onto rank `to` (an index in
        the process set); call it on every rank, then state_dict() there."""
        params = self._params()
        index = {p: i for i, p in enumerate(params)}
        local_params = [p for g in self.optim.param_groups for p in g["params"]]
        mine = {index[p]: self.optim.state[p] for p in local_params if p in self.optim.state}
        shards = allgather_object(mine, name="zero.consolidate", process_set=self._process_set)
        if self._process_set.rank() != to:
            self._consolidated = None
            return
        state = {}
        for shard in shards:
            state.update(shard)
        groups = []
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = [index[p] for p in group["params"]]
            groups.append(saved)
        self._consolidated = {"state": dict(sorted(state.items())), "param_groups": groups}

    def state_dict(self):
        """The consolidated state, in a plain optimizer's format (indices over
        all parameters, every group's settings)."""
        if self._consolidated is None:
            raise RuntimeError("unison.ZeroRedundancyOptimizer: state_dict() holds the whole state only "
                               "on the rank that consolidate_state_dict(to=...) named, and only until the "
                               "next step(); call consolidate_state_dict() on every rank first")
        return self._consolidated

    def load_state_dict(self, state_dict):
        """Loads a state in a plain optimizer's format (consolidated here, or
        saved by a plain optimizer_class over the same parameters in the same
        groups, at any world size); this rank keeps its own part."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, self.param_groups)):
            raise ValueError("unison.ZeroRedundancyOptimizer: the state's parameter groups do not match "
                             "this optimizer's (group sizes %s against %s)"
                             % ([len(g["params"]) for g in groups],
                                [len(g["params"]) for g in self.param_groups]))
        me = self._process_set.rank()
        local_groups, local_state, next_index = [], {}, 0
        for saved, group in zip(groups, self.param_groups):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
            local = {k: v for k, v in saved.items() if k != "params"}
            local["params"] = []
            for saved_index, p in zip(saved["params"], group["params"]):
                if self._owner[p] != me:
                    continue
                if saved_index in state_dict["state"]:
                    local_state[next_index] = state_dict["state"][saved_index]
                local["params"].append(next_index)
                next_index += 1
            local_groups.append(local)
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self._consolidated = None

