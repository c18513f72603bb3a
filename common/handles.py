"""Handles of asynchronous ops, shared by every front end.

A Handle keeps the buffers of its op alive until the op has completed:
the core reads and writes them from its own thread, so they must not be
freed under it even if the caller drops the handle.
"""
from unison import basics
from unison._native import ffi, lib

# Handles whose op may still be running, so their buffers stay alive even
# when the caller drops the Handle without synchronizing.
_in_flight = {}
_OK, _TIMEOUT = lib.UNISON_OK, lib.UNISON_ERR_TIMEOUT
_wait, _wait_release = lib.unison_wait, lib.unison_wait_release
# An adapter's compiled path that waits for a group's members in one call
# (set_group_waiter), or None.
_group_waiter = None


class Handle:
    """An op in flight. Its result is finish(handle id) once the op has
    completed, or `result` itself when finish is None (in-place ops, whose
    result is a buffer the caller already holds)."""
    __slots__ = ("id", "name", "_buffers", "_finish", "_result", "_done", "__weakref__")

    def __init__(self, handle_id, name, buffers, finish, result=None):
        self.id = handle_id
        self.name = name
        self._buffers = buffers
        self._finish = finish
        self._done = False
        self._result = result
        _in_flight[handle_id] = self

    def __repr__(self):
        return "<unison.Handle %d %r%s>" % (self.id, self.name, " done" if self._done else "")


class HandleGroup:
    """The handles of a grouped op, waited on together: synchronize()
    returns the list of their results, in order."""
    __slots__ = ("handles", "_finish")

    def __init__(self, handles, finish=None):
        self.handles = list(handles)
        self._finish = finish

    def __repr__(self):
        return "<unison.HandleGroup of %d>" % len(self.handles)


def _done(handle, caller):
    """handle._done, or a TypeError naming what `caller` was given where it
    is not a handle (an AttributeError from deep inside said nothing)."""
    try:
        return handle._done
    except AttributeError:
        raise TypeError("unison: %s takes the handle an *_async op returned, got %r" % (caller, handle)) from None


def poll(handle):
    """True once the op has completed; synchronize() will then not block."""
    if isinstance(handle, HandleGroup):
        return all(poll(h) for h in handle.handles)
    if _done(handle, "poll"):
        return True
    done = ffi.new("int*")
    basics.check(lib.unison_poll(handle.id, done))
    return bool(done[0])


def synchronize(handle):
    """Waits for the op and returns its result; raises if it failed."""
    if isinstance(handle, HandleGroup):
        members = handle.handles
        # The leading members the compiled waiter could finish (in-place
        # ops that succeeded), their results their tensors.
        first = _group_waiter(members) if _group_waiter is not None else 0
        results = [h._result for h in members[:first]]
        # Wait for every member even if one fails, so none is left running
        # on buffers the caller may free; then raise the first failure.
        failure = None
        for h in members[first:]:
            try:
                results.append(synchronize(h))
            except Exception as e:  # noqa: BLE001 - re-raised below
                failure = failure or e
        if failure is not None:
            raise failure
        return handle._finish(results) if handle._finish else results
    if _done(handle, "synchronize"):
        return handle._result
    handle_id = handle.id
    finish = handle._finish
    # An op whose result the caller already holds (in place, or in its own
    # output) is released by the same call that waits for it, when it
    # succeeded: one call into the core per gradient instead of two.
    wait = _wait if finish is not None else _wait_release
    code = wait(handle_id, 0.2)
    while code == _TIMEOUT:
        # Wait in slices so that Ctrl-C reaches Python between them.
        code = wait(handle_id, 0.2)
    _in_flight.pop(handle_id, None)
    if code == _OK and finish is None:
        handle._buffers = None
        handle._done = True
        return handle._result
    try:
        if code != _OK:
            raise _failure(handle_id, code)
        handle._result = finish(handle_id)
        handle._done = True
        return handle._result
    finally:
        handle._buffers = None
        lib.unison_release(handle_id)


def set_group_waiter(waiter):
    """waiter(handles) -> n: waits for the leading handles of a
    HandleGroup as synchronize() would, and says how many it finished; the
    rest, from the first it could not, are synchronize()'s
    (torch_adapter/fast_path.cc: synchronize_many, one C call where
    synchronize makes a Python call a member). None: synchronize() alone."""
    global _group_waiter
    _group_waiter = waiter


def wait_in_place(handle_id, name, buffers):
    """synchronize() for a blocking op whose result is in the caller's own
    buffers, without a Handle: the caller holds `buffers` until this
    returns. Interrupted (Ctrl-C between wait slices) with the op still
    running, it leaves a Handle in flight, so the buffers outlive the op."""
    try:
        code = _wait_release(handle_id, 0.2)
        while code == _TIMEOUT:
            code = _wait_release(handle_id, 0.2)
    except BaseException:
        Handle(handle_id, name, buffers, None)
        raise
    if code != _OK:
        try:
            raise _failure(handle_id, code)
        finally:
            lib.unison_release(handle_id)


def _failure(handle_id, code):
    """The exception for a failed op, with the core's message; or, where the
    core refused to look at the handle at all (a process forked from the
    rank, say), with the refusal's."""
    message = ffi.new("char[]", 4096)
    if lib.unison_handle_error(handle_id, message, 4096) != _OK:
        message = lib.unison_last_error()
    return basics.error_for(code, ffi.string(message).decode(errors="replace"))


def forget(handle_id):
    """Drops a completed op that nobody will wait for: its buffers and the
    core's handle."""
    handle = _in_flight.pop(handle_id, None)
    if handle is not None:
        handle._buffers = None
    lib.unison_release(handle_id)


def result_buffer(handle_id):
    """(cdata pointer owned by Python, byte count, shape) of a completed op
    whose output the core allocated; the memory is freed with the pointer."""
    data = ffi.new("void**")
    nbytes = ffi.new("int64_t*")
    ndim = ffi.new("int*")
    shape = ffi.new("int64_t[32]")
    basics.check(lib.unison_handle_result(handle_id, 1, data, nbytes, ndim, shape))
    owned = ffi.gc(data[0], lib.unison_free)
    return owned, nbytes[0], tuple(shape[i] for i in range(ndim[0]))


def received_splits(handle_id, count):
    out = ffi.new("int64_t[]", count)
    basics.check(lib.unison_handle_received_splits(handle_id, out, count))
    return list(out)


def join_rank(handle_id):
    out = ffi.new("int*")
    basics.check(lib.unison_handle_join_rank(handle_id, out))
    return out[0]


def unused_everywhere(handle_id):
    """Whether every rank's contribution to a completed allreduce (or
    reducescatter) was a placeholder: no rank had the tensor."""
    out = ffi.new("int*")
    basics.check(lib.unison_handle_unused(handle_id, out))
    return bool(out[0])


class GraphNode:
    """`with GraphNode(waiting_thread):` around a collective that runs as a
    node of a framework's graph, on one of the framework's threads, while
    the thread that called the graph (its threading native id, or 0 when
    unknown) waits for it. The deadlock test then counts this thread as a
    submitter only inside the node, and the waiting thread as blocked while
    the node is (native/caller_activity.h)."""
    __slots__ = ("_waiting_thread",)

    def __init__(self, waiting_thread):
        self._waiting_thread = waiting_thread

    def __enter__(self):
        lib.unison_graph_node_begin(self._waiting_thread)
        return self

    def __exit__(self, *exc):
        lib.unison_graph_node_end()
        return False
