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
    """One options struct and handle slot per thread, reused by every
    enqueue: the core copies what it needs before returning. A model's
    gradients are enqueued one by one, each call costing a few
    microseconds of Python, so the front end keeps per thread what repeats
    from call to call instead of rebuilding it: the C strings of names, the
    C arrays of shapes, and the fields that rarely change."""

    def __init__(self):
        self.options = ffi.new("unison_op_options*")
        self.handle = ffi.new("unison_handle*")
        self.names = {}   # name -> char[]
        self.shapes = {}  # shape tuple -> int64_t[]
        self.rare = None  # (root_rank, process set id, device) last set


_scratch = _Scratch()
_MAX_DIMS = lib.UNISON_MAX_DIMS
_KEPT = 4096  # names and shapes kept per thread; beyond, built per call


def _c_name(scratch, name):
    c_name = scratch.names.get(name)
    if c_name is None:
        c_name = ffi.new("char[]", name.encode())
        if len(scratch.names) < _KEPT:
            scratch.names[name] = c_name
    return c_name


def _c_shape(scratch, shape):
    c_shape = scratch.shapes.get(shape)
    if c_shape is None:
        c_shape = ffi.new("int64_t[]", [int(d) for d in shape] or [0])
        if len(scratch.shapes) < _KEPT:
            scratch.shapes[shape] = c_shape
    return c_shape


def enqueue(op, name, dtype=0, shape=(), input=NULL, output=NULL, reduce_op=0,
            prescale_factor=1.0, postscale_factor=1.0, root_rank=0, splits=None,
            process_set=None, device=-1):
    """Starts one collective and returns the core's handle id.

    input and output are cffi pointers (or NULL); `name` may be None for an
    automatically numbered one; `shape` a tuple (or list) of ints."""
    scratch = _scratch
    options = scratch.options
    ndim = len(shape)
    if ndim > _MAX_DIMS:
        raise InvalidArgumentError("unison: %s has %d dimensions; at most %d are supported"
                                   % (name or "a tensor", ndim, _MAX_DIMS))
    options.name = _c_name(scratch, name) if name else NULL
    options.op = op
    options.dtype = dtype
    options.ndim = ndim
    options.shape = _c_shape(scratch, tuple(shape)) if ndim else NULL
    options.input = input
    options.output = output
    options.reduce_op = reduce_op
    options.prescale_factor = prescale_factor
    options.postscale_factor = postscale_factor
    rare = (root_rank, 0 if process_set is None else process_set_id(process_set), device)
    if splits is not None or rare != scratch.rare:
        scratch.rare = None  # until every field below is set
        splits_array = NULL
        if splits is not None:
            splits_array = ffi.new("int64_t[]", [int(s) for s in splits])
        options.root_rank, options.process_set_id, options.device = rare
        options.splits = splits_array
        options.nsplits = len(splits) if splits is not None else 0
        if splits is None:  # splits_array dies with this call
            scratch.rare = rare
    code = lib.unison_enqueue(options, scratch.handle)
    if code:
        basics.check(code)
    return scratch.handle[0]
