"""The core's pure logic, tested in-process: tests/native/*.cc, built with
the core sources they test into one program (tests/native/main.cc runs
it), one pytest case per file. Milliseconds each, where a multi-rank job
costs seconds."""
import glob
import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
UNITS = os.path.join(HERE, "native")
# What the unit tests reach of the core: pure logic, no backend, no thread.
CORE_SOURCES = ["native/tcp/sha256.cc", "native/message.cc", "native/dtype.cc", "native/coordinator.cc",
                "native/reduce.cc", "native/reduce_f16c.cc", "native/copy.cc", "native/response_cache.cc"]
FILES = sorted(os.path.basename(f)[len("test_"):-len(".cc")] for f in glob.glob(os.path.join(UNITS, "test_*.cc")))


@pytest.fixture(scope="module")
def unit_tests(tmp_path_factory):
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        pytest.fail("%s is needed to build the core, and these tests with it" % compiler)
    program = str(tmp_path_factory.mktemp("native") / "unit_tests")
    sources = sorted(glob.glob(os.path.join(UNITS, "*.cc"))) + [os.path.join(ROOT, s) for s in CORE_SOURCES]
    built = subprocess.run([compiler, "-std=c++17", "-O1", "-Wall", "-Werror", "-I", os.path.join(ROOT, "native"),
                            "-I", UNITS, "-o", program] + sources, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=300)
    assert built.returncode == 0, built.stdout
    return program


@pytest.mark.parametrize("unit", FILES)
def test_core_unit_tests(unit_tests, unit):
    done = subprocess.run([unit_tests, unit + "."], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    assert done.returncode == 0 and " 0 failed" in done.stdout and not done.stdout.startswith("0 ran"), done.stdout
