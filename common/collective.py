"""Building the core's op options, shared by every front end: a front end
turns its tensors into (pointer, dtype code, shape) and calls enqueue()."""
import threading

from unison import basics
from unison.process_sets import process_set_id
from unison.exceptions import InvalidArgumentError
from unison._native import ffi, lib

NULL = ffi.NULL


def resolve_op(op, average, default=basics.Average):
    """Horovod's rules: `op` wins; the deprecated `average` flag maps to
    Average or Sum; neither means the default."""
    if op is not None and average is not None:
        raise InvalidArgumentError("unison: give op or the deprecated average, not both")
    if op is not None:
        return op
    if average is not None:
        return basics.Average if average else basics.Sum
    return default


def split_into_groups(items, num_groups):
    """num_groups consecutive groups of near-equal length (the first ones
    one longer when it does not divide), empty ones left out: Horovod's
    num_groups for the optimizer wrappers of every framework."""
    groups, start = [], 0
    for g in range(num_groups):
        length = len(items) // num_groups + (1 if g < len(items) % num_groups else 0)
        if length:
            groups.append(items[start:start + length])
        start += length
    return groups


class _Scratch(threading.local):
    """One options struct, shape array and handle slot per thread, reused
    by every enqueue: the core copies what it needs before returning, and
    skipping three allocations per call is a third of the front end's cost
    when a model's gradients are enqueued one by one."""

    def __init__(self):
        self.options = ffi.new("unison_op_options*")
        self.shape = ffi.new("int64_t[%d]" % lib.UNISON_MAX_DIMS)
        self.handle = ffi.new("unison_handle*")
        # Training enqueues the same names every step; their C strings are
        # kept (for this thread, up to a bound) instead of built each time.
        self.names = {}


_scratch = _Scratch()
_NAMES_KEPT = 4096


def _c_name(scratch, name):
    c_name = scratch.names.get(name)
    if c_name is None:
        c_name = ffi.new("char[]", name.encode())
        if len(scratch.names) < _NAMES_KEPT:
            scratch.names[name] = c_name
    return c_name


def enqueue(op, name, dtype=0, shape=(), input=NULL, output=NULL, reduce_op=0,
            prescale_factor=1.0, postscale_factor=1.0, root_rank=0, splits=None,
            process_set=None, device=-1):
    """Starts one collective and returns the core's handle id.

    input and output are cffi pointers (or NULL); `name` may be None for an
    automatically numbered one."""
    scratch = _scratch
    options = scratch.options
    ndim = len(shape)
    if ndim > lib.UNISON_MAX_DIMS:
        raise InvalidArgumentError("unison: %s has %d dimensions; at most %d are supported"
                                   % (name or "a tensor", ndim, lib.UNISON_MAX_DIMS))
    for i, d in enumerate(shape):
        scratch.shape[i] = int(d)
    c_name = _c_name(scratch, name) if name else NULL
    options.name = c_name
    options.op = op
    options.dtype = dtype
    options.ndim = ndim
    options.shape = scratch.shape if ndim else NULL
    options.input = input
    options.output = output
    options.reduce_op = reduce_op
    options.prescale_factor = prescale_factor
    options.postscale_factor = postscale_factor
    options.root_rank = root_rank
    splits_array = NULL
    if splits is not None:
        splits_array = ffi.new("int64_t[]", [int(s) for s in splits])
    options.splits = splits_array
    options.nsplits = len(splits) if splits is not None else 0
    options.process_set_id = process_set_id(process_set)
    options.device = device
    basics.check(lib.unison_enqueue(options, scratch.handle))
    return scratch.handle[0]
