"""Starting ops in the core, shared by every front end: a front end turns
its tensors into (pointer, dtype code, shape) and calls enqueue(); barrier
and join, which carry no tensor, are here whole."""
import contextlib
import math
import numbers
import threading

from unison import basics
from unison import handles as _handles
from unison.process_sets import process_set_id
from unison.exceptions import InvalidArgumentError
from unison._native import ffi, lib

NULL = ffi.NULL
HOST = (lib.UNISON_CPU_DEVICE, NULL)   # the placement of tensors in host memory


class _Scratch(threading.local):
    """Per thread: the options structs of recent ops, and one handle slot.

    A model's gradients are enqueued one by one, every step, under the same
    names and shapes, so each call's Python cost is paid per tensor per
    step. The front end therefore keeps, per thread, one fully filled
    options struct for each distinct op it has seen (name, shape, dtype,
    reduce op, factors, root, process set, device): a repeat call only
    points it at this call's buffers. The core copies what it needs before
    unison_enqueue returns, so the structs can be reused at once."""

    def __init__(self):
        self.handle = ffi.new("unison_handle*")
        self.prepared = {}  # key (see enqueue) -> (options, the C memory it points to...)
        # The same for in-place allreduces, keyed by the front end
        # (FrontEnd.allreduce_async_), which checks each distinct op once.
        self.in_place = {}
        self.group = None  # inside enqueued_together(): the handle ids enqueued so far
        self.unnamed = None  # inside numbered_within(): [prefix, ops named so far]


_scratch = _Scratch()
_enqueue = lib.unison_enqueue
_MAX_DIMS = lib.UNISON_MAX_DIMS
_KEPT = 4096  # prepared ops kept per thread; beyond, built per call
_INT32_MIN, _INT32_MAX = -2 ** 31, 2 ** 31 - 1   # the C struct's root_rank


def prepare(op, name, dtype, shape, reduce_op, prescale_factor, postscale_factor, root_rank, splits,
            process_set, device):
    """A filled options struct, with the C memory it points to. Built once
    per distinct op (enqueue keeps it), so its checks cost a repeat nothing."""
    if name is not None and not isinstance(name, str):
        raise TypeError("unison: name must be a string, got %r (%s)" % (name, type(name).__name__))
    if name and "\0" in name:
        # C would cut the name there: two ops would meet under one name.
        raise InvalidArgumentError("unison: name %r contains a NUL character" % (name,))
    if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral):
        raise TypeError("unison: %s: root_rank must be an integer, got %r" % (name or "a tensor", root_rank))
    if not _INT32_MIN <= root_rank <= _INT32_MAX:
        raise InvalidArgumentError("unison: %s: root_rank %d is not a rank" % (name or "a tensor", root_rank))
    for factor, value in (("prescale_factor", prescale_factor), ("postscale_factor", postscale_factor)):
        # Anything float() takes but text: a numpy or 0-d framework scalar too.
        try:
            number = float(value) if not isinstance(value, (str, bytes)) else None
        except (TypeError, ValueError):
            number = None
        if number is None:
            raise TypeError("unison: %s: %s must be a number, got %r (%s)"
                            % (name or "a tensor", factor, value, type(value).__name__))
        if not math.isfinite(number):
            raise InvalidArgumentError("unison: %s: %s=%r is not a finite number" % (name or "a tensor", factor, value))
    if splits is not None:
        try:
            integers = not isinstance(splits, (str, bytes)) and all(
                isinstance(split, numbers.Integral) and not isinstance(split, bool) for split in splits)
        except TypeError:  # not a sequence at all
            integers = False
        if not integers:
            raise TypeError("unison: %s: splits must be integers, got %r" % (name or "a tensor", splits))
    ndim = len(shape)
    if ndim > _MAX_DIMS:
        raise InvalidArgumentError("unison: %s has %d dimensions; at most %d are supported"
                                   % (name or "a tensor", ndim, _MAX_DIMS))
    options = ffi.new("unison_op_options*")
    c_name = ffi.new("char[]", name.encode()) if name else NULL
    c_shape = ffi.new("int64_t[]", [int(d) for d in shape]) if ndim else NULL
    c_splits = ffi.new("int64_t[]", [int(s) for s in splits]) if splits is not None else NULL
    options.name = c_name
    options.op = op
    options.dtype = dtype
    options.ndim = ndim
    options.shape = c_shape
    options.reduce_op = reduce_op
    options.prescale_factor = float(prescale_factor)
    options.postscale_factor = float(postscale_factor)
    options.root_rank = root_rank
    options.splits = c_splits
    options.nsplits = len(splits) if splits is not None else 0
    options.process_set_id = process_set
    options.device = device
    return options, c_name, c_shape, c_splits


def enqueue(op, name, dtype=0, shape=(), input=NULL, output=NULL, reduce_op=0,
            prescale_factor=1.0, postscale_factor=1.0, root_rank=0, splits=None,
            process_set=None, placement=HOST, output_bytes=0, input_ready=NULL, placeholder=False):
    """Starts one collective and returns the core's handle id.

    input and output are cffi pointers (or NULL); output_bytes is the
    capacity of an allgather's, alltoall's or reducescatter's output where
    the caller gives one; input_ready, an int32_t* that the input's producer
    sets non-zero once it has finished (unison.h), or NULL: ready now;
    `name` may be None for an automatically numbered one; `shape` a tuple
    (or list) of ints; placement, (CUDA device, cffi pointer to the stream
    that produces the input and uses the output) for GPU tensors, HOST for
    host memory; placeholder, for an allreduce or reducescatter whose input
    is zeros standing in for a tensor this rank does not have (unison.h)."""
    scratch = _scratch
    device = placement[0]
    if not isinstance(shape, tuple):
        shape = tuple(shape)
    process_set = 0 if process_set is None else process_set_id(process_set)
    if not name and scratch.unnamed is not None:
        name = name_of_unnamed()
    # Ops with no name (numbered by the core) never repeat, so they are
    # built per call.
    key = prepared = None
    if name:
        try:
            key = (op, name, dtype, shape, reduce_op, prescale_factor, postscale_factor, root_rank, process_set,
                   device, None if splits is None else tuple(splits))
            prepared = scratch.prepared.get(key)
        except TypeError:  # an argument of a wrong type: prepare() says which
            key = None
    if prepared is None:
        prepared = prepare(op, name, dtype, shape, reduce_op, prescale_factor, postscale_factor, root_rank,
                           splits, process_set, device)
        if key is not None and len(scratch.prepared) < _KEPT:
            scratch.prepared[key] = prepared
    options = prepared[0]
    options.input = input
    options.output = output
    options.output_bytes = output_bytes
    options.input_ready = input_ready
    options.stream = placement[1]
    options.placeholder = placeholder
    return start(options)


def start(options):
    """Hands a filled options struct to the core; returns the handle id."""
    scratch = _scratch
    handle = scratch.handle
    code = _enqueue(options, handle)
    if code:
        basics.check(code)
    if scratch.group is not None:
        scratch.group.append(handle[0])
    return handle[0]


def started(handle_id):
    """Notes an op that an adapter's compiled path enqueued itself, as
    start() notes its own: inside enqueued_together(), the group's."""
    group = _scratch.group
    if group is not None:
        group.append(handle_id)


def started_many(handle_ids):
    """started() for several ops."""
    group = _scratch.group
    if group is not None:
        group.extend(handle_ids)


def start_in_place(key, pointer, stream, prepared=None):
    """Starts this thread's prepared in-place allreduce `key` on the memory
    at `pointer`, produced on `stream` (NULL for host memory), and returns
    the core's handle id; None when this thread has not prepared `key`.
    `prepared` (from prepare()) is used instead, and kept for the key's
    repeats. Every gradient comes here every step: a lookup, three fields
    and the core's enqueue."""
    scratch = _scratch
    if prepared is None:
        try:
            prepared = scratch.in_place.get(key)
        except TypeError:  # an argument of a wrong type: the caller's prepare() says which
            return None
        if prepared is None:
            return None
    elif len(scratch.in_place) < _KEPT:
        try:
            scratch.in_place[key] = prepared
        except TypeError:  # not kept: an unhashable argument, which prepare() took (a list as splits)
            pass
    options = prepared[0]
    options.input = options.output = pointer
    options.stream = stream
    return start(options)


@contextlib.contextmanager
def enqueued_together():
    """The collectives enqueued inside are negotiated and fused as one
    group (unison_group_begin): the core holds them until the block ends.
    If the block raises, none of them starts, so a grouped call that
    refuses its fifth tensor leaves no stray ops in flight."""
    basics.check(lib.unison_group_begin())
    scratch = _scratch
    outer, scratch.group = scratch.group, []
    failed = True
    try:
        yield
        failed = False
    finally:
        started, scratch.group = scratch.group, outer
        lib.unison_group_end(1 if failed else 0)
        if outer is not None:  # the outermost group starts them, or not
            outer.extend(started)
        elif failed:  # their handles failed at once; nobody will wait for them
            for handle_id in started:
                _handles.forget(handle_id)


@contextlib.contextmanager
def numbered_within(prefix):
    """Unnamed ops enqueued by this thread inside the block are named
    prefix.0, prefix.1, ... in the order enqueued, rather than numbered by
    the core in the order of the whole program. For a caller whose ops may
    start in a different order on each rank, such as the nodes of a TF1
    session graph, which TensorFlow runs in whatever order their inputs
    allow: `prefix` must name the same place in the program on every rank."""
    scratch = _scratch
    outer, scratch.unnamed = scratch.unnamed, [prefix, 0]
    try:
        yield
    finally:
        scratch.unnamed = outer


def name_of_unnamed():
    """The name numbered_within() gives this thread's next unnamed op;
    None outside it (the core numbers the op)."""
    unnamed = _scratch.unnamed
    if unnamed is None:
        return None
    unnamed[1] += 1
    return "%s.%d" % (unnamed[0], unnamed[1] - 1)


def barrier(process_set=None, name="barrier"):
    """Returns once every rank of the process set has called barrier()
    with this name. unison's own barriers have names of their own, so
    that one can never pair with a barrier a script placed elsewhere."""
    handle_id = enqueue(lib.UNISON_BARRIER, name, process_set=process_set)
    _handles.synchronize(_handles.Handle(handle_id, name, (), lambda _: None))


def join(process_set=None):
    """Declares this rank out of data and waits until every rank has; returns
    the rank that joined last, the same on every rank."""
    handle_id = enqueue(lib.UNISON_JOIN, "join", process_set=process_set)
    return _handles.synchronize(_handles.Handle(handle_id, "join", (), _handles.join_rank))
