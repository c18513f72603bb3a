"""Broadcast helpers: make every rank start from rank root's model and
optimizer, and move arbitrary picklable objects between ranks."""
import io
import pickle

import torch

from unison import basics, objects
from unison.handles import synchronize
from unison.process_sets import global_process_set
from unison.torch.ops import broadcast_async_


def broadcast_parameters(params, root_rank, prefix="broadcast", process_set=global_process_set):
    """Overwrites every rank's parameters with root_rank's, in place. `params`
    is a state_dict(), named_parameters(), or a list of tensors. With a
    process set, among its ranks only (root_rank is a global rank in it)."""
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    handles = []
    for i, (name, tensor) in enumerate(items):
        if tensor is None or not isinstance(tensor, torch.Tensor):
            continue
        label = "%s.%s" % (prefix, name if name is not None else "param.%d" % i)
        handles.append(broadcast_async_(tensor, root_rank, name=label, process_set=process_set))
    for handle in handles:
        synchronize(handle)


def _dumps(obj, pickle_module):
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_module=pickle_module, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    return buffer.getvalue()


def _loads(data):
    return torch.load(io.BytesIO(data), weights_only=False)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """root_rank's `obj` on every rank, serialised by torch.save (tensors included; what has
    no importable name goes by value, through cloudpickle where it is installed).

    Args:
        obj: the object to send; read on the root only.
        root_rank: the global rank that sends, in the process set.
        name: what ranks match this call by; where None, one made from the call's order.
        process_set: the ranks that take part; every rank by default.

    Raises:
        InvalidArgumentError: the root's object cannot be serialised: on every rank, naming the
            rank and why (the root gets the serialiser's own exception).
        RankFailedError: a rank of the set died or stopped answering."""
    return objects.broadcast_object(obj, root_rank, name, process_set, _dumps, _loads)


def allgather_object(obj, name=None, process_set=global_process_set):
    """The list of every rank's `obj`, in rank order, serialised as broadcast_object does.

    Raises:
        InvalidArgumentError: some rank's object cannot be serialised: on every rank, naming each
            such rank and why.
        RankFailedError: a rank of the set died or stopped answering."""
    return objects.allgather_object(obj, name, process_set, _dumps, _loads)


def _initialize_state(optimizer):
    """Gives a fresh optimizer the state its first step would create, by a
    step on zero gradients, leaving parameters as they were (weight decay
    and the like would otherwise move them) and existing gradients too."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    saved = [(p.detach().clone(), p.grad) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    step = optimizer.step
    # A DistributedOptimizer's step would allreduce; the base class's does not.
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim"):
            step = cls.step.__get__(optimizer)
            break
    step()
    # As Horovod: a parameter that had no gradient keeps the zeros it was
    # given, so code that reads .grad after this finds a tensor, not None.
    with torch.no_grad():
        for p, (value, grad) in zip(params, saved):
            p.copy_(value)
            if grad is not None:
                p.grad = grad


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set):
    """Makes every rank's optimizer state (hyperparameters of every param
    group, and per-parameter state) equal to root_rank's. Works for every
    torch.optim optimizer, LBFGS included, initialised or not. On a rank
    outside process_set the optimizer keeps its own state: there a
    DistributedOptimizer of that set is a plain local optimizer, and a
    script calls this on every rank, as it builds the optimizer."""
    if not process_set.included():
        return
    if isinstance(optimizer, torch.optim.LBFGS):
        # LBFGS keeps lists of past directions and scalars under its one
        # parameter: its whole state goes as one object.
        state = broadcast_object(optimizer.state_dict(), root_rank, name="optimizer_state.lbfgs",
                                 process_set=process_set)
        if basics.rank() != root_rank:
            optimizer.load_state_dict(state)
        return
    if not optimizer.state:
        _initialize_state(optimizer)

    params = [p for group in optimizer.param_groups for p in group["params"]]
    # What root has, tensors described by shape, dtype and whether they sit
    # with their parameter (on its GPU, say) or on the CPU (Adam's step
    # count), the rest by value.
    def describe(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype, value.device.type == "cpu")
        return ("value", value)
    layout = {
        "groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
        "state": [{key: describe(value) for key, value in optimizer.state.get(p, {}).items()} for p in params],
    }
    layout = broadcast_object(layout, root_rank, name="optimizer_state.layout", process_set=process_set)

    for group, options in zip(optimizer.param_groups, layout["groups"]):
        group.update(options)
    handles = []
    for index, (p, described) in enumerate(zip(params, layout["state"])):
        state = optimizer.state[p]
        for key in [k for k in state if k not in described]:
            del state[key]
        for key, what in sorted(described.items(), key=lambda kv: str(kv[0])):
            if what[0] == "value":
                state[key] = what[1]
                continue
            _, shape, dtype, on_cpu = what
            device = torch.device("cpu") if on_cpu else p.device
            current = state.get(key)
            if (not isinstance(current, torch.Tensor) or tuple(current.shape) != shape or current.dtype != dtype
                    or current.device != device):
                current = state[key] = torch.zeros(shape, dtype=dtype, device=device)
            handles.append(broadcast_async_(current, root_rank, name="optimizer_state.%d.%s" % (index, key),
                                            process_set=process_set))
    for handle in handles:
        synchronize(handle)
