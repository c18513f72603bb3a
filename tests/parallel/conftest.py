"""Tests in this folder run inside every rank of `unisonrun -np N pytest ...`
(tests/test_parallel.py starts them). Each is written from one rank's point
of view and checks exact values: what every rank computes from what every
other rank sent."""
import pytest

import unison


@pytest.fixture(scope="session", autouse=True)
def initialized():
    unison.init()
    assert unison.size() > 1, "run these under unisonrun -np N"
    yield
    unison.shutdown()
