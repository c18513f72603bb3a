import os

# tests/parallel holds per-rank suites; tests/test_parallel.py runs them
# under the launcher. Collected directly, outside a rank, they are skipped.
collect_ignore = [] if os.environ.get("UNISON_SIZE") else ["parallel"]

import shutil
import subprocess
import uuid

import pytest


def cpu_seconds_so_far():
    """CPU time of this process and of the children it has waited for
    (and theirs: a launcher waits for its ranks)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# Outside ranks only: inside one (tests/parallel's suites, some 115,000
# tests a CI run), it would record for nobody, at 0.15 ms a test.
if not os.environ.get("UNISON_SIZE"):
    @pytest.fixture(autouse=True)
    def count_the_tests_run_inside_ranks(record_property):
        """A test that runs suites inside a job's ranks counts as one test
        here; jobs.assert_every_rank_passed adds what rank 0 ran to the JUnit
        report as the property `rank_tests`, which .ci/summary.py adds up.

        Each test's CPU time, its jobs' ranks included, goes there too, as
        `cpu_seconds`: CI runs its environments side by side on cores that are
        busy nearly all the run, so a test costs the run its CPU time, which
        its wall time (waits, sleeps, timeouts) does not show."""
        import jobs
        jobs.record_property = record_property
        start = cpu_seconds_so_far()
        yield
        jobs.record_property = None
        record_property("cpu_seconds", "%.1f" % (cpu_seconds_so_far() - start))


class Namespaces(list):
    """The namespaces' names, with `addresses`: each one's address on the veth."""
    addresses = ()


@pytest.fixture
def two_namespaces():
    """Two network namespaces joined by a veth pair, 10.77.x.1 and 10.77.x.2:
    two hosts whose bytes cross a real interface (named uveth in each)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip")
    tag = uuid.uuid4().hex[:6]
    names = Namespaces(["un%sa" % tag, "un%sb" % tag])
    subnet = 10 + int(tag[:2], 16) % 200
    names.addresses = ["10.77.%d.%d" % (subnet, i + 1) for i in range(2)]
    steps = [["netns", "add", names[0]], ["netns", "add", names[1]],
             ["link", "add", "v%sa" % tag, "type", "veth", "peer", "name", "v%sb" % tag]]
    for i, name in enumerate(names):
        end = "v%s%s" % (tag, "ab"[i])
        steps += [["link", "set", end, "netns", name], ["-n", name, "link", "set", end, "name", "uveth"],
                  ["-n", name, "addr", "add", names.addresses[i] + "/24", "dev", "uveth"],
                  ["-n", name, "link", "set", "uveth", "up"], ["-n", name, "link", "set", "lo", "up"]]
    try:
        for step in steps:
            subprocess.run(["ip"] + step, check=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        yield names
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "delete", name], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
