"""Ctrl-C while init() waits for the other ranks.

init() meets its peers inside one call into the core, and Python runs a
signal's handler only when its main thread is back among bytecodes. A
KeyboardInterrupt during that wait would come only once every peer had
come or the start timeout (UNISON_START_TIMEOUT, a minute by default) had
passed: Ctrl-C on a rank whose peers never started did nothing for a
minute.

The core's start-up waits already end early when another thread aborts the
start-up (native/start_abort.h; the elastic worker's watch uses it). Here
that thread is a watcher of Python's wakeup fd: Python's C-level handler
writes each signal's number there the moment the signal arrives, from any
thread. A signal whose handler raises KeyboardInterrupt aborts the start,
init's native call returns, and the pending KeyboardInterrupt is raised
where Python would have raised it. A signal with a handler of the
program's own does not end the start: that handler decides what it means.
Every number still reaches whatever wakeup fd was set before (asyncio's,
say).

The start-up itself stays on the thread that called init(), as before,
rather than moving to a helper thread for the main thread to wait on:
whatever the core and the libraries it loads tie to the starting thread
stays where it was, and only the watcher is new."""
import contextlib
import os
import signal
import socket
import threading

from unison._native import lib

_DONE = 0  # no signal has the number 0


@contextlib.contextmanager
def interruptible_start():
    """Within it, a Ctrl-C (any signal whose handler is Python's default
    SIGINT handler) aborts the core's start-up in progress."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals' handlers run on the main thread only; its own Ctrl-C is its own
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # set_wakeup_fd refuses a blocking fd
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main interpreter
        reader.close()
        writer.close()
        yield
        return
    watcher = threading.Thread(target=_watch, args=(reader, previous), name="unison-start-interrupt", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        writer.setblocking(True)  # Python writes to it no more; the watcher reads what is there
        writer.send(bytes([_DONE]))
        watcher.join()
        reader.close()
        writer.close()


def _watch(reader, previous):
    interrupted = None
    while True:
        # Once interrupted, the abort is repeated until the start returns:
        # one that came before the core's start-up began would be dropped
        # (start_abort.h), and the start would then wait for its peers.
        reader.settimeout(None if interrupted is None else 0.05)
        try:
            numbers = reader.recv(256)
        except socket.timeout:
            numbers = b""
        for number in numbers:
            if number == _DONE:
                return
            _pass_on(previous, number)
            if signal.getsignal(number) is signal.default_int_handler:
                interrupted = number
        if interrupted is not None:
            lib.unison_abort_start(("interrupted by %s" % signal.Signals(interrupted).name).encode())


def _pass_on(fd, number):
    if fd == -1:
        return
    try:
        os.write(fd, bytes([number]))
    except OSError:  # full or closed: Python's own handler drops such a byte as well
        pass
