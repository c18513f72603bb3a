"""The bridge to MXNet's dependency engine, through its C API only.

How ordering is guaranteed: a collective on NDArrays is pushed to MXNet's
engine with MXEnginePushAsyncND, naming the arrays it reads (const) and the
arrays it writes (mutable). The engine runs our function only after every
earlier write to those arrays has finished, and holds back every later read
or write of them until we call the completion callback it handed us. So an
allreduce of a gradient starts after backward has written it, and the
optimizer's update that reads it starts after the allreduce has written the
result, with no wait_to_read() and no copy through numpy.

Our function runs on an engine thread: it takes the arrays' data pointers
(valid now that the engine has resolved the dependencies), enqueues the
collective in the core, and returns at once, so
that it never blocks an engine worker while peers catch up (with one CPU
worker, a blocking collective could wait on a peer whose matching
collective is queued behind it). The thread that pushed the op, which
unison.mxnet's functions all make wait for it at once, then waits on the
core's handle and calls the op's completion callback itself.

Who waits matters to the deadlock test (native/caller_activity.h), which
fails stalled ops once every thread that submits collectives is blocked in
the core. The engine thread starts the op inside GraphNode, naming the
pushing thread as the one that waits: the engine thread is a submitter only
while it starts an op, and the pushing thread is one that is blocked while
it waits on the handle. Ranks that take different branches then fail with
unison.DeadlockError, as they do in PyTorch and TensorFlow, rather than
warning forever. (Until 2026-11-29 a completer thread waited on the handles
while the caller waited on an event: the engine threads, submitters for
good, looked busy, and a deadlock only warned.) A waiter interrupted
(Ctrl-C) hands its op to a completer thread, so that MXNet still gets the
op's completion and lets go of its arrays.

The completion callback is MXNet's CallbackOnComplete, which its C API hands
over as a pointer to a struct of three pointers: the function, the engine
and a parameter. The struct is copied, and the function is later called as
fn(engine, param, NULL), a plain C call that needs no C++ ABI. A failed
collective completes with NULL too (making an MXNet error needs C++), and
its error is raised by the Python handle's synchronize() instead.

oneDNN's layouts. MXNet built with oneDNN (MKLDNN), as the PyPI wheels are,
keeps some arrays in a blocked layout of oneDNN's instead of a plain one:
a convolution's weights after a forward pass outside autograd.record(),
and some operators' outputs. MXNDArrayGetData turns such an array back by
pushing a reorder to the engine and waiting for it. Called from our
function on an engine thread, which holds the array, that wait never ends:
broadcast_parameters after an inference forward (the way to size deferred
parameters) hung with every rank idle. So the pointer is taken through
MXNDArrayToDLPack, which never waits and fails on a blocked array, and
push() first waits for the arrays on the caller's thread, where waiting
is safe, and turns blocked ones back. The gradients' allreduces, which must
not wait, skip that wait: training keeps gradients plain. Should an array
still turn blocked before its op starts, the op fails with an error that
says so, rather than hanging.
"""
import ctypes
import queue
import threading

import mxnet as mx

from unison.exceptions import InvalidArgumentError
from unison.handles import GraphNode
from unison.handles import synchronize as _wait_core

_LIB = mx.base._LIB


class _OnComplete(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_void_p), ("engine", ctypes.c_void_p), ("param", ctypes.c_void_p)]


_COMPLETE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_ASYNC_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


class _Context(ctypes.Structure):
    _fields_ = [("dev_type", ctypes.c_int), ("dev_id", ctypes.c_int32)]


_CPU = _Context(1, 0)   # mxnet::Context::kCPU, device 0

_LIB.MXEnginePushAsyncND.argtypes = [
    _ASYNC_FN, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
    ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_bool]
_LIB.MXNDArrayGetData.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
_LIB.MXNDArrayToDLPack.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
_LIB.MXNDArrayCallDLPackDeleter.argtypes = [ctypes.c_void_p]
_LIB.MXNDArrayWaitToWrite.argtypes = [ctypes.c_void_p]
_LIB.MXNDArrayWaitToRead.argtypes = [ctypes.c_void_p]


def data_pointer(array, name):
    """The address of `array`'s data, without waiting on the engine: call
    it inside a pushed op, where the engine guarantees no pending write.
    An array in a blocked oneDNN layout raises (see the module's text)."""
    managed = ctypes.c_void_p()  # a DLManagedTensor*, whose first field is the data pointer
    if _LIB.MXNDArrayToDLPack(array.handle, ctypes.byref(managed)) != 0:
        raise InvalidArgumentError(
            "unison: %s: MXNet holds this array in a blocked oneDNN (MKLDNN) layout, which it turns back "
            "only by waiting on its engine, and a collective cannot wait there. An operator queued before "
            "the collective changed its layout (a convolution run outside autograd.record() does this to "
            "its weights and may do to its output). Wait for the array first (array.wait_to_read() or "
            "mx.nd.waitall()), and the collective turns it back before it starts. MXNet said: %s"
            % (name, mx.base.py_str(_LIB.MXGetLastError()).strip()))
    try:
        return ctypes.cast(managed, ctypes.POINTER(ctypes.c_void_p))[0] or 0
    finally:
        _LIB.MXNDArrayCallDLPackDeleter(managed)


def plain_layout(arrays):
    """On the caller's thread: waits for every operator queued on `arrays`,
    so that none can still change a layout, then turns any that MXNet holds
    in a blocked oneDNN layout back into its plain one (MXNDArrayGetData
    does that, waiting for the reorder; for a plain array it only reads the
    pointer)."""
    out = ctypes.c_void_p()
    for array in arrays:
        mx.base.check_call(_LIB.MXNDArrayWaitToWrite(array.handle))
        mx.base.check_call(_LIB.MXNDArrayGetData(array.handle, ctypes.byref(out)))


class EngineOp:
    """A collective pushed to MXNet's engine by a thread that will wait()
    for it. wait() returns its result or raises its error."""

    def __init__(self, name, key, bridge):
        self.name = name
        self.key = key
        self._bridge = bridge
        self.waiting_thread = threading.get_native_id()
        self._started = threading.Event()   # the engine ran our function, or the op ended without it
        self._core = None       # set with _started: (core handle, MXNet's completion, error from starting)
        self._handed_over = False   # to the completer thread, its waiter interrupted
        self._notified = False      # MXNet has been given the op's completion
        self._done = False
        self._result = None
        self._error = None

    def _finish(self, result=None, error=None):
        self._result, self._error, self._done = result, error, True
        self._started.set()

    def wait(self):
        waited = 0
        try:
            while not self._started.wait(0.2):   # in slices, so Ctrl-C gets through
                waited += 1
                if waited == 5:   # a second and not started: did MXNet skip it?
                    self._bridge.watch_for_a_skip(self)
            if not self._done:
                self._bridge.complete(self)
        except BaseException:   # Ctrl-C: MXNet must still get the op's completion
            self._bridge.hand_over(self)
            raise
        if self._error is not None:
            raise self._error
        return self._result


class _Bridge:
    def __init__(self):
        self._pending = {}           # key -> (EngineOp, start function, arrays kept alive)
        self._next_key = 0
        self._lock = threading.Lock()
        self._completions = queue.Queue()
        self._thread = None
        self._callback = _ASYNC_FN(self._run)   # kept alive for as long as the bridge

    def push(self, name, reads, writes, start, priority=0, settle=True):
        """Pushes an op that reads `reads` and writes `writes` (NDArrays).
        On an engine thread, once they are ready, start() is called and must
        return a core Handle; returns the EngineOp, which the calling thread
        must wait() for: nothing else completes it. settle=False pushes at
        once, leaving the arrays' layouts to the engine thread's check: for
        gradients, which training keeps in the plain layout, and whose
        allreduces are pushed during backward to overlap it."""
        if settle:
            plain_layout(reads + writes)
        with self._lock:
            key = self._next_key = self._next_key + 1
            op = EngineOp(name, key, self)
            self._pending[key] = (op, start, (reads, writes))
        read_handles = (ctypes.c_void_p * max(len(reads), 1))(*[a.handle.value for a in reads])
        write_handles = (ctypes.c_void_p * max(len(writes), 1))(*[a.handle.value for a in writes])
        mx.base.check_call(_LIB.MXEnginePushAsyncND(
            self._callback, ctypes.c_void_p(key), None, ctypes.cast(ctypes.byref(_CPU), ctypes.c_void_p),
            read_handles, len(reads), write_handles, len(writes), None, int(priority),
            ("unison." + name).encode(), False))
        return op

    def watch_for_a_skip(self, op):
        """MXNet does not run an operator whose arrays carry the error of an
        earlier one that failed (an operator unsupported on the CPU in
        backward, say): it completes it at once, and our function, which
        would start the collective, is never called. The op's waiter would
        then wait forever. So for an op not started a second after it was
        waited for, a thread waits in MXNet for the arrays it writes; if the
        op has still not run by then, MXNet skipped it, and it fails with
        MXNet's error."""
        with self._lock:
            entry = self._pending.get(op.key)
        if entry is None:
            return
        threading.Thread(target=self._watch, args=(op, entry[2][1]), name="unison-mxnet-watch",
                         daemon=True).start()

    def _watch(self, op, writes):
        # Waiting to read an array the op writes waits for the op itself to
        # be done in MXNet: run (which takes it out of _pending first) or
        # skipped. MXNet raises the failure once, to the first waiter of
        # any array that carries it; a later waiter sees none.
        why = "an operator it depends on failed (MXNet raised the error elsewhere)"
        try:
            for array in writes:
                mx.base.check_call(_LIB.MXNDArrayWaitToRead(array.handle))
        except mx.base.MXNetError as error:
            why = "an operator it depends on failed: %s" % error
        with self._lock:
            skipped = self._pending.pop(op.key, None) is not None
        if skipped:
            op._finish(error=mx.base.MXNetError("unison: %s did not run: MXNet skipped it because %s"
                                                % (op.name, why)))

    def _run(self, _run_context, on_complete, key):
        """On an MXNet engine thread: the arrays are ready; start the op
        (inside GraphNode: see the module's text) and hand it to its
        waiter."""
        callback = _OnComplete.from_address(on_complete)
        notify = (callback.fn, callback.engine, callback.param)
        with self._lock:
            op, start, _keep = self._pending.pop(key)
        handle, error = None, None
        try:
            with GraphNode(op.waiting_thread):
                handle = start()
        except Exception as e:  # noqa: BLE001 - handed to the waiting caller
            error = e
        with self._lock:
            op._core = (handle, notify, error)
            handed_over = op._handed_over
        if handed_over:
            self._completer().put(op)
        else:
            op._started.set()

    def complete(self, op):
        """Waits for the core's op, releases MXNet's hold on its arrays
        (once, whoever gets here), and finishes the EngineOp with the result
        or the error."""
        handle, notify, error = op._core
        result = None
        if error is None:
            try:
                result = _wait_core(handle)
            except Exception as e:  # noqa: BLE001 - handed to the waiting caller
                error = e
        with self._lock:
            if op._notified:
                return
            op._notified = True
        fn, engine, param = notify
        _COMPLETE_FN(fn)(engine, param, None)
        op._finish(result, error)

    def hand_over(self, op):
        """The waiter of `op` was interrupted: the completer thread
        completes it, now if it has started, else once it starts."""
        with self._lock:
            if op._notified or op._handed_over:
                return
            op._handed_over = True
            started = op._core is not None
        if started:
            self._completer().put(op)

    def _completer(self):
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._complete_loop, name="unison-mxnet-completer",
                                                daemon=True)
                self._thread.start()
        return self._completions

    def _complete_loop(self):
        while True:
            self.complete(self._completions.get())


bridge = _Bridge()
