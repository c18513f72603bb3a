"""The shared grid (shared_grid.py) for unison.mxnet: NDArrays in and out,
each op started on MXNet's engine, plain and in place."""
import pytest

mx = pytest.importorskip("mxnet")

import unison.mxnet as hvd  # noqa: E402

from shared_grid import *  # noqa: F401,F403,E402  (the grid's tests and pytest_generate_tests)
from shared_grid import Shim  # noqa: E402


class MXNetShim(Shim):
    name = "mxnet"
    api = hvd
    # MXNet's NDArray has no unsigned types past uint8, no bfloat16 and no bool.
    dtypes = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]
    reduce_dtypes = dtypes

    def tensor(self, array):
        return mx.nd.array(array, dtype=array.dtype)

    def numpy(self, tensor):
        return tensor.asnumpy()


SHIM = MXNetShim()
del test_allreduce_bool_means_any_or_all  # noqa: F821 (from the grid): MXNet has no bool NDArray to reduce
