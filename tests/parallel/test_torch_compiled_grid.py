"""The shared grid (shared_grid.py) inside torch.compile(fullgraph=True):
each collective of Horovod's API, called from a compiled function, must
compile into the graph with no break (fullgraph fails the test otherwise)
and give the eager results.

Each call compiles anew where a guard changes (each test names its
collectives, and the name is a constant of the graph), about 0.1 s a call
on the 2-core VM. So that the suite stays affordable at 1, 2 and 3 ranks:
- the eager backend keeps each compile to Dynamo's trace, the part that
  decides graph breaks and runs the operators' fake kernels (what
  AOTAutograd and Inductor do with them, test_torch_compile.py shows on
  whole training steps);
- the grid's dtype axes are cut to one of each kind the fake kernels and
  the graph treat apart (an integer, a 16-bit float, bool, complex; and
  the three dtypes of its mixed groups), and its random programs to one of
  the sixteen (each compiles some eighty starts and waits). Every dtype
  and every program goes through the same operators in
  test_torch_operators_grid.py, which runs the whole grid through them
  eagerly. (With four reduce dtypes and three programs, CI's torch env
  took 20 minutes, 9.5 before the two operator grids.)
Under torch.compile, allgather_async and reducescatter_async take no
output= (ops.py refuses it, saying why): the grid's tests of it skip.
"""
import functools
import inspect

import pytest

torch = pytest.importorskip("torch")
import torch._dynamo  # noqa: E402

import unison.torch as hvd  # noqa: E402
from unison.torch import graph_ops  # noqa: E402

from shared_grid import *  # noqa: F401,F403,E402  (the grid's tests and pytest_generate_tests)
from test_torch_grid import TorchShim  # noqa: E402
from cheap_compiles import make_compiles_cheaper  # noqa: E402

# Every test compiles its own calls: Dynamo's default of 8 graphs per
# function would fall back to eager after the eighth.
torch._dynamo.config.recompile_limit = 1 << 20
torch._dynamo.config.accumulated_recompile_limit = 1 << 20
make_compiles_cheaper()


class CompiledAPI:
    """hvd, each of its collectives run as torch.compile(fullgraph=True) of itself."""

    def __init__(self):
        self._compiled = {}

    def __getattr__(self, name):
        if name not in graph_ops.__all__:
            return getattr(hvd, name)
        if name not in self._compiled:
            self._compiled[name] = _without_output(torch.compile(getattr(hvd, name), fullgraph=True,
                                                                 backend="eager"))
        return self._compiled[name]


def _without_output(function):
    """`function`, whose signature says it takes no output= where it has
    one: the grid then skips its tests of output=, naming why."""
    signature = inspect.signature(function)
    if "output" not in signature.parameters:
        return function

    @functools.wraps(function)
    def without(*args, **kwargs):
        return function(*args, **kwargs)
    without.__signature__ = signature.replace(parameters=[p for n, p in signature.parameters.items()
                                                          if n != "output"])
    return without


class TorchCompiledShim(TorchShim):
    name = "torch_compiled"
    api = CompiledAPI()
    dtypes = ["uint8", "int32", "bfloat16", "float64", "bool", "complex64"]
    reduce_dtypes = ["int32", "bfloat16"]
    program_seeds = [0]

    def broadcast_every_root_forms(self):
        # One compiled function broadcasting from every root, not one
        # compile per root: at 3 ranks a third of the grid's broadcast
        # compiles, which were a fifth of its time. The forms are the eager
        # grid's (hvd's own functions), compiled together here.
        def compiled_every_root(one):
            def run(xs, names, p):
                def every_root(*ts):
                    return [one(t, root, name, p) for root, (t, name) in enumerate(zip(ts, names))]
                return torch.compile(every_root, fullgraph=True, backend="eager")(*xs)
            return run
        return {form: compiled_every_root(one) for form, one in TorchShim().broadcast_forms().items()}


SHIM = TorchCompiledShim()


@pytest.fixture(autouse=True)
def fresh_dynamo_caches():
    """Each test's compiles start from empty caches. A test's calls compile
    anew anyway (its names are constants of their graphs), but Dynamo
    checks a call against every graph the function already has, and diffs
    each new graph's guards against them: with all the grid's graphs kept,
    both grew with every test (the grid on one rank: 26 s, 21 s with this)."""
    yield
    torch._dynamo.reset()
