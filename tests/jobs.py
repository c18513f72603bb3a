"""What the tests that start whole jobs share: running unisonrun, running a
suite of tests/parallel inside every rank, and small rank scripts."""
import os
import random
import re
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CORE_SUITES = ["test_core_grid.py", "test_core_ops.py", "test_core_errors.py", "test_core_training.py",
               "test_core_process_sets.py", "test_core_lifecycle.py", "test_core_timeline.py"]


def run_job(command, timeout, env=None, cwd=HERE, stderr=subprocess.STDOUT):
    """Runs a job (unisonrun, mpirun) to its end, its output captured. One
    that outlives `timeout` fails the test with what it had printed, which
    names where it hung: it is sent SIGTERM (unisonrun ends its ranks with
    it), then SIGKILL. subprocess.run's own timeout would discard that
    output."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, cwd=cwd, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        printed = (out or b"").decode(errors="replace") + (err or b"").decode(errors="replace")
        raise AssertionError("%s\nran past its %d s and was ended; what it printed:\n%s"
                             % (" ".join(command), timeout, failure_digest(printed))) from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def unisonrun(options, command, env=None, timeout=300, base=None):
    full = [sys.executable, "-m", "unison.run"] + options + command
    return run_job(full, timeout, env=dict(base if base is not None else os.environ, **(env or {})))


def pytest_command(*suites, seconds=120, options=("-x",)):
    """pytest inside a rank, running the suites in one session. A test that
    outlives `seconds` (--rank-timeout), even blocked in native code, ends
    its rank after the rank prints every thread's stack
    (tests/parallel/conftest.py's watchdog, which stands in for
    pytest-timeout there); the launcher then ends the job.

    Two plugins stay out of the ranks:
    - pytest's logging plugin, whose capture attaches a handler to every
      logger that does not propagate, three times a test: torch has 54,
      and that cost torch's grid 15% of a rank's CPU. What the suites log
      still reaches the captured stderr, from WARNING up as before, and
      no suite reads captured records (caplog);
    - hypothesis's, which imports hypothesis into every rank (0.1-0.3 s of
      CPU each): test_core_fuzz.py's @given runs the same without it, and
      the failing case it found still reaches the report, in the error."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging",
            "-p", "no:hypothesispytest", "-p", "no:timeout", "--rank-timeout=%g" % seconds, *options] + \
        [os.path.join(HERE, "parallel", suite) for suite in suites]


# conftest.py's: how the running test reports the tests its ranks ran.
record_property = None


# pytest's closing line in a rank: "594 passed, 1 skipped in 3.41s", with
# "2 failed, " first where tests failed ("1 error" after, where one erred).
_SUMMARY = re.compile(r"(?:\d+ failed, )?\d+ passed[^\n]*? in [\d.]+s")


def assert_every_rank_passed(proc, ranks):
    output = proc.stdout.decode(errors="replace")
    # Found anywhere, not line by line: ranks that share one stdout without
    # the launcher's prefixes (torchrun's) can write their closing lines
    # into one ("594 passed, 1 skipped in 12.99s594 passed, ...").
    summaries = _SUMMARY.findall(output)
    print("\n".join(summaries))
    assert proc.returncode == 0, failure_digest(output)
    assert len([s for s in summaries if "failed" not in s and "error" not in s]) == ranks, failure_digest(output)
    counts = [int(found.group(1)) for found in (re.search(r"(\d+) passed", s) for s in summaries) if found]
    if record_property is not None and counts:
        record_property("rank_tests", max(counts))


# tests/parallel/conftest.py prints each failure as it happens, under this
# header; unisonrun puts "[rank]<stdout>:" before each line of a rank.
_REPORT = re.compile(r"^(\[\d+\]<std\w+>:)?unison test: \S+ failed in \w+ on rank (\S+):")
_KEPT = re.compile(r"^(E |\S+\.py:\d+: )")


def failure_digest(output, tail=8000):
    """What a failed job's assertion shows: each rank's first failure,
    cut to its error lines and the places they were raised, then the end of
    the output. The end alone is not enough: when one rank fails, the
    others fail after it in the collective it left (their reports come
    last and are long), and the first failure, the cause, scrolls out of
    what CI prints."""
    lines = output.splitlines()
    digests, ranks_seen = [], set()
    for i, line in enumerate(lines):
        found = _REPORT.match(line)
        if not found or found.group(2) in ranks_seen:
            continue
        ranks_seen.add(found.group(2))
        prefix = found.group(1) or ""  # without one (plain mpirun), the next lines may be any rank's
        kept = []
        for text in lines[i + 1:i + 600]:
            if not text.startswith(prefix):
                continue
            text = text[len(prefix):]
            if text.startswith("=====") or _REPORT.match(text):  # pytest's own summary, or the next report
                break
            if _KEPT.match(text):
                kept.append(text)
        digests.append(line[len(prefix):] + "\n" + "\n".join(kept[-40:]))
    if not digests:  # no rank printed a failure (a crash, a hang): the end is all there is
        return output[-20000:]
    return ("each rank's first failure, in the order they were printed:\n\n" + "\n\n".join(digests) +
            "\n\n---- the last %d characters of the output ----\n" % tail + output[-tail:])


# Each rank prints its identity (rank, local rank, local size, cross rank,
# cross size, is_homogeneous), the backend, and whether an mpirun is on PATH.
IDENTITY = """
import os, shutil, numpy as np, unison, unison.numpy as unp
unison.init()
r, n = unison.rank(), unison.size()
total = unp.allreduce(np.array([r + 1], dtype=np.int64), op=unison.Sum, name="total")
who = unp.allgather(np.array([[r, unison.local_rank(), unison.local_size(), unison.cross_rank(),
                               unison.cross_size(), int(unison.is_homogeneous())]], dtype=np.int64), name="who")
print("rank %d of %d: %s total %d who %s mpirun %s" % (r, n, unison.basics.backend_name(), total[0], who.tolist(),
                                                     shutil.which("mpirun")))
"""

# Rank 3 kills itself mid-training.
KILLED = """
import os, time, numpy as np, unison, unison.numpy as unp
unison.init()
for step in range(20):
    unp.allreduce(np.ones(1000), name="step")
    if step == 5 and unison.rank() == 3:
        os.kill(os.getpid(), 9)
    time.sleep(0.05)
time.sleep(60)  # only a rank the launcher fails to stop gets here
"""

# Rank 1 exits with status 3 while the others sleep.
EXITS = """
import sys, time, numpy as np, unison, unison.numpy as unp
unison.init()
unp.allreduce(np.ones(3), name="first")
if unison.rank() == 1:
    sys.exit(3)
time.sleep(60)  # the others are busy elsewhere: the launcher must stop them
"""


def elastic_job(tmp_path, options, script, env=None, timeout=240):
    """Runs tests/elastic/<script> under the elastic launcher; returns the
    launcher's process and every worker's events, by worker."""
    import glob
    import json

    log = tmp_path / "events"
    log.mkdir()
    proc = unisonrun(options, [sys.executable, os.path.join(HERE, "elastic", script)],
                     env=dict({"ELASTIC_LOG": str(log)}, **(env or {})), timeout=timeout)
    events = {}
    for path in glob.glob(str(log / "*.jsonl")):
        with open(path) as f:
            lines = [json.loads(line) for line in f]
        events[lines[0]["worker"]] = lines
    return proc, events


def random_kills(seed, window_ms, tmp_path=None, steps=None):
    """An elastic job drawn from `seed`: two or three host names for this
    machine, of one or two slots each, and a worker on one host (or on each
    of two, with three) that SIGKILLs itself within `window_ms` of its
    first step (tests/elastic/faults.py: ELASTIC_KILL_AFTER). The moment
    falls wherever it falls: in a collective, a commit, a reset, or the
    next round's start-up after an earlier kill.

    With tmp_path, the job instead starts on one or two hosts, found by a
    discovery script, and rank 0 adds one more at a random step before
    steps / 2; the kills may fall on any host, newcomers included,
    but spare one host the job started with.

    Returns the launcher's options, the environment, the slots by host, and
    the added host (None without one), which a short job may end without."""
    rng = random.Random(seed)
    names = ["localhost", "127.0.0.1", "127.0.0.2"]
    if tmp_path is None:
        names = names[:rng.choice([2, 3])]
    slots = {host: rng.choice([1, 2]) for host in names}
    started, added, env = names, None, {}
    if tmp_path is not None:
        started = names[:rng.choice([1, 2])]
        added = names[len(started)]
        names = started + [added]
        slots = {host: slots[host] for host in names}
        script, listing = discovery_script(tmp_path, ["%s:%d" % (h, slots[h]) for h in started])
        env["ELASTIC_ADD"] = "%d:%s:%s:%d" % (rng.randrange(1, steps // 2), listing, added, slots[added])
    victims = rng.sample(names, rng.choice([1, len(names) - 1]))
    if all(h in victims for h in started):
        victims.remove(started[0])  # else the job would wait for hosts that may never come
    env["ELASTIC_KILL_AFTER"] = ",".join("%s:%d:%d" % (h, rng.randrange(slots[h]), rng.randrange(window_ms))
                                         for h in victims)
    options = ["-np", str(sum(slots[h] for h in started)), "--min-np", "1"]
    if tmp_path is None:
        options += ["-H", ",".join("%s:%d" % item for item in slots.items())]
    else:
        options += ["--max-np", str(sum(slots.values())), "--host-discovery-script", script]
    return options, env, slots, added


def assert_only_the_killed_left(proc, events, slots, added=None):
    """The job of random_kills ended well, on every slot of every host none
    of whose workers was killed (the added host's, if it came in time); no
    survivor, newcomers included, was taken for hung or let a failed
    start-up end it, and no host was blacklisted but for a kill. Returns
    how many ranks finished."""
    output = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, failure_digest(output)
    killed = {e["worker"].rsplit(":", 1)[0] for worker in events.values() for e in worker if e["event"] == "fault"}
    blacklisted = set(re.findall(r"unisonrun: blacklisting host (\S+):", output))
    assert blacklisted == killed, (killed, failure_digest(output))
    done = [e for worker in events.values() for e in worker if e["event"] == "done"]
    finished = {e["worker"].rsplit(":", 1)[0] for e in done}
    if added in finished or added in killed:
        added = None
    survivors = sum(n for host, n in slots.items() if host not in killed and host != added)
    assert len(done) == survivors and {e["size"] for e in done} == {survivors}, (done, failure_digest(output))
    return survivors


def run_random_kills(tmp_path, seed, host_added, steps, look=None):
    """One job of random_kills, on hosts fixed or with one added by the
    discovery script midway, running tests/elastic/train_numpy.py for
    `steps`; checked to end with the exact sum of the committed steps on
    every survivor. look(output), if given, sees the launcher's output
    first (sanitized_suites.py looks for reports)."""
    options, env, slots, added = random_kills(seed, window_ms=1500 if host_added else 400,
                                              tmp_path=tmp_path if host_added else None, steps=steps)
    proc, events = elastic_job(tmp_path, options, "train_numpy.py", env=dict(env, ELASTIC_STEPS=str(steps)))
    if look is not None:
        look(proc.stdout.decode(errors="replace"))
    assert_only_the_killed_left(proc, events, slots, added)
    expected = sum(range(1, steps + 1))
    for e in (e for worker in events.values() for e in worker if e["event"] == "done"):
        assert e["step"] == steps and e["total"] == [expected] * 3, e


def discovery_script(tmp_path, hosts):
    """A --host-discovery-script printing a file the test (or a rank) edits."""
    listing = tmp_path / "hosts.txt"
    listing.write_text("".join(h + "\n" for h in hosts))
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\ncat %s\n" % listing)
    script.chmod(0o755)
    return str(script), str(listing)
