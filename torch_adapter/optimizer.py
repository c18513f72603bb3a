"""DistributedOptimizer: Horovod's optimizer wrapper on torch 2.x hooks.

Each parameter's gradient allreduce starts from its post-accumulate-grad
hook, the moment backward has finished accumulating that gradient, so
communication overlaps the rest of backward; step() waits for them all.
The wrapper is a subclass of the wrapped optimizer's own class, so
isinstance() checks, schedulers and state_dict() see the optimizer the
user built.
"""
import contextlib
import sys
import threading
import warnings
import weakref

import torch

from unison.arguments import gradient_scaling, split_into_groups
from unison.compression import check_compressor
from unison.exceptions import InvalidArgumentError, UnisonError
from unison.handles import GraphNode, synchronize as _wait
from unison.process_sets import global_process_set
from unison.torch import ops as _ops
from unison.torch.compression import Compression
from unison.torch.ops import (Adasum, Average, allreduce_, allreduce_async_, grouped_gradient_allreduce_async_,
                              placeholder_allreduce_async_, sparse_allreduce_async)


# Each gradient's allreduce reads and writes its .grad in place, from the
# moment backward has accumulated it until step(). A change made to it
# meanwhile (clip_grad_norm_, GradScaler's unscale_ inside scaler.step())
# races with the allreduce: it is lost, or mixed into the average, and
# differently on each rank, so the ranks train apart without a word. The
# tensor's version counter says whether that happened (torch counts every
# in-place op but GradScaler's fused unscale kernel, caught apart below);
# Horovod's recipe is the fix.
_CHANGED_IN_FLIGHT = (
    "unison: the gradients of %d parameter(s) (%s%s) were changed while their allreduce was in flight, "
    "between loss.backward() and optimizer.step(); the allreduce works on them in place, so the change was "
    "lost or mixed into the average, differently on each rank. To change gradients before the step "
    "(clip_grad_norm_, GradScaler: scaler.unscale_ or scaler.step), call optimizer.synchronize() first, "
    "change them, then call optimizer.step() (or scaler.step(optimizer)) inside "
    "`with optimizer.skip_synchronize():`")


# GradScaler's fused unscale kernel is the one change the version counter
# does not see. scaler.step(optimizer) unscales the gradients just before
# it calls step(): a step() called by a GradScaler while allreduces are in
# flight means they were unscaled in flight.
_UNSCALED_IN_FLIGHT = (
    "unison: scaler.step(optimizer) unscaled the gradients while their allreduces were in flight, between "
    "loss.backward() and optimizer.step(): the unscaling was lost or mixed into the average, differently on "
    "each rank, and each rank looked for inf and NaN in its own gradients. Call optimizer.synchronize() "
    "before scaler.step (and scaler.unscale_), then scaler.step(optimizer) inside "
    "`with optimizer.skip_synchronize():`")


def _called_by_grad_scaler():
    """Whether a torch.amp.GradScaler's method is among step()'s nearest
    callers (torch's step wrapper sits between them)."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if isinstance(frame.f_locals.get("self"), torch.amp.GradScaler):
            return True
        frame = frame.f_back
    return False


class _TrackedParameters:
    """Mixed in first: every parameter the wrapped optimizer holds, in order,
    with the name its exchange goes by, kept current when a param group is
    added after wrapping.

    Every parameter is tracked, whether or not it requires a gradient today:
    which ones train is decided at each step (each class's _takes_part), as
    one process decides it: an optimizer skips a parameter whose .grad is
    None, so a frozen parameter that got no gradient is left alone. The
    fine-tuning recipe freezes a backbone (requires_grad=False), later
    unfreezes it, and may add its parameters with add_param_group() then;
    a wrapper that fixed the trainable set when it was made (as Horovod's
    does) would leave those gradients unaveraged, and the ranks would train
    apart without a word."""

    def _track(self, named_parameters):
        self._ordered = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names = _check_names(named_parameters, self._ordered)

    def _added(self, p):
        """A parameter of a group added after wrapping."""

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if "_ordered" not in self.__dict__:
            return  # the optimizer's own __init__ adding the first groups
        for p in self.param_groups[-1]["params"]:
            # The names of named_parameters where it has one; every rank
            # adds the same groups in the same order, so a position names
            # the parameter alike everywhere otherwise.
            self._parameter_names.setdefault(p, "noname.%d" % len(self._ordered))
            self._ordered.append(p)
            self._added(p)


# The methods the gradient hook calls, which fast_path.cc's C hook does
# itself: where an optimizer's class or the object itself has its own
# version of one, the C hook calls the Python one, which calls it.
_HOOKS_CALLS = ("_allreduce_grad_async", "_wire_tensor", "_scale_factors")


class _DistributedOptimizer(_TrackedParameters):
    """Mixed in before the wrapped optimizer's class."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set):
        super().__init__(params)
        self._compression = compression
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step

        self._track(named_parameters)
        self._group_of = _assign_groups(groups, self._ordered)
        self._group_members = {}
        for p in self._ordered:
            if self._group_of[p] is not None:
                self._group_members.setdefault(self._group_of[p], []).append(p)
        # Gradient passes each parameter still waits for before its allreduce.
        self._allreduce_delay = {p: backward_passes_per_step for p in self._ordered}
        # parameter -> (handle, compression context, sent), handle None until
        # started; sent is (its .grad, that tensor's version) as the allreduce
        # started, so that synchronize() finds a change made to it in flight.
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        self._hooked = set()
        # The thread that steps, which the hooks start allreduces for: on a
        # GPU, backward runs them on PyTorch's autograd thread for the
        # device, which must not count as a busy submitter once it idles
        # (the deadlock test, native/caller_activity.h).
        self._stepping_thread = threading.get_native_id()
        for p in self._ordered:
            self._hook_if_trained(p)

    def _averages(self):
        """Whether this rank's gradients are averaged at all. A rank outside
        the optimizer's process set steps on its own gradients, as a plain
        optimizer, as in Horovod: a script builds one optimizer on every
        rank and steps it everywhere."""
        return self.process_set.size() > 1 and self.process_set.included()

    def _takes_part(self, p):
        # A parameter that requires a gradient takes part even when this
        # rank did not use it: every rank must allreduce the same names, or
        # the others wait forever (its zeros go as a placeholder: _wire_tensor).
        return p in self._handles or p.requires_grad

    def _added(self, p):
        self._group_of[p] = None
        self._allreduce_delay[p] = self.backward_passes_per_step
        self._hook_if_trained(p)

    # ---- hooks -----------------------------------------------------------------

    def _hook_if_trained(self, p):
        # torch refuses a hook on a tensor that requires no gradient: a
        # frozen parameter gets its hook when synchronize() first finds it
        # unfrozen (that step's allreduce starts there, after backward).
        if p.requires_grad and p not in self._hooked and self._averages():
            p.register_post_accumulate_grad_hook(self._make_hook(p))
            self._hooked.add(p)

    def _make_hook(self, p):
        """The hook that starts p's allreduce when backward has accumulated
        its gradient: this function's `hook`, or, where unison.torch's
        compiled path is in use, a C one (fast_path.cc's GradientHook) that
        does the same for the common case (the last pass before step(), no
        group, no compression, the global set, no predivide factor, none of
        _HOOKS_CALLS replaced) and calls `hook` for everything else."""
        # A weak reference: a discarded optimizer's hooks must not keep it
        # alive, nor start allreduces for it. Nor does the hook hold the
        # parameter: torch passes it in. The parameter holds its hooks, and
        # torch does not show them to the garbage collector, so a hook that
        # held its parameter kept it, and its model, alive for good once
        # both were dropped.
        optimizer = weakref.ref(self)

        def hook(p):
            self = optimizer()
            if self is None:
                return
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "unison: gradients were computed more than backward_passes_per_step (%d) times "
                    "before step(); increase backward_passes_per_step to accumulate gradients locally"
                    % self.backward_passes_per_step)
            self._allreduce_delay[p] -= 1
            self._handles[p] = (None, None, None)
            if self._allreduce_delay[p] == 0:
                group = self._group_of[p]
                with GraphNode(self._stepping_thread):
                    if group is None:
                        self._handles[p] = self._allreduce_grad_async(p)
                    elif all(self._allreduce_delay[m] == 0 for m in self._group_members[group] if m.requires_grad):
                        self._start_group(group)  # the last of its trained members to be ready
        compiled = _ops._fast
        if compiled is None:
            return hook
        return compiled.gradient_hook(optimizer, "allreduce." + self._parameter_names[p], hook, Compression.none,
                                      global_process_set, tuple(getattr(_DistributedOptimizer, method)
                                                                for method in _HOOKS_CALLS))

    def _start_group(self, group):
        members = [p for p in self._group_members[group] if self._takes_part(p)]
        tensors, placeholders, started = [], [], []
        for p in members:
            tensor, ctx, sent, placeholder = self._wire_tensor(p)
            tensors.append(tensor)
            placeholders.append(placeholder)
            started.append((ctx, sent))
        prescale, postscale = self._scale_factors()
        name = "allreduce.group." + self._parameter_names[members[0]]
        group_handle = grouped_gradient_allreduce_async_(tensors, name, self.op, prescale, postscale,
                                                         self.process_set, placeholders)
        for p, h, (ctx, sent) in zip(members, group_handle.handles, started):
            self._handles[p] = (h, ctx, sent)

    def _scale_factors(self):
        return gradient_scaling(self.op, self.gradient_predivide_factor)

    def _wire_tensor(self, p):
        """(what goes on the wire, its compression context, sent, whether
        it is a placeholder's zeros)."""
        placeholder = p.grad is None
        if placeholder:
            # A parameter this rank did not use still takes part: every rank
            # must allreduce the same names, or the others wait forever. Its
            # zeros go as a placeholder: where no rank used the parameter,
            # the allreduce says so and synchronize() leaves it without a
            # gradient, as one process would (momentum and weight decay
            # would move it on zeros).
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse and self.sparse_as_dense:
            p.grad = p.grad.to_dense()
        tensor, ctx = self._compression.compress(p.grad)
        return tensor, ctx, (p.grad, p.grad._version), placeholder

    def _allreduce_grad_async(self, p):
        name = "allreduce." + self._parameter_names[p]
        if p.grad is not None and p.grad.is_sparse and not self.sparse_as_dense:
            return sparse_allreduce_async(p.grad, name, self.op, self.process_set), "sparse", None
        tensor, ctx, sent, placeholder = self._wire_tensor(p)
        prescale, postscale = self._scale_factors()
        if placeholder:
            handle = placeholder_allreduce_async_(tensor, name, self.op, prescale, postscale, self.process_set)
        else:
            handle = allreduce_async_(tensor, name=name, op=self.op, prescale_factor=prescale,
                                      postscale_factor=postscale, process_set=self.process_set)
        return handle, ctx, sent

    # ---- the optimizer API -------------------------------------------------------

    def synchronize(self):
        """Waits for every gradient's allreduce (starting those whose hook did
        not fire) and writes the results into the .grad fields."""
        self._stepping_thread = threading.get_native_id()
        if not self._averages() and not self._handles:
            # Nothing to average: one rank, or a rank outside the process
            # set. (Hooks made when the job was larger, before an elastic
            # job shrank to one rank, still start allreduces: the loop below
            # finishes those.)
            self._synchronized = True
            return
        for p in self._ordered:
            if p in self._handles and self._handles[p][0] is not None:
                continue  # started by its hook
            if not self._takes_part(p):
                continue
            self._hook_if_trained(p)  # unfrozen since the last step
            group = self._group_of[p]
            if group is not None:
                self._start_group(group)  # starts p and the rest of its group
            else:
                self._handles[p] = self._allreduce_grad_async(p)
        # A failed allreduce (a peer died, a deadlock) fails this call, but
        # only after every other one has finished with its gradient, and it
        # leaves the optimizer ready for the next backward: a caller that
        # handles the error can zero the gradients and go on.
        failure, changed = None, []
        for p in self._ordered:
            self._allreduce_delay[p] = self.backward_passes_per_step
            if p not in self._handles:
                continue  # frozen, no gradient: left as one process leaves it
            handle, ctx, sent = self._handles[p]
            if ctx != "sparse":
                # Looked at before the wait, which itself writes a
                # non-contiguous gradient back (a new version).
                grad, version = sent
                changed_in_flight = p.grad is not grad or grad._version != version
            try:
                result = _wait(handle)
            except UnisonError as e:
                failure = failure or e
                continue
            if ctx == "sparse":
                p.grad = result
            elif changed_in_flight:
                changed.append(self._parameter_names[p])
            elif result is None:
                p.grad = None   # no rank used it: no gradient, as in one process
            else:
                restored = self._compression.decompress(result, ctx)
                if restored.data_ptr() != p.grad.data_ptr():
                    with torch.no_grad():
                        p.grad.copy_(restored)
        self._handles.clear()
        if failure is not None:
            raise failure
        if changed:
            raise InvalidArgumentError(_CHANGED_IN_FLIGHT % (len(changed), ", ".join(map(repr, changed[:5])),
                                                             " and %d more" % (len(changed) - 5)
                                                             if len(changed) > 5 else ""))
        self._synchronized = True

    def set_backward_passes_per_step(self, passes):
        """Horovod's: backward_passes_per_step from the next pass on (an
        elastic job keeping its global batch as ranks come and go). Every
        parameter's count starts again, as in Horovod."""
        if passes < 1:
            raise ValueError("backward_passes_per_step must be at least 1, got %r" % (passes,))
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For clipping: call synchronize(), clip, then step() inside this."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if closure is not None:
            closure = self._averaged(closure)
            if not any(handle is not None for handle, _, _ in self._handles.values()):
                # The closure makes this step's gradients: nothing to wait
                # for before it (synchronize() would allreduce stale ones).
                # So too with backward_passes_per_step > 1, where the
                # passes before it left their counts short and started no
                # allreduce (Lightning's accumulate_grad_batches steps so):
                # the closure's pass completes the count. Averaging the
                # partial sums first gave the same numbers, at twice the
                # allreduces.
                self._synchronized = False
                return super().step(closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() after "
                              "optimizer.synchronize(): the gradients are allreduced a second time. "
                              "Wrap step() in `with optimizer.skip_synchronize():`.")
            # (With backward_passes_per_step > 1, a pass short of the count
            # leaves entries with no allreduce started: nothing in flight.)
            unscaled_in_flight = (any(handle is not None for handle, _, _ in self._handles.values())
                                  and _called_by_grad_scaler())
            self.synchronize()
            if unscaled_in_flight:
                self._synchronized = False
                raise InvalidArgumentError(_UNSCALED_IN_FLIGHT)
        self._synchronized = False
        return super().step(closure)

    def _averaged(self, closure):
        """The closure an optimizer calls from step() (LBFGS calls it several
        times a step), made to return what one process on the whole batch
        would: the gradients it makes are averaged before the optimizer
        reads them, and so is its loss. LBFGS's line search and its stopping
        tests read the loss: averaged, they decide alike on every rank, and
        every rank evaluates the closure as often as the others."""
        def averaged():
            loss = closure()
            self.synchronize()
            self._synchronized = False
            if loss is None or not self.process_set.included():
                return loss
            local = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss), dtype=torch.float64)
            total = allreduce_(local.clone(), name="DistributedOptimizer.closure_loss", op=self.op,
                               process_set=self.process_set)
            return total if isinstance(loss, torch.Tensor) else float(total)
        return averaged

    def zero_grad(self, set_to_none=True):
        if self._handles:
            names = sorted(self._parameter_names[p] for p in self._handles)
            shown = ", ".join(names[:3]) + (" and %d more" % (len(names) - 3) if len(names) > 3 else "")
            raise AssertionError(
                "unison: optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                "or optimizer.synchronize(); the allreduces in flight (of %s) would race with it. A backward "
                "pass for another optimizer can reach this one's parameters (a GAN's generator loss flows "
                "through the discriminator): set requires_grad=False on them for that pass, or call "
                "optimizer.synchronize() before zero_grad(). A GradScaler's step() skips optimizer.step() "
                "when this rank's gradients hold inf or NaN: call optimizer.synchronize() before it" % shown)
        # The gradients a synchronize() averaged are gone: the next step()
        # averages new ones, and is not the second allreduce it warns about.
        self._synchronized = False
        return super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict):
        # Gradients in flight belong to the state being replaced. An elastic
        # restore comes here after they failed: their errors are already known.
        for handle, _, _ in self._handles.values():
            if handle is not None:
                try:
                    _wait(handle)
                except UnisonError:
                    pass
        self._handles.clear()
        self._allreduce_delay = {p: self.backward_passes_per_step for p in self._ordered}
        self._synchronized = False
        return super().load_state_dict(state_dict)


class _DistributedAdasumOptimizer(_TrackedParameters):
    """op=Adasum: each rank takes its own optimizer step, and the parameter
    deltas (not the gradients) are combined with Adasum, so that ranks
    whose updates agree are averaged and ranks whose updates are orthogonal
    add up."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, process_set):
        super().__init__(params)
        self._track(named_parameters)
        self._compression = compression
        self.process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step

    def _takes_part(self, p):
        # A parameter this rank did not use moves by nothing here, but the
        # others' deltas must still reach it.
        return p.requires_grad or p.grad is not None

    def synchronize(self):
        pass  # gradients stay local; step() combines the updates

    def set_backward_passes_per_step(self, passes):
        if passes < 1:
            raise ValueError("backward_passes_per_step must be at least 1, got %r" % (passes,))
        self.backward_passes_per_step = passes   # each rank steps on its own gradients, however accumulated

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    def step(self, closure=None):
        trained = [p for p in self._ordered if self._takes_part(p)]
        start = [p.detach().clone() for p in trained]
        loss = super().step(closure)
        deltas = []
        for p, before in zip(trained, start):
            delta, ctx = self._compression.compress(p.detach() - before)
            deltas.append((delta, ctx))
        handles = [allreduce_async_(d, name="adasum." + self._parameter_names[p], op=Adasum,
                                    process_set=self.process_set)
                   for p, (d, _) in zip(trained, deltas)]
        with torch.no_grad():
            for p, before, handle, (_, ctx) in zip(trained, start, handles, deltas):
                p.copy_(before + self._compression.decompress(_wait(handle), ctx).to(p.dtype))
        return loss


def _check_names(named_parameters, ordered):
    """Horovod's checks on named_parameters; returns {parameter: name}."""
    if named_parameters is None:
        return {p: "noname.%d" % i for i, p in enumerate(ordered)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters()")
    if any(not isinstance(p, torch.Tensor) for _, p in named):
        raise ValueError("named_parameters should consistently be a sequence of tuples (name, torch.Tensor)")
    seen, duplicates = set(), set()
    for name, _ in named:
        (duplicates if name in seen else seen).add(name)
    if duplicates:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: %s"
                         % ", ".join(sorted(duplicates)))
    names = {p: name for name, p in named}
    unnamed = [p for p in ordered if p not in names]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not "
                         "named. Python object ids: %s" % ", ".join(str(id(p)) for p in unnamed))
    return names


def _assign_groups(groups, ordered):
    """{parameter: group index or None}. An int splits the parameters, in
    order, into that many groups as every framework's num_groups does
    (unison.arguments.split_into_groups); lists name groups explicitly, and
    a parameter in none of them is allreduced on its own."""
    if groups is None or (not isinstance(groups, list) and groups == 0):
        return {p: None for p in ordered}
    if not isinstance(groups, list):
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 0:
            raise ValueError("groups must be a non-negative integer or a list of lists of parameters")
        return {p: index for index, members in enumerate(split_into_groups(ordered, groups)) for p in members}
    assignment = {p: None for p in ordered}
    for index, members in enumerate(groups):
        for p in members:
            if not isinstance(p, torch.Tensor):
                raise ValueError("groups must consist of torch.Tensor")
            if p not in assignment:
                raise ValueError("groups names a tensor that is not a parameter of this optimizer")
            if assignment[p] is not None:
                raise ValueError("a parameter can only appear once in groups")
            assignment[p] = index
    return assignment


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=global_process_set):
    """Wraps a torch optimizer so that step() uses gradients averaged (op)
    over the ranks, as Horovod's does: each gradient's allreduce starts
    from its hook as backward produces it, and step() waits for them.

    Args:
        optimizer: the torch optimizer to wrap (any torch.optim optimizer, LBFGS included); its
            state, if it has any, carries over.
        named_parameters: the model's named_parameters(), so that each gradient's allreduce is
            named after its parameter; where None, names are made from the parameters' order.
        compression: Compression.none or Compression.fp16 for the gradients on the wire.
        backward_passes_per_step: how many backward passes accumulate locally before the
            gradients are averaged (gradient accumulation).
        op: Average (the default), Sum or Adasum (which combines each rank's update, not its
            gradient).
        gradient_predivide_factor: divides the gradients by this before the sum and by size /
            this after it (Average only).
        num_groups: Horovod's older spelling of an integer `groups`.
        groups: an integer (that many fused groups of gradients) or a list of lists of
            parameters, each allreduced as one group.
        sparse_as_dense: allreduce sparse gradients as dense tensors.
        process_set: the ranks that average; on a rank outside it, a plain local optimizer.

    Raises:
        ValueError: gradient_predivide_factor with an op other than Average, or
            backward_passes_per_step below 1.
        InvalidArgumentError: at step(), a gradient changed while its allreduce was in flight
            (clipping or unscaling without synchronize() first), naming the parameters."""
    check_compressor(compression, "DistributedOptimizer")
    if num_groups and groups is None:
        groups = num_groups
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be at least 1")
    base = optimizer.__class__
    if op == Adasum and process_set.size() > 1 and process_set.included():
        cls = type(base.__name__, (_DistributedAdasumOptimizer, base), {})
        wrapped = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
                      process_set)
    else:
        cls = type(base.__name__, (_DistributedOptimizer, base), {})
        wrapped = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
                      gradient_predivide_factor, groups, sparse_as_dense, process_set)
    wrapped.defaults = optimizer.defaults  # for param groups added later
    if optimizer.state:
        wrapped.load_state_dict(optimizer.state_dict())
    return wrapped
