"""The shared grid (shared_grid.py) for unison.torch: torch tensors in and
out, through every form Horovod's torch API has. With UNISON_TEST_DEVICE=cuda
the tensors are CUDA tensors (tests/test_parallel.py runs it so where there
is a GPU)."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import ml_dtypes  # noqa: E402

import unison.torch as hvd  # noqa: E402

from shared_grid import *  # noqa: F401,F403,E402  (the grid's tests and pytest_generate_tests)
from shared_grid import Shim  # noqa: E402

torch.set_num_threads(1)
DEVICE = os.environ.get("UNISON_TEST_DEVICE", "cpu")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("UNISON_TEST_DEVICE=cuda, but there is no CUDA device", allow_module_level=True)

NUMBERS = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "bfloat16",
           "float32", "float64"]


class TorchShim(Shim):
    name = "torch"
    api = hvd
    dtypes = NUMBERS + ["bool", "complex64", "complex128"]
    reduce_dtypes = NUMBERS

    def tensor(self, array):
        if array.dtype == ml_dtypes.bfloat16:  # numpy's bfloat16 is not torch's
            return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16).to(DEVICE)
        return torch.from_numpy(np.array(array)).to(DEVICE)

    def numpy(self, tensor):
        tensor = tensor.cpu()
        if tensor.dtype == torch.bfloat16:
            return tensor.float().numpy().astype(ml_dtypes.bfloat16)
        return tensor.numpy()


SHIM = TorchShim()
