"""The shared grid (shared_grid.py) for unison.numpy, the reference front
end: numpy arrays in, numpy arrays out. With UNISON_TEST_DEVICE=fake-cuda
the arrays are on a GPU that tests/fake_cuda runs on the host
(fake_gpu.py), so the grid goes through the core's GPU path (events,
streams, host staging, the device kernels) on machines with no GPU."""
import os

import numpy as np
import pytest

import unison
import unison.numpy as unp

from shared_grid import *  # noqa: F401,F403  (the grid's tests and pytest_generate_tests)
from shared_grid import Shim

pytest.importorskip("ml_dtypes")

NUMBERS = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "bfloat16",
           "float32", "float64"]


class NumpyShim(Shim):
    name = "numpy"
    api = unp
    dtypes = NUMBERS + ["bool", "complex64", "complex128"]
    reduce_dtypes = NUMBERS

    def tensor(self, array):
        return np.array(array)

    def numpy(self, tensor):
        return np.asarray(tensor)


class FakeGpuShim(NumpyShim):
    name = "numpy-fake-gpu"

    def __init__(self):
        import fake_gpu
        self.gpu = fake_gpu
        self.api = fake_gpu.api

    def tensor(self, array):
        return self.gpu.to_device(array)

    def numpy(self, tensor):
        return self.gpu.to_host(tensor)


SHIM = FakeGpuShim() if os.environ.get("UNISON_TEST_DEVICE") == "fake-cuda" else NumpyShim()


def test_a_host_array_given_as_gpu_memory_is_refused_and_the_next_op_runs():
    """Only on the fake GPU: a host array that says it is on the GPU would
    be read by the device as garbage. Each rank refuses its own at enqueue,
    naming the tensor, before any rank negotiates."""
    if not isinstance(SHIM, FakeGpuShim):
        pytest.skip("runs with UNISON_TEST_DEVICE=fake-cuda (tests/test_parallel.py::test_core_grid_on_a_fake_gpu)")
    with pytest.raises(unison.UnisonError, match="allreduce 'host.given': the input is not device memory, but "
                                                 "device %d was given" % SHIM.gpu.DEVICE):
        SHIM.api.allreduce(np.ones(3, np.float32), name="host.given")
    out = SHIM.api.allreduce(SHIM.tensor(np.ones(3, np.float32)), op=SHIM.api.Sum, name="after.host.given")
    assert_same(SHIM.numpy(out), np.full(3, float(unison.size()), np.float32))
