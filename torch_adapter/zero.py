"""ZeroRedundancyOptimizer: optimizer state sharded across ranks (ZeRO
stage 1, with its gradient traffic cut as in stage 2).

Every rank owns a subset of the parameters, chosen by a balanced partition
by size, and keeps the wrapped optimizer's state for those only, so an Adam
whose state is twice the model takes 2/N of the model per rank. One step:

  1. each gradient is averaged onto its owner alone, by a reducescatter
     whose splits give the owner every row and the other ranks none. It
     starts from the gradient's post-accumulate hook, during backward, as
     DistributedOptimizer's allreduces do, and the core fuses whatever is
     ready together: the fusion threshold is the bucket size, and nothing
     is copied into a bucket or padded to an even split.
  2. each rank steps its own parameters with its shard of the optimizer.
  3. one allgather per dtype, in place, shares every owner's updated
     parameters. For that the parameters live as views of one flat buffer
     per dtype, laid out owner by owner: this rank's part is its input, the
     whole buffer the output, so nothing is gathered into a new tensor and
     copied back.

Parameters are assigned whole, never split: the wrapped optimizer sees
ordinary parameters, so any torch.optim class works, including those whose
update is not elementwise.

Checkpoints: consolidate_state_dict(to) gathers every shard onto rank `to`
in the format of a plain optimizer over all the parameters; load_state_dict
takes that format and keeps this rank's part. The format does not depend
on the number of ranks, so a checkpoint resumes at another world size, or
in a single process with the plain optimizer class.
"""
import itertools
import threading
import weakref

import torch

from unison.handles import GraphNode, synchronize
from unison.process_sets import global_process_set
from unison.torch.functions import allgather_object
from unison.torch.ops import (Average, Max, allgather_async, allreduce, placeholder_reducescatter_async,
                              reducescatter_async)

_instances = itertools.count()   # names ops per optimizer; ranks build theirs in the same order


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

    The parameters become views of one flat buffer per dtype (their values
    and identities stay), so every rank's update lands in place. A gradient
    changed between backward and step() (gradient accumulation over several
    backward passes, clipping in place) is noticed and averaged again as it
    is at step(), at the cost of that step's overlap; a rank sends them
    again only when every rank does, which one small allreduce per step
    decides.

    `optim` is this rank's wrapped optimizer; `param_groups` are the global
    groups, and changes to their settings (a learning-rate scheduler's, say)
    reach `optim` at the next step.
    """

    def __init__(self, params, optimizer_class, process_set=global_process_set, **defaults):
        self._process_set = process_set
        self._optimizer_class = optimizer_class
        self._owner = {}            # parameter -> owner's index in the process set
        self._loads = [0] * process_set.size()
        self._prefix = "zero%d." % next(_instances)
        self._layout = None         # (parameter, data_ptr, requires_grad) for each parameter, when laid out
        self._flat = {}             # dtype -> the buffer every parameter of that dtype is a view of
        self._chunk = {}            # dtype -> (start, length) of this rank's part of it
        self._averaged = {}         # own parameter -> where its averaged gradient lands (kept across steps)
        self._index = {}            # parameter -> its place among all parameters (names its op)
        self._hooked = set()
        self._in_flight = {}        # parameter -> (handle, the gradient sent, its version when sent)
        self._stale = False         # a gradient changed after its reduction started
        self._replaced_grads = []   # backward's gradients of own parameters, kept until zero_grad()
        self._stepping_thread = threading.get_native_id()  # whom the hooks work for (DistributedOptimizer's)
        self.optim = None
        self._consolidated = None
        super().__init__(params, defaults)   # calls add_param_group for each group
        self.optim = optimizer_class([self._local_group(g) for g in self.param_groups], **defaults)
        # The global groups take every setting the class fills in, so they,
        # and the consolidated state, read as a plain optimizer's would.
        self.defaults = self.optim.defaults
        for group, local in zip(self.param_groups, self.optim.param_groups):
            group.update((k, v) for k, v in local.items() if k != "params")
        if process_set.size() > 1:
            self._lay_out()

    # ---- partition and layout ----------------------------------------------------

    def _local_group(self, group):
        local = {k: v for k, v in group.items() if k != "params"}
        local["params"] = [p for p in group["params"] if self._owner[p] == self._process_set.rank()]
        return local

    def add_param_group(self, param_group):
        """Adds a parameter group, as torch's optimizers do, and gives its parameters owners among the
        process set's ranks (the least loaded first)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        new = [p for p in group["params"] if p not in self._owner]
        owners, self._loads = _partition([p.numel() for p in new], self._process_set.size(), self._loads)
        self._owner.update(zip(new, owners))
        if self.optim is not None:   # a group added after construction
            self.optim.add_param_group(self._local_group(group))
            if self._process_set.size() > 1:
                self._lay_out()

    def _params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def _lay_out(self):
        """Makes every parameter a view of its dtype's flat buffer, laid out
        owner by owner, and hooks the trainable ones."""
        self._start_the_rest()
        self._wait_in_flight()   # sent under the old layout: step() sends them again
        params = self._params()
        self._index = {p: i for i, p in enumerate(params)}
        by_dtype = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        me = self._process_set.rank()
        self._flat, self._chunk, self._averaged = {}, {}, {}
        for dtype, members in by_dtype.items():
            ordered = sorted(members, key=lambda p: self._owner[p])   # stable: parameter order within an owner
            flat = torch.empty(sum(p.numel() for p in ordered), dtype=dtype, device=ordered[0].device)
            offset = 0
            with torch.no_grad():
                for p in ordered:
                    view = flat[offset:offset + p.numel()].view_as(p)
                    view.copy_(p.detach())
                    p.data = view
                    offset += p.numel()
            mine = [p for p in ordered if self._owner[p] == me]
            length = sum(p.numel() for p in mine)
            self._chunk[dtype] = (sum(p.numel() for p in ordered if self._owner[p] < me), length)
            self._flat[dtype] = flat
            # Averaged gradients land in buffers kept from step to step: new
            # ones each step would cost fresh pages from the kernel. One
            # each, not views of one: views share a version counter, so
            # backward accumulating into one (zero_grad(set_to_none=False))
            # would look like a change to every other after it was sent.
            for p in mine:
                self._averaged[p] = torch.empty(p.numel(), dtype=dtype, device=p.device)
        for p in params:
            if p.requires_grad and p not in self._hooked:
                p.register_post_accumulate_grad_hook(self._make_hook(p))
                self._hooked.add(p)
        self._layout = [(p, p.data_ptr(), p.requires_grad) for p in params]

    def _layout_holds(self):
        """Whether every parameter is still the view it was made (not moved
        by .to(), nor given new .data) and trains as it did."""
        return all(p.data_ptr() == ptr and p.requires_grad == trains for p, ptr, trains in self._layout)

    # ---- one step -------------------------------------------------------------

    def _make_hook(self, p):
        # A weak reference: a discarded optimizer's hooks must not keep it
        # alive, nor start reductions for it.
        optimizer = weakref.ref(self)

        def hook(_):
            self = optimizer()
            if self is None or self._process_set.size() == 1:
                return
            if p in self._in_flight:   # a second backward before step(): accumulation
                self._stale = True
            elif not self._stale:
                with GraphNode(self._stepping_thread):
                    self._start_reduction(p)
        return hook

    def _start_reduction(self, p):
        """Averages p's gradient onto its owner: a reducescatter whose splits
        give the owner every element."""
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        flat = grad.reshape(-1)
        splits = [0] * self._process_set.size()
        splits[self._owner[p]] = flat.numel()
        output = self._averaged.get(p)
        if output is not None and output.data_ptr() == flat.data_ptr():
            output = None   # last step's average, accumulated into in place (zero_grad(set_to_none=False))
        name = self._prefix + "grad.%d" % self._index[p]
        if p.grad is None:
            # Zeros standing in: where no rank used p, the owner leaves it
            # without a gradient, as one process would (DistributedOptimizer's rule).
            handle = placeholder_reducescatter_async(flat, name, Average, self._process_set, splits, output)
        else:
            handle = reducescatter_async(flat, name=name, op=Average, process_set=self._process_set, splits=splits,
                                         output=output)
        self._in_flight[p] = (handle, p.grad, p.grad._version if p.grad is not None else None)

    def _start_the_rest(self):
        """Starts the reduction of every hooked trainable parameter not yet
        in flight: those this rank's backward did not reach (unused here,
        perhaps used on another rank). Before waiting on what is in flight,
        every rank must have the same ops in flight: one waiting on its own
        set would wait for good on a parameter another rank sends only at
        step(), and one that sends again after waiting would pair its
        second round with another's first."""
        for p in getattr(self, "_index", ()):
            if p.requires_grad and p in self._hooked and p not in self._in_flight:
                self._start_reduction(p)

    def _wait_in_flight(self):
        """Waits for every reduction started (a failure is raised once all
        are done); gives {parameter: its averaged gradient, or an empty one}."""
        self._stepping_thread = threading.get_native_id()
        results, failure = {}, None
        in_flight, self._in_flight = self._in_flight, {}
        for p, (handle, _, _) in in_flight.items():
            try:
                results[p] = synchronize(handle)
            except Exception as e:  # noqa: BLE001 - raised below, once every op has finished
                failure = failure or e
        if failure is not None:
            raise failure
        return results

    def _changed_since_sent(self):
        return any(p.grad is not sent or (sent is not None and sent._version != version)
                   for p, (_, sent, version) in self._in_flight.items())

    def _reduce_gradients(self):
        """Averages each owned parameter's gradient across ranks."""
        self._start_the_rest()   # their hooks did not fire: unused this step, or no backward
        # Sent too early (a second backward, a gradient changed in place):
        # send them again as they are now. Every rank must, if any does,
        # or the rounds would not pair up; the flag travels with the round.
        again = self._stale or self._changed_since_sent()
        again = bool(allreduce(torch.tensor([int(again)]), op=Max, name=self._prefix + "again",
                               process_set=self._process_set)[0])
        results = self._wait_in_flight()
        self._stale = False
        if again:
            self._start_the_rest()
            results = self._wait_in_flight()
        me = self._process_set.rank()
        replaced = []
        for p, averaged in results.items():
            if self._owner[p] == me:
                replaced.append(p.grad)
                p.grad = None if averaged is None else averaged.view_as(p)
        # The gradients backward made for this rank's parameters are freed
        # with the others, in zero_grad(), not here: freed mid-step, their
        # memory went to the next forward's activations, and the next
        # backward took its gradients from fresh pages (1,000 page faults
        # and 2 ms a step for the 10-layer MLP of benchmarks/torch_train.py).
        self._replaced_grads = replaced

    def _share_parameters(self):
        """Every owner's updated parameters onto every rank, in place."""
        handles = []
        for dtype, flat in self._flat.items():
            start, length = self._chunk[dtype]
            handles.append(allgather_async(flat[start:start + length], name=self._prefix + "params." + str(dtype),
                                           process_set=self._process_set, output=flat))
        for handle in handles:
            synchronize(handle)

    def zero_grad(self, set_to_none=True):
        """Clears the gradients, as torch's optimizers do (to None by default)."""
        self._replaced_grads = []
        super().zero_grad(set_to_none)

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
        distributed = self._process_set.size() > 1
        if distributed:
            if self._layout is None or not self._layout_holds():
                self._lay_out()
            self._reduce_gradients()
        self._push_settings()
        self.optim.step()
        if distributed:
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

