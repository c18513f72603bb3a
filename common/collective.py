"""Building the core's op options, shared by every front end: a front end
turns its tensors into (pointer, dtype code, shape) and calls enqueue()."""
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


def enqueue(op, name, dtype=0, shape=(), input=NULL, output=NULL, reduce_op=0,
            prescale_factor=1.0, postscale_factor=1.0, root_rank=0, splits=None,
            process_set=None, device=-1):
    """Starts one collective and returns the core's handle id.

    input and output are cffi pointers (or NULL); `name` may be None for an
    automatically numbered one."""
    options = ffi.new("unison_op_options*")
    name_bytes = ffi.new("char[]", name.encode()) if name else NULL
    shape_array = ffi.new("int64_t[]", [int(d) for d in shape]) if len(shape) else NULL
    options.name = name_bytes
    options.op = op
    options.dtype = dtype
    options.ndim = len(shape)
    options.shape = shape_array
    options.input = input
    options.output = output
    options.reduce_op = reduce_op
    options.prescale_factor = prescale_factor
    options.postscale_factor = postscale_factor
    options.root_rank = root_rank
    if splits is not None:
        splits_array = ffi.new("int64_t[]", [int(s) for s in splits])
        options.splits = splits_array
        options.nsplits = len(splits)
    options.process_set_id = process_set_id(process_set)
    options.device = device
    handle = ffi.new("unison_handle*")
    basics.check(lib.unison_enqueue(options, handle))
    return handle[0]
