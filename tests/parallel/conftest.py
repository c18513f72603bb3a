"""Tests in this folder run inside every rank of `unisonrun -np N pytest ...`
(tests/test_parallel.py starts them). Each is written from one rank's point
of view and checks exact values: what every rank computes from what every
other rank sent."""
import os

import pytest

import unison


@pytest.fixture(scope="session", autouse=True)
def initialized():
    unison.init()
    assert unison.size() > 1, "run these under unisonrun -np N"
    # tests/test_mpi.py runs the same suites on each MPI layout and says
    # which backend that layout must have chosen.
    expected = os.environ.get("UNISON_TEST_EXPECT_BACKEND")
    assert expected is None or unison.basics.backend_name() == expected, unison.basics.backend_name()
    yield
    unison.shutdown()
