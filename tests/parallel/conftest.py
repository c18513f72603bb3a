"""Tests in this folder run inside every rank of `unisonrun -np N pytest ...`
(tests/test_parallel.py starts them). Each is written from one rank's point
of view and checks exact values: what every rank computes from what every
other rank sent."""
import gc
import os
import sys
import threading
import time
import traceback

import pytest

import unison


# A rank's session holds some 700,000 objects once torch or TensorFlow is
# imported and the suites collected, and most are kept to the end: every
# full collection walked them all (0.2 s each, 19 in a TensorFlow rank's
# session: 8% of its time). Frozen objects are left out of collections.
# They are frozen when collection ends and again after each suite, whose
# graphs, compiled functions and models stay cached for the session; what a
# test creates and drops is still collected as before.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session):
    gc.freeze()


# Last: after pytest's own teardown has finalized the suite's fixtures, so
# that what they drop is not frozen with the rest.
@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if nextitem is None or nextitem.module is not item.module:
        gc.freeze()


# Each test in a rank runs under a time limit, so that a hang is a failure
# (tests/jobs.py and tests/sanitized_suites.py set it). pytest-timeout's
# way that also ends a test blocked in native code started a thread per
# test and waited for it to start and to stop: 0.7 ms of CPU a test, and
# 2 ms of wall time on CI's busy cores, in which the test's peers wait
# for it. Ranks run some 115,000 tests in a CI run. So the ranks leave
# pytest-timeout out (-p no:timeout) and one watchdog thread a session
# does its job: each test sets a deadline, which the watchdog reads once a
# second. A test that has not ended by it is reported like a failure
# (failure_digest in tests/jobs.py picks the report up), with every
# thread's stack, and the rank exits, which ends the job.
def pytest_addoption(parser):
    parser.addoption("--rank-timeout", type=float, default=None,
                     help="seconds each test may take, fixtures included, before the rank reports it and exits")


class Watchdog:
    """A pytest plugin: registered by pytest_configure when --rank-timeout is given."""
    POLL_SECONDS = 1.0

    def __init__(self, config, seconds):
        self.config = config
        self.seconds = seconds
        self.running = None  # (deadline, the test's id, its phase, its limit) of the test running now
        threading.Thread(target=self._watch, name="unison-test-watchdog", daemon=True).start()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        marker = item.get_closest_marker("timeout")  # @pytest.mark.timeout(s) still sets a test's own limit
        seconds = float(marker.args[0]) if marker is not None and marker.args else self.seconds
        self.running = (time.monotonic() + seconds, item.nodeid, "setup", seconds)
        try:
            yield
        finally:
            self.running = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item):
        self._phase("call")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item, nextitem):
        self._phase("teardown")

    def _phase(self, when):
        running = self.running
        if running is not None:
            self.running = running[:2] + (when,) + running[3:]

    def _watch(self):
        while True:
            time.sleep(self.POLL_SECONDS)
            running = self.running  # one read: the tuple is replaced whole, never changed
            if running is not None and time.monotonic() > running[0]:
                self._report_and_exit(*running[1:])

    def _report_and_exit(self, nodeid, when, seconds):
        names = {t.ident: t.name for t in threading.enumerate()}
        lines = ["", "unison test: %s failed in %s on rank %s:" % (nodeid, when, os.environ.get("UNISON_RANK", "?")),
                 "E   ran past its time limit of %g s; every thread's stack follows" % seconds]
        frames = sys._current_frames()
        frames.pop(threading.get_ident(), None)
        # The test's own thread last: a digest of the output keeps the last lines.
        main = threading.main_thread().ident
        for ident, frame in sorted(frames.items(), key=lambda pair: pair[0] == main):
            lines.append("---- thread %s ----" % names.get(ident, ident))
            for place in traceback.extract_stack(frame):
                lines.append("%s:%d: in %s" % (place.filename, place.lineno, place.name))
                if place.line:
                    lines.append("    " + place.line)
        # pytest holds the rank's stdout and stderr in files while a test
        # runs: give them back, with what the test had printed so far.
        capture = self.config.pluginmanager.getplugin("capturemanager")
        printed = ("", "")
        if capture is not None:
            try:
                capture.suspend_global_capture(in_=True)
                printed = capture.read_global_capture()
            except Exception:  # a capture in an odd state must not keep the rank alive
                pass
        sys.stdout.write("".join(printed) + "\n".join(lines) + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "timeout(seconds): this test's own time limit in a rank")
    seconds = config.getoption("--rank-timeout")
    if seconds is not None:
        config.pluginmanager.register(Watchdog(config, seconds), "unison-rank-watchdog")


@pytest.fixture(scope="session", autouse=True)
def initialized():
    unison.init()
    # One rank is a real job too when the launcher started it (the grid runs at -np 1).
    assert unison.size() > 1 or "UNISON_SIZE" in os.environ, "run these under unisonrun -np N"
    # tests/test_mpi.py runs the same suites on each MPI layout and says
    # which backend that layout must have chosen.
    expected = os.environ.get("UNISON_TEST_EXPECT_BACKEND")
    assert expected is None or unison.basics.backend_name() == expected, unison.basics.backend_name()
    yield
    unison.shutdown()


@pytest.fixture(scope="module", autouse=True)
def fresh_keras_names():
    """Each suite starts from Keras's first layer names, as it would in a
    process of its own: tests/test_parallel.py runs every suite of a
    framework in one job, and Keras numbers layers per process, so a suite
    that built models on some ranks only (a reference on rank 0) leaves the
    next suite's layers named apart across ranks. SyncBatchNormalization
    names its collectives after its layer's path (tf_adapter/sync_batch_norm.py),
    and those would then never pair."""
    keras = sys.modules.get("keras")
    if keras is not None:
        keras.backend.clear_session()
    yield


@pytest.fixture(scope="module")
def half():
    """This rank's half of the job as a process set ({0} and {1, 2} at 3
    ranks). Every rank adds both halves, as add_process_set requires, and
    removes them after the module."""
    n = unison.size()
    low = unison.add_process_set(list(range(n // 2)))
    high = unison.add_process_set(list(range(n // 2, n)))
    yield low if low.included() else high
    unison.remove_process_set(low)
    unison.remove_process_set(high)


def pytest_runtest_logreport(report):
    """A failure is printed as it happens, not in the summary: a rank that
    fails a test often cannot finish the session (its peers are in a
    collective it will never join, and its teardown waits for them), and
    the per-test timeout then ends it before any summary."""
    if report.failed:
        print("\nunison test: %s failed in %s on rank %s:\n%s"
              % (report.nodeid, report.when, os.environ.get("UNISON_RANK", "?"), report.longreprtext), flush=True)
