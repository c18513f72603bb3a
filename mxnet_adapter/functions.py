"""Broadcast helpers for MXNet: every rank starts from root_rank's
parameters, including Gluon parameters whose initialisation is deferred
until the first forward pass. Objects go by pickle (unison.objects)."""
import types

import mxnet as mx

from unison.mxnet.ops import broadcast_
from unison.process_sets import global_process_set
from unison.objects import allgather_object, broadcast_object  # noqa: F401


def _broadcast_after_init(param, root_rank, name, process_set):
    """Wraps a deferred parameter's initialisation so that, the moment it is
    initialised (at its first forward pass, on every rank in the same
    order), root_rank's values are broadcast into it."""
    initialise = param._init_impl

    def init_then_broadcast(self, *args, **kwargs):
        initialise(*args, **kwargs)
        broadcast_(self.data(), root_rank=root_rank, name=name, process_set=process_set)
    param._init_impl = types.MethodType(init_then_broadcast, param)


def broadcast_parameters(params, root_rank=0, prefix=None, process_set=global_process_set):
    """Overwrites every rank's parameters with root_rank's. `params` is a
    dict of NDArrays or Parameters (such as `net.collect_params()`, a
    ParameterDict). With a process set, among its ranks only (root_rank is
    a global rank in it).

    Parameters are matched across ranks by their place in `params`, not by
    key: Gluon prefixes keys from a per-process counter, so a rank that
    built one more block first has other keys ("dense10_weight" for
    "dense9_weight", which also sorts elsewhere) for the same network. A
    ParameterDict lists them in the order the network registered them."""
    if not isinstance(params, (dict, mx.gluon.ParameterDict)):
        raise ValueError("unison.mxnet.broadcast_parameters: params must be a dict or a ParameterDict, got %s"
                         % type(params).__name__)
    prefix = prefix if prefix is not None else ""
    ready = []
    for index, value in enumerate(params.values()):
        label = "%sbroadcast.%d" % (prefix, index)
        if isinstance(value, mx.gluon.Parameter):
            try:
                value = value.data()
            except mx.gluon.parameter.DeferredInitializationError:
                _broadcast_after_init(value, root_rank, label, process_set)
                continue
        ready.append((label, value))
    for label, tensor in ready:
        broadcast_(tensor, root_rank, name=label, process_set=process_set)
