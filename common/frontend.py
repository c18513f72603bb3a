"""The one front end every framework shares.

A framework adapter describes its tensors with a small `Tensors` object
(dtype, shape, a pointer to contiguous memory, how to make an output and
how to adopt a buffer the core allocated); `FrontEnd` does everything else
once: argument checks, dtype codes, the core's op options, in-place
targets, handles and their results, and grouped ops (barrier and join,
which carry no tensor, are collective.py's). numpy,
torch and TensorFlow run their collectives through it; MXNet, whose
collectives start later on MXNet's own engine threads, shares its checks
(`prepare`) and enqueues from there.

The allreduce path is the one every gradient takes every step, so it does
the least: a dict lookup for the dtype, one tuple test for the op, and the
per-thread prepared options of collective.enqueue.
"""
from unison import arguments, collective, dtypes
from unison import handles as _handles
from unison.arguments import Adasum, Average
from unison.exceptions import InvalidArgumentError
from unison.handles import Handle, HandleGroup
from unison.process_sets import global_process_set, process_set_id, size_of
from unison._native import lib

_ALLREDUCE, _ALLGATHER, _BROADCAST, _ALLTOALL, _REDUCESCATTER = (
    lib.UNISON_ALLREDUCE, lib.UNISON_ALLGATHER, lib.UNISON_BROADCAST, lib.UNISON_ALLTOALL,
    lib.UNISON_REDUCESCATTER)
# Adasum goes the same way, after check_reduce has refused scale factors for it.
_PLAIN_ALLREDUCE_OPS = frozenset(arguments.ALLREDUCE_OPS) - {Adasum}


class Tensors:
    """One framework's tensors, as the front end needs to see them. The
    numpy front end's subclass (unison.numpy) is the reference."""

    def dtype_key(self, tensor):
        """A hashable stand-in for the tensor's dtype (the dtype itself)."""
        raise NotImplementedError

    def dtype_name(self, tensor):
        """numpy's name for the dtype: 'float32', 'bfloat16', 'uint16', 'bool'."""
        raise NotImplementedError

    def check(self, tensor, name):
        """Raises for a tensor the core cannot take (wrong type, device, layout)."""

    def placement(self, tensor):
        """Where the tensor's memory is: collective.HOST, or (CUDA device
        index, cffi pointer to the framework's current stream on it) for a
        GPU tensor: the core orders the collective after the work queued on
        that stream and the stream's later work after the collective."""
        return collective.HOST

    def readable(self, tensor):
        """The tensor's values in contiguous memory (the tensor itself when it is)."""
        raise NotImplementedError

    def shape(self, tensor):
        raise NotImplementedError

    def pointer(self, tensor):
        """A cffi pointer to the memory of a readable() tensor (NULL when empty)."""
        raise NotImplementedError

    def empty_like(self, tensor):
        raise NotImplementedError

    def writable(self, tensor, name):
        """(contiguous buffer the core may read and overwrite, finisher) for
        in-place ops: the finisher (handle id -> the caller's tensor) copies
        the result back when the buffer is a copy; None when the buffer is
        the caller's tensor itself."""
        raise NotImplementedError

    def in_place(self, tensor, name):
        """(buffer, finisher, dtype key, shape, pointer, placement) of an
        in-place op on a checked `tensor`: check(), writable() and the rest
        of the buffer's description in one call, because every gradient
        makes it every step. Adapters give a faster one for their common
        case, and fall back to this."""
        self.check(tensor, name)
        buffer, finish = self.writable(tensor, name)
        return buffer, finish, self.dtype_key(buffer), self.shape(buffer), self.pointer(buffer), self.placement(buffer)

    def adopt(self, owned, nbytes, shape, like):
        """A tensor of `like`'s dtype over the core-allocated `owned` memory."""
        raise NotImplementedError


_EMPTY_OUTPUT = collective.ffi.new("char[1]")   # where an empty output lives: nothing is written to it


def _set_id(process_set):
    """The core's id of `process_set`; the global set's (0) without a lookup,
    since nearly every call is on it."""
    return 0 if process_set is None or process_set is global_process_set else process_set_id(process_set)


class Prepared:
    """A checked op, ready to enqueue: what MXNet carries to its engine thread."""
    __slots__ = ("code", "shape")

    def __init__(self, code, shape):
        self.code, self.shape = code, shape


class FrontEnd:
    """`fast`, where an adapter has one, is its compiled starter of in-place
    allreduces (torch_adapter/fast_path.cc): start_in_place(tensor, name,
    op, prescale, postscale, process set id) gives the core's handle id,
    and allreduce_async_(the same) the op's Handle, or either gives None
    for an op it has not learned (learn(), with the same arguments and the
    dtype's code, after this front end has checked and started the op
    once) or a tensor it does not take; the front end then goes its own way.
    Where it has allreduce_many_(tensors, names, op, prescale, postscale,
    process set id), that starts the leading members of a grouped in-place
    allreduce the same way, inside the caller's group, and gives the
    Handles of those it started, stopping at the first it would decline."""

    def __init__(self, tensors, fast=None):
        self.tensors = tensors
        self.fast = fast
        self._codes = {}  # dtype key -> core code

    # ---- shared checks ---------------------------------------------------------

    def dtype_code(self, tensor, name):
        t = self.tensors
        t.check(tensor, name)
        key = t.dtype_key(tensor)
        code = self._codes.get(key)
        if code is None:
            code = self._codes[key] = dtypes.code_of(t.dtype_name(tensor), name)
        return code

    def prepare(self, collective_name, tensor, name, op=None, prescale_factor=1.0, postscale_factor=1.0):
        """Checks an op on `tensor` without starting it."""
        code = self.dtype_code(tensor, name)
        shape = tuple(self.tensors.shape(tensor))
        if collective_name in ("allreduce", "reducescatter"):
            arguments.check_reduce(collective_name, op, prescale_factor, postscale_factor, name)
        if collective_name in ("allgather", "alltoall", "reducescatter"):
            arguments.check_has_rows(collective_name, shape, name)
        return Prepared(code, shape)

    def _core_result(self, like):
        adopt = self.tensors.adopt

        def finish(handle_id):
            owned, nbytes, shape = _handles.result_buffer(handle_id)
            return adopt(owned, nbytes, shape, like)
        return finish

    # ---- allreduce ---------------------------------------------------------------

    def allreduce_async(self, tensor, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                        process_set=None, output=None):
        """A new tensor (or `output`), reduced across ranks."""
        code = self.dtype_code(tensor, name)
        if op not in _PLAIN_ALLREDUCE_OPS:
            arguments.check_reduce("allreduce", op, prescale_factor, postscale_factor, name)
        t = self.tensors
        source = t.readable(tensor)
        target = t.empty_like(source) if output is None else output
        pointer = t.pointer
        handle_id = collective.enqueue(_ALLREDUCE, name, code, t.shape(source), pointer(source), pointer(target),
                                       op, prescale_factor, postscale_factor, 0, None, process_set,
                                       t.placement(source))
        return Handle(handle_id, name, (tensor, source, target), None, target)

    def allreduce_async_(self, tensor, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                         process_set=None):
        """`tensor` itself, reduced across ranks in place.

        Every gradient takes this path every step, so a repeat costs one
        adapter call, one lookup and the core's enqueue: each distinct op
        (name, dtype, shape, op, factors, process set, device) is checked
        and its options filled once per thread, then only pointed at this
        call's memory and stream. An adapter's compiled path (`fast`)
        makes the Handle itself."""
        set_id = _set_id(process_set)
        fast = self.fast
        if fast is not None:
            handle = fast.allreduce_async_(tensor, name, op, prescale_factor, postscale_factor, set_id)
            if handle is not None:
                collective.started(handle.id)
                return handle
        handle_id, buffer, finish = self._start_in_place(tensor, name, op, prescale_factor, postscale_factor,
                                                         set_id, fast_tried=True)
        # Usually the buffer is the caller's tensor: then it is all the handle keeps.
        return Handle(handle_id, name, tensor if buffer is tensor else (tensor, buffer), finish,
                      tensor if finish is None else None)

    def allreduce_(self, tensor, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                   process_set=None):
        """allreduce_async_ and synchronize in one call. A blocking call
        needs no Handle: nobody else can wait for the op or drop it, so it
        waits on the core's handle id directly (handles.wait_in_place),
        which saves about a fifth of a small allreduce's Python cost."""
        set_id = _set_id(process_set)
        handle_id, buffer, finish = self._start_in_place(tensor, name, op, prescale_factor, postscale_factor, set_id)
        if finish is not None:  # the buffer is a copy, to be copied back
            return _handles.synchronize(Handle(handle_id, name, (tensor, buffer), finish))
        _handles.wait_in_place(handle_id, name, (tensor, buffer))
        return tensor

    def _start_in_place(self, tensor, name, op, prescale_factor, postscale_factor, set_id, fast_tried=False):
        """Enqueues an in-place allreduce in the process set of id `set_id`:
        (handle id, the buffer the core reduces, its finisher or None: see
        Tensors.writable). fast_tried: the caller's compiled path has
        declined this call already."""
        if name is None:
            name = collective.name_of_unnamed()
            fast_tried = False   # a name of numbered_within's, which the compiled path may know
        fast = self.fast
        if fast is not None and not fast_tried:
            handle_id = fast.start_in_place(tensor, name, op, prescale_factor, postscale_factor, set_id)
            if handle_id is not None:
                collective.started(handle_id)
                return handle_id, tensor, None
        buffer, finish, dtype_key, shape, pointer, placement = self.tensors.in_place(tensor, name)
        key = (name, dtype_key, shape, op, prescale_factor, postscale_factor, set_id, placement[0])
        handle_id = collective.start_in_place(key, pointer, placement[1])
        if handle_id is None:  # this thread's first op of this kind: checked once, kept
            handle_id = collective.start_in_place(key, pointer, placement[1], self._in_place_allreduce(buffer, key))
            if fast is not None and buffer is tensor:  # its repeats go the compiled way
                fast.learn(tensor, name, op, prescale_factor, postscale_factor, set_id, self._codes[dtype_key])
        return handle_id, buffer, finish

    def _in_place_allreduce(self, buffer, key):
        """The checked, filled options of a new in-place allreduce (see
        allreduce_async_), kept for its repeats."""
        name, _, shape, op, prescale_factor, postscale_factor, set_id, device = key
        code = self.dtype_code(buffer, name)
        if op not in _PLAIN_ALLREDUCE_OPS:
            arguments.check_reduce("allreduce", op, prescale_factor, postscale_factor, name)
        return collective.prepare(_ALLREDUCE, name, code, shape, op, prescale_factor, postscale_factor, 0,
                                  None, set_id, device)

    def allreduce_placeholder_async_(self, tensor, name=None, op=Average, prescale_factor=1.0,
                                     postscale_factor=1.0, process_set=None):
        """An in-place allreduce to which this rank contributes `tensor`,
        zeros standing in for a tensor it does not have (a parameter it did
        not use this step). The result is the others' reduction in `tensor`,
        or None where no rank had the tensor (every rank's contribution a
        placeholder): one process would have had no gradient either, and
        an optimizer treats none differently from zeros."""
        code = self.dtype_code(tensor, name)
        if op not in _PLAIN_ALLREDUCE_OPS:
            arguments.check_reduce("allreduce", op, prescale_factor, postscale_factor, name)
        t = self.tensors
        buffer, copy_back = t.writable(tensor, name)
        pointer = t.pointer(buffer)
        handle_id = collective.enqueue(_ALLREDUCE, name, code, t.shape(buffer), pointer, pointer, op, prescale_factor,
                                       postscale_factor, 0, None, process_set, t.placement(buffer), placeholder=True)

        def finish(hid):
            if _handles.unused_everywhere(hid):
                return None
            return tensor if copy_back is None else copy_back(hid)
        return Handle(handle_id, name, (tensor, buffer), finish)

    def grouped_allreduce_async(self, tensors, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                                process_set=None, in_place=False, placeholders=None):
        """One HandleGroup for every tensor's allreduce; enqueued together, so
        the core fuses them. In place, `placeholders` may say which tensors
        stand in for ones this rank does not have (allreduce_placeholder_async_)."""
        start = self.allreduce_async_ if in_place else self.allreduce_async
        names = arguments.member_names(name, len(tensors))
        stand_ins = placeholders or [False] * len(tensors)
        with collective.enqueued_together():
            handles = []
            many = getattr(self.fast, "allreduce_many_", None) if in_place else None
            if many is not None:
                # An adapter's compiled path starts the leading members
                # (up to the first stand-in) in one call; a member it
                # declines, and every one after it, is started here.
                lead = stand_ins.index(True) if True in stand_ins else len(tensors)
                set_id = _set_id(process_set)
                handles = many(tensors[:lead], names[:lead], op, prescale_factor, postscale_factor, set_id)
                collective.started_many([h.id for h in handles])
            done = len(handles)
            handles += [(self.allreduce_placeholder_async_ if stands_in else start)(
                            x, n, op, prescale_factor, postscale_factor, process_set)
                        for x, n, stands_in in zip(tensors[done:], names[done:], stand_ins[done:])]
            return HandleGroup(handles)

    # ---- allgather -----------------------------------------------------------------

    def _output_of(self, output, like, name):
        """(pointer, capacity in bytes) of a caller's output for an op whose
        output size only negotiation fixes; (NULL, 0) to let the core
        allocate it. The output must be contiguous memory of the input's
        dtype: the core writes it directly."""
        if output is None:
            return collective.NULL, 0
        t = self.tensors
        dtype = t.dtype_name(output)
        if dtype != t.dtype_name(like):
            raise InvalidArgumentError("unison: the output for %s is %s, the tensor is %s"
                                       % (dtypes.label(name), dtype, t.dtype_name(like)))
        t.check(output, name)
        if t.writable(output, name)[1] is not None:   # a copy would be written, not `output`
            raise InvalidArgumentError("unison: the output for %s must be contiguous" % dtypes.label(name))
        elements = 1
        for d in t.shape(output):
            elements *= d
        if elements == 0:   # an empty tensor may have no address, and NULL would mean "allocate one"
            return _EMPTY_OUTPUT, 0
        return t.pointer(output), elements * dtypes.ITEM_BYTES[dtype]

    def allgather_async(self, tensor, name=None, process_set=None, output=None):
        """A new tensor of every rank's rows, or `output` filled with them
        (sized by the caller, who knows every rank's rows; the input may be
        this rank's own rows of it)."""
        prepared = self.prepare("allgather", tensor, name)
        source = self.tensors.readable(tensor)
        target, capacity = self._output_of(output, tensor, name)
        handle_id = collective.enqueue(_ALLGATHER, name, prepared.code, prepared.shape,
                                       self.tensors.pointer(source), target, process_set=process_set,
                                       placement=self.tensors.placement(source), output_bytes=capacity)
        if output is not None:
            return Handle(handle_id, name, (tensor, source, output), None, output)
        return Handle(handle_id, name, (tensor, source), self._core_result(tensor))

    def grouped_allgather_async(self, tensors, name=None, process_set=None):
        names = arguments.member_names(name, len(tensors))
        with collective.enqueued_together():
            return HandleGroup([self.allgather_async(x, n, process_set) for x, n in zip(tensors, names)])

    # ---- broadcast -----------------------------------------------------------------

    def broadcast_async(self, tensor, root_rank, name=None, process_set=None, output=None):
        code = self.dtype_code(tensor, name)
        t = self.tensors
        source = t.readable(tensor)
        target = t.empty_like(source) if output is None else output
        handle_id = collective.enqueue(_BROADCAST, name, code, t.shape(source), t.pointer(source),
                                       t.pointer(target), root_rank=root_rank, process_set=process_set,
                                       placement=t.placement(source))
        return Handle(handle_id, name, (tensor, source, target), None, target)

    def broadcast_async_(self, tensor, root_rank, name=None, process_set=None):
        code = self.dtype_code(tensor, name)
        t = self.tensors
        buffer, finish = t.writable(tensor, name)
        pointer = t.pointer(buffer)
        handle_id = collective.enqueue(_BROADCAST, name, code, t.shape(buffer), pointer, pointer,
                                       root_rank=root_rank, process_set=process_set, placement=t.placement(buffer))
        if finish is None:
            return Handle(handle_id, name, (tensor, buffer), None, tensor)
        return Handle(handle_id, name, (tensor, buffer), finish)

    # ---- alltoall -------------------------------------------------------------------

    def alltoall_async(self, tensor, splits=None, name=None, process_set=None):
        """synchronize() gives (output, received splits as a list of ints)."""
        prepared = self.prepare("alltoall", tensor, name)
        counts = arguments.split_counts(splits, name)
        source = self.tensors.readable(tensor)
        handle_id = collective.enqueue(_ALLTOALL, name, prepared.code, prepared.shape,
                                       self.tensors.pointer(source), splits=counts, process_set=process_set,
                                       placement=self.tensors.placement(source))
        gather = self._core_result(tensor)
        ranks = size_of(process_set)

        def finish(hid):
            return gather(hid), _handles.received_splits(hid, ranks)
        return Handle(handle_id, name, (tensor, source), finish)

    # ---- reducescatter ----------------------------------------------------------------

    def reducescatter_async(self, tensor, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=None, splits=None, output=None, placeholder=False):
        """This rank's rows of the reduction: an even share of the first
        dimension (the lower ranks take one more where it does not divide),
        or splits[rank] rows where `splits` gives every rank's count (the
        same list on every rank); in a new tensor, or in `output`. With
        placeholder, `tensor` is zeros standing in for one this rank does not
        have, and the result is None where no rank had it (as
        allreduce_placeholder_async_)."""
        prepared = self.prepare("reducescatter", tensor, name, op, prescale_factor, postscale_factor)
        counts = arguments.split_counts(splits, name, "reducescatter")
        source = self.tensors.readable(tensor)
        target, capacity = self._output_of(output, tensor, name)
        handle_id = collective.enqueue(_REDUCESCATTER, name, prepared.code, prepared.shape,
                                       self.tensors.pointer(source), target, reduce_op=op,
                                       prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                       splits=counts, process_set=process_set,
                                       placement=self.tensors.placement(source), output_bytes=capacity,
                                       placeholder=placeholder)
        if placeholder:
            result = (lambda _: output) if output is not None else self._core_result(tensor)

            def finish(hid):
                return None if _handles.unused_everywhere(hid) else result(hid)
            return Handle(handle_id, name, (tensor, source, output), finish)
        if output is not None:
            return Handle(handle_id, name, (tensor, source, output), None, output)
        return Handle(handle_id, name, (tensor, source), self._core_result(tensor))

    def grouped_reducescatter_async(self, tensors, name=None, op=Average, prescale_factor=1.0,
                                    postscale_factor=1.0, process_set=None):
        names = arguments.member_names(name, len(tensors))
        with collective.enqueued_together():
            return HandleGroup([self.reducescatter_async(x, n, op, prescale_factor, postscale_factor, process_set)
                                for x, n in zip(tensors, names)])
