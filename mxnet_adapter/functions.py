"""Broadcast helpers for MXNet: every rank starts from root_rank's
parameters, including Gluon parameters whose initialisation is deferred
until the first forward pass; and picklable objects between ranks."""
import pickle
import types

import mxnet as mx
import numpy as np

import unison.numpy as unp
from unison import basics
from unison.process_sets import global_process_set
from unison.mxnet.ops import broadcast_


def _broadcast_after_init(param, root_rank, name):
    """Wraps a deferred parameter's initialisation so that, the moment it is
    initialised (at its first forward pass, on every rank in the same
    order), root_rank's values are broadcast into it."""
    initialise = param._init_impl

    def init_then_broadcast(self, *args, **kwargs):
        initialise(*args, **kwargs)
        broadcast_(self.data(), root_rank=root_rank, name=name)
    param._init_impl = types.MethodType(init_then_broadcast, param)


def broadcast_parameters(params, root_rank=0, prefix=None):
    """Overwrites every rank's parameters with root_rank's, in sorted name
    order. `params` is a dict of NDArrays or Parameters (such as
    `net.collect_params()`, a ParameterDict)."""
    if not isinstance(params, (dict, mx.gluon.ParameterDict)):
        raise ValueError("unison.mxnet.broadcast_parameters: params must be a dict or a ParameterDict, got %s"
                         % type(params).__name__)
    prefix = prefix if prefix is not None else ""
    ready = []
    for name, value in sorted(params.items()):
        label = "%sbroadcast.%s" % (prefix, name)
        if isinstance(value, mx.gluon.Parameter):
            try:
                value = value.data()
            except mx.gluon.parameter.DeferredInitializationError:
                _broadcast_after_init(value, root_rank, label)
                continue
        ready.append((label, value))
    for label, tensor in ready:
        broadcast_(tensor, root_rank, name=label)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """root_rank's `obj` on every rank (pickled)."""
    name = name or "broadcast_object"
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if basics.rank() == root_rank else None
    length = np.array([payload.size if payload is not None else 0], dtype=np.int64)
    unp.broadcast_(length, root_rank, name=name + ".length", process_set=process_set)
    buffer = payload.copy() if payload is not None else np.empty(int(length[0]), dtype=np.uint8)
    unp.broadcast_(buffer, root_rank, name=name + ".payload", process_set=process_set)
    return obj if basics.rank() == root_rank else pickle.loads(buffer.tobytes())


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's `obj`, in rank order."""
    name = name or "allgather_object"
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    lengths = unp.allgather(np.array([payload.size], dtype=np.int64), name=name + ".lengths",
                            process_set=process_set)
    gathered = unp.allgather(payload, name=name + ".payload", process_set=process_set)
    objects, offset = [], 0
    for length in lengths.tolist():
        objects.append(pickle.loads(gathered[offset:offset + length].tobytes()))
        offset += length
    return objects
