"""What `hvd.allreduce` and the other collectives become inside torch.compile.

When TorchDynamo traces a call to one of unison.torch's collectives, the
function it reaches (ops.py) hands over to its namesake here, and Dynamo
traces this file: plain Python on the call's constant arguments (the op,
the name, the process set's id), ending in one of the `unison::`
operators (registered_ops.py), which becomes a node of the graph. The
rest of unison, but for the argument rules and the compressors (plain
Python), stays on Dynamo's skip list (compiled_code.py).

Horovod's async forms work inside a compiled function too: a collective
started there is a node that starts it (unison::allreduce_start and its
kin), and synchronize() is the node that waits for it and gives its
result (unison::wait), so the graph runs whatever lies between the two
while the collective is in flight, and ranks may start and wait in
different orders, as in eager code; an in-place one is copied back at the
wait. poll() is not traced.

The functions take Horovod's arguments, as ops.py's do; called outside
torch.compile they run the same operators eagerly.
"""
import torch

from unison.arguments import member_names, resolve_op, split_counts
from unison.basics import Average
from unison.compression import compress_all
from unison.exceptions import InvalidArgumentError
from unison.handles import synchronize as _wait_for
from unison.process_sets import global_process_set
from unison.torch import registered_ops
from unison.torch.compression import Compression

_ops = torch.ops.unison
# The sequence the next collective is given: the one the last returned
# (registered_ops says why). Dynamo makes it an input of each compiled
# graph and the last collective's one a result, stored back here.
SEQUENCE = registered_ops.new_sequence()


def run(operator, *args):
    """operator(SEQUENCE, *args), keeping the sequence it returns last; its
    other results (one, several, or None)."""
    global SEQUENCE
    out = operator(SEQUENCE, *args)
    if not isinstance(out, (tuple, list)):
        SEQUENCE = out
        return None
    SEQUENCE = out[-1]
    return out[0] if len(out) == 2 else out[:-1]


def _set_id(process_set):
    if process_set is None:
        return 0
    if process_set.process_set_id is None:
        raise InvalidArgumentError("unison: %r is not registered: pass it to init(process_sets=[...]) or "
                                   "add_process_set()" % (process_set,))
    return process_set.process_set_id


def _decompress(compression, tensors, contexts):
    return [compression.decompress(t, c) for t, c in zip(tensors, contexts)]


# The forms of Horovod's API here; ops.py hands each over while Dynamo traces.
__all__ = ["allreduce", "grouped_allreduce", "allreduce_", "grouped_allreduce_", "allreduce_async",
           "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_", "synchronize", "allgather",
           "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_",
           "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
           "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "barrier"]


class Started:
    """The handle of a collective started in a compiled function: the
    core's handle id, as a graph tensor, and what the wait needs to know of
    the result (unison::wait's `like` and `rows`, or an alltoall's set).
    An in-place one's result is copied into `target` at the wait."""

    def __init__(self, handle, like, rows=None, target=None, alltoall_set=None, with_splits=False):
        self.handle = handle
        self.like = like
        self.rows = rows
        self.target = target
        self.alltoall_set = alltoall_set
        self.with_splits = with_splits

    def wait(self):
        if self.alltoall_set is not None:
            output, received = run(_ops.wait_alltoall, self.handle, self.like, self.alltoall_set)
            return (output, received) if self.with_splits else output
        result = run(_ops.wait, self.handle, self.like, self.rows)
        if self.target is None:
            return result
        self.target.copy_(result)
        return self.target


class StartedGroup:
    """The handle of a grouped collective started in a compiled function."""

    def __init__(self, members):
        self.members = members


# ---- allreduce ------------------------------------------------------------------

# Dynamo traces every frame below at each compile, and a collective of a
# new name compiles anew: the uncompressed allreduce and reducescatter
# (nearly every call) reach their operator directly, not through the
# grouped forms and the compressor, which took a quarter of their compile
# (43 ms to 33 ms for an allreduce on the 2-core VM). Same operator, same
# arguments.

def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    if compression is Compression.none:
        return run(_ops.allreduce, tensor, name, resolve_op(op, average), prescale_factor, postscale_factor,
                   _set_id(process_set))
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor, postscale_factor,
                             process_set)[0]


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    wires, contexts = compress_all(compression, tensors)
    op = resolve_op(op, average)
    if len(wires) == 1:
        reduced = [run(_ops.allreduce, wires[0], name, op, prescale_factor, postscale_factor,
                        _set_id(process_set))]
    else:
        reduced = run(_ops.grouped_allreduce, wires, name, op, prescale_factor, postscale_factor,
                       _set_id(process_set))
    return _decompress(compression, reduced, contexts)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    run(_ops.allreduce_, tensor, name, resolve_op(op, average), prescale_factor, postscale_factor, _set_id(process_set))
    return tensor


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    op, set_id = resolve_op(op, average), _set_id(process_set)
    for tensor, member in zip(tensors, member_names(name, len(tensors))):
        run(_ops.allreduce_, tensor, member, op, prescale_factor, postscale_factor, set_id)
    return list(tensors)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    handle = run(_ops.allreduce_start, tensor, name, resolve_op(op, average), prescale_factor, postscale_factor,
                  _set_id(process_set))
    return Started(handle, tensor)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    handle = run(_ops.allreduce_start, tensor, name, resolve_op(op, average), prescale_factor, postscale_factor,
                  _set_id(process_set))
    return Started(handle, tensor, target=tensor)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set):
    return StartedGroup([allreduce_async(t, average, member, op, prescale_factor, postscale_factor, process_set)
                         for t, member in zip(tensors, member_names(name, len(tensors)))])


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set):
    return StartedGroup([allreduce_async_(t, average, member, op, prescale_factor, postscale_factor, process_set)
                         for t, member in zip(tensors, member_names(name, len(tensors)))])


def synchronize(handle):
    if isinstance(handle, Started):
        return handle.wait()
    if isinstance(handle, StartedGroup):
        return [member.wait() for member in handle.members]
    return _wait_for(handle)   # a handle of the Python API, given outside torch.compile


# ---- allgather, broadcast, alltoall, reducescatter, barrier -----------------------

def allgather(tensor, name=None, process_set=global_process_set):
    return run(_ops.allgather, tensor, name, _set_id(process_set))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    set_id = _set_id(process_set)
    return [run(_ops.allgather, t, member, set_id) for t, member in zip(tensors, member_names(name, len(tensors)))]


def allgather_async(tensor, name=None, process_set=global_process_set):
    return Started(run(_ops.allgather_start, tensor, name, _set_id(process_set)), tensor, rows=-1)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    return StartedGroup([allgather_async(t, member, process_set)
                         for t, member in zip(tensors, member_names(name, len(tensors)))])


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    return run(_ops.broadcast, tensor, root_rank, name, _set_id(process_set))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    run(_ops.broadcast_, tensor, root_rank, name, _set_id(process_set))
    return tensor


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    return Started(run(_ops.broadcast_start, tensor, root_rank, name, _set_id(process_set)), tensor)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    return Started(run(_ops.broadcast_start, tensor, root_rank, name, _set_id(process_set)), tensor,
                   target=tensor)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    output, received = run(_ops.alltoall, tensor, split_counts(splits, name), name, _set_id(process_set))
    return output if splits is None else (output, received)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """synchronize() gives (output, received splits), as the Python API's."""
    set_id = _set_id(process_set)
    handle = run(_ops.alltoall_start, tensor, split_counts(splits, name), name, set_id)
    return Started(handle, tensor, alltoall_set=set_id, with_splits=True)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0, splits=None):
    if splits is None and compression is Compression.none:
        return run(_ops.reducescatter, tensor, name, op, prescale_factor, postscale_factor, _set_id(process_set))
    if splits is None:
        return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor,
                                     postscale_factor)[0]
    wires, contexts = compress_all(compression, [tensor])
    scattered = run(_ops.reducescatter, wires[0], name, op, prescale_factor, postscale_factor,
                     _set_id(process_set), split_counts(splits, name, "reducescatter"))
    return _decompress(compression, [scattered], contexts)[0]


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    wires, contexts = compress_all(compression, tensors)
    set_id = _set_id(process_set)
    scattered = [run(_ops.reducescatter, w, member, op, prescale_factor, postscale_factor, set_id)
                 for w, member in zip(wires, member_names(name, len(wires)))]
    return _decompress(compression, scattered, contexts)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0, splits=None):
    # This rank's share of the rows depends on its rank in the set, which
    # only the core knows: the wait's result has a dynamic first dimension.
    handle = run(_ops.reducescatter_start, tensor, name, op, prescale_factor, postscale_factor,
                  _set_id(process_set), split_counts(splits, name, "reducescatter"))
    return Started(handle, tensor, rows=-1)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    return StartedGroup([reducescatter_async(t, member, op, process_set, prescale_factor, postscale_factor)
                         for t, member in zip(tensors, member_names(name, len(tensors)))])


def barrier(process_set=global_process_set):
    run(_ops.barrier, _set_id(process_set if process_set is not None else global_process_set))

