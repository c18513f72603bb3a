"""Tests in this folder run inside every rank of `unisonrun -np N pytest ...`
(tests/test_parallel.py starts them). Each is written from one rank's point
of view and checks exact values: what every rank computes from what every
other rank sent."""
import gc
import os
import sys

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
