"""The shared grid (shared_grid.py) through unison's registered torch
operators, called eagerly: torch_adapter/graph_ops.py, the forms of
Horovod's API that torch.compile traces, run outside it, so that each
`unison::` operator's real kernel is checked on every dtype, shape and
process set. test_torch_compiled_grid.py runs the same forms compiled."""
import pytest

torch = pytest.importorskip("torch")

import unison.torch as hvd  # noqa: E402
from unison.torch import graph_ops  # noqa: E402

from shared_grid import *  # noqa: F401,F403,E402  (the grid's tests and pytest_generate_tests)
from test_torch_grid import TorchShim  # noqa: E402


class OperatorsAPI:
    """hvd, with its collectives as graph_ops' operator forms; the rest
    (ops' codes, join) is hvd's own."""

    def __getattr__(self, name):
        return getattr(graph_ops, name) if name in graph_ops.__all__ else getattr(hvd, name)


class TorchOperatorsShim(TorchShim):
    name = "torch_operators"
    api = OperatorsAPI()


SHIM = TorchOperatorsShim()
