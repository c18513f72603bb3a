"""Runs each suite in tests/parallel under the launcher with 2 and 3 ranks
(odd sizes find bugs), and more or fewer where a suite needs them
(sizes()). Each rank runs pytest on the same file; a test that hangs is
failed by pytest-timeout inside the ranks and by the timeout here."""
import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SUITES = sorted(f for f in os.listdir(os.path.join(HERE, "parallel")) if f.startswith("test_"))
# Suites for a framework run in that framework's tox env (tox.ini); an env
# without the framework installed leaves them to it.
FRAMEWORKS = {"test_torch_": "torch", "test_mxnet_": "mxnet", "test_tensorflow_": "tensorflow",
              "test_keras_": "tensorflow"}


def framework_of(suite):
    for prefix, module in FRAMEWORKS.items():
        if suite.startswith(prefix):
            return module
    return None


# Process sets need 4 ranks: two disjoint pairs, and sets that overlap them.
# The shared grid (parallel/shared_grid.py) also runs on one rank, where
# every collective must still give the single-process answer; so do the GPU
# suites, where one rank is the NCCL path (more ranks share the one GPU).
def sizes(suite):
    if "process_sets" in suite:
        return [2, 3, 4]
    if suite.endswith("_grid.py") or suite.endswith("_cuda.py"):
        return [1, 2, 3]
    return [2, 3]


RUNS = [(suite, n) for suite in SUITES for n in sizes(suite)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("suite,np_", RUNS, ids=lambda v: "np%d" % v if isinstance(v, int) else v)
def test_suite_under_launcher(suite, np_):
    run_suite(suite, np_)


# Async ops start at once on the engine's thread only where the host has a
# core to spare per rank (UNISON_OVERLAP=auto, engine_driver.cc); on a
# machine without one (CI's 2 cores) the suites above run without overlap,
# so these force it on.
# GPU tensors: the torch grid on CUDA tensors, at 1 rank (NCCL) and at 2
# and 3 ranks sharing one GPU (host staging). test_torch_cuda.py is among
# the suites above. Where there is no GPU both skip, saying so.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("np_", [1, 2, 3], ids=lambda v: "np%d" % v)
def test_torch_grid_on_cuda_tensors(np_):
    skip_without_cuda()
    run_suite("test_torch_grid.py", np_, {"UNISON_TEST_DEVICE": "cuda"})


def skip_without_cuda():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here; the tox env 'torch' runs the GPU suites")
    import torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the GPU suites run on a GPU machine (benchmarks/gpu_machine.sh)")


OVERLAP_SUITES = ["test_core_ops.py", "test_core_grid.py", "test_torch_optimizer.py", "test_torch_zero.py"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("suite", OVERLAP_SUITES)
@pytest.mark.parametrize("np_", [2, 3], ids=lambda v: "np%d" % v)
def test_suite_with_overlap_forced_on(suite, np_):
    run_suite(suite, np_, {"UNISON_OVERLAP": "1"})


def run_suite(suite, np_, env=None):
    if suite.endswith("_cuda.py"):
        skip_without_cuda()
    framework = framework_of(suite)
    if framework and importlib.util.find_spec(framework) is None:
        pytest.skip("%s is not installed here; the tox env '%s' runs this suite" % (framework, framework))
    command = [sys.executable, "-m", "unison.run", "-np", str(np_), sys.executable, "-m", "pytest",
               "-q", "-p", "no:cacheprovider", "--timeout=120", "-x",
               os.path.join(HERE, "parallel", suite)]
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=580,
                          cwd=HERE, env=dict(os.environ, **(env or {})))
    output = proc.stdout.decode(errors="replace")
    summaries = [line for line in output.splitlines() if " passed" in line or " failed" in line]
    print("\n".join(summaries))
    assert proc.returncode == 0, output[-20000:]
    assert len([s for s in summaries if "passed" in s and "failed" not in s]) == np_, output[-5000:]
