"""The core's suites on a core built with a sanitizer: the `asan` and `tsan`
tox envs install unison with UNISON_SANITIZE=address (AddressSanitizer and
UndefinedBehaviorSanitizer) or UNISON_SANITIZE=thread (ThreadSanitizer) and
run this file, which pytest collects only when it is named (it is not a
test_*.py file, so the other envs leave it alone).

Each test is one job: the numpy suites of tests/parallel on the
shared-memory plane at 2 and 3 ranks (4 for process sets) and across two
simulated hosts on the TCP plane, flat and hierarchical; the grid on the
device planes over tests/fake_cuda; and the failure paths: a rank killed
at a random moment of a random stream of collectives (killed_at_random.py),
each survivor ending on its own error, and elastic jobs whose workers are
killed at random moments (jobs.run_random_kills). Every rank preloads the
sanitizer's runtime (Python itself is not instrumented, so the runtime must
come first). A report of any kind stops the rank (the options below make
every sanitizer do so), so the job fails, and the test prints the report.
"""
import glob
import importlib.util
import os
import subprocess
import sys

import pytest

import fake_cuda as fake_cuda_library
import layouts
from jobs import CORE_SUITES, assert_every_rank_passed, pytest_command, run_job, run_random_kills
from test_parallel import FAKE_GPU_LAYOUTS, fake_cuda_env

HERE = os.path.dirname(os.path.abspath(__file__))
SANITIZER = os.environ.get("UNISON_SANITIZE", "")
RUNTIME = {"address": "libasan.so", "thread": "libtsan.so"}
# Leaks are left out: the interpreter does not free everything at exit.
OPTIONS = {
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:halt_on_error=1",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    "TSAN_OPTIONS": "halt_on_error=1:second_deadlock_stack=1",
}
# Every numpy suite of tests/parallel on one host, and across hosts those
# that tests/test_tcp.py runs there; one job per layout.
ONE_HOST = sorted(f for f in os.listdir(os.path.join(HERE, "parallel")) if f.startswith("test_core_"))
SUITES = {  # by row of tests/layouts.py
    "shm-np2": ONE_HOST,
    "shm-np3": ONE_HOST,
    "shm-np4": ["test_core_process_sets.py"],
    "tcp-2+1": CORE_SUITES,
    "tcp-2x2": CORE_SUITES,  # hierarchical
}
MARKERS = ("ERROR: AddressSanitizer", "runtime error:", "WARNING: ThreadSanitizer", "ERROR: ThreadSanitizer")


def sanitizer_runtime():
    """The runtime library of the compiler that built the core."""
    if SANITIZER not in RUNTIME:
        pytest.fail("UNISON_SANITIZE=%r: this file runs in the asan and tsan tox envs, which set it to "
                    "address or thread" % SANITIZER)
    compiler = os.environ.get("CXX", "g++")
    path = subprocess.run([compiler, "-print-file-name=" + RUNTIME[SANITIZER]], stdout=subprocess.PIPE,
                          text=True, check=True).stdout.strip()
    if not os.path.isabs(path):  # the compiler answers the bare name when it has no such library
        pytest.fail("%s has no %s; it cannot have built this core" % (compiler, RUNTIME[SANITIZER]))
    return path


def test_the_installed_core_is_the_sanitized_one():
    """Guards the guard: a core built without the sanitizer would pass the
    suites below and show nothing."""
    # Found, not imported: this process has no sanitizer runtime preloaded.
    package = os.path.dirname(importlib.util.find_spec("unison").origin)
    (core,) = glob.glob(os.path.join(package, "_native*.so"))
    # `address` is AddressSanitizer and UndefinedBehaviorSanitizer both.
    symbols = {"address": [b"__asan_init", b"__ubsan_handle_"], "thread": [b"__tsan_init"]}.get(
        SANITIZER, [b"UNISON_SANITIZE unset"])
    with open(core, "rb") as f:
        binary = f.read()
    for symbol in symbols:
        assert symbol in binary, "%s was not built with UNISON_SANITIZE=%s: no %s" % (core, SANITIZER, symbol)


def sanitized_environment():
    """What every process of a sanitized job needs: the runtime first, and
    the options that make any report stop the process."""
    return dict(OPTIONS, LD_PRELOAD=sanitizer_runtime())


def run_sanitized(command, env, what):
    """Runs a job under the sanitizer, failing the test with the first
    report in its output; returns the job and its output."""
    env = dict(env, **sanitized_environment())
    proc = run_job(command, 880, env=env)
    output = proc.stdout.decode(errors="replace")
    fail_on_reports(output, what)
    return proc, output


def fail_on_reports(output, what):
    lines = output.splitlines()
    reports = [i for i, line in enumerate(lines) if any(m in line for m in MARKERS)]
    if reports:
        pytest.fail("%s reported in %s:\n%s" % (SANITIZER, what, "\n".join(lines[reports[0]:reports[0] + 80])))


def suites_command(launcher, suites):
    # -s: a sanitizer stops the process as it reports, so pytest would
    # never print the report it captured.
    return [sys.executable, "-m", "unison.run"] + launcher + pytest_command(*suites, seconds=300, options=("-s",))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(SUITES))
def test_core_suites_sanitized(layout):
    proc, _ = run_sanitized(suites_command(layouts.options(layout), SUITES[layout]),
                            dict(os.environ, UNISON_TEST_EXPECT_BACKEND=layouts.LAYOUTS[layout].backend),
                            "layout " + layout)
    assert_every_rank_passed(proc, layouts.ranks(layout))


# The device planes on tests/fake_cuda (test_parallel.py's layouts): NCCL
# at one rank and on a GPU per rank, host staging, and the hierarchical
# plane on even and uneven hosts, with their threads (NCCL's init among
# them) beside the engine's.
GPU_LAYOUTS = ["np1-nccl", "np3-staging", "np3-hierarchical-nccl", "np4-nccl-4-gpus",
               "np3-hierarchical-nccl-uneven-hosts"]


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory):
    return fake_cuda_library.build(str(tmp_path_factory.mktemp("fake_cuda")))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
def test_the_grid_on_a_fake_gpu_sanitized(fake_cuda, layout):
    row, extra, _ = FAKE_GPU_LAYOUTS[layout]
    env = dict(os.environ, **fake_cuda_env(fake_cuda, UNISON_TEST_DEVICE="fake-cuda", **extra))
    proc, _ = run_sanitized(suites_command(layouts.options(row), ["test_core_grid.py"]), env,
                            "fake-GPU layout " + layout)
    assert_every_rank_passed(proc, layouts.ranks(row))


KILLED = ["shm-np3", "tcp-2+1", "tcp-2x2"]  # rows of tests/layouts.py


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("layout", KILLED)
def test_a_rank_killed_at_a_random_moment_sanitized(layout, seed):
    """What a survivor does when a peer dies mid-collective (stop notices,
    half-sent frames, abandoned rounds) runs only then: each survivor must
    end on its own unison error, with nothing reported."""
    options, n = layouts.options(layout), layouts.ranks(layout)
    victim, delay = seed % n, 0.3 + 0.4 * seed
    command = [sys.executable, "-m", "unison.run"] + options + ["--failure-grace-seconds", "60", sys.executable,
                                                                os.path.join(HERE, "killed_at_random.py"), str(seed),
                                                                str(victim), str(delay)]
    _, output = run_sanitized(command, dict(os.environ), "a killed-rank job in layout " + layout)
    survivors = {int(line.split("survivor ")[1].split()[0]) for line in output.splitlines()
                 if "]<stdout>:survivor " in line}
    assert survivors == set(range(n)) - {victim}, output[-8000:]


# A host added midway only under AddressSanitizer: the launcher runs the
# discovery script through /bin/sh, and a shell started with ThreadSanitizer's
# runtime preloaded crashes at once.
ELASTIC_HOSTS = {"fixed-hosts": False, "a-host-added": True} if SANITIZER == "address" else {"fixed-hosts": False}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [0, 4])  # jobs that kill a worker in most runs (seed 0 on fixed hosts, two)
@pytest.mark.parametrize("host_added", list(ELASTIC_HOSTS.values()), ids=list(ELASTIC_HOSTS))
def test_elastic_workers_killed_at_random_moments_sanitized(tmp_path, monkeypatch, host_added, seed):
    """Elastic rounds: the core shut down and started again in the same
    process, with a member killed anywhere, a host added midway
    (test_elastic_launcher.py's jobs). A rank that reports exits, and the
    driver would go on without it, so the output is what fails the test."""
    for name, value in sanitized_environment().items():  # the launcher's environment, which the job inherits
        monkeypatch.setenv(name, value)
    run_random_kills(tmp_path, seed, host_added, steps=60 if host_added else 20,
                     look=lambda output: fail_on_reports(output, "an elastic job, seed %d" % seed))
