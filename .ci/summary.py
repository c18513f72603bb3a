"""What a CI run cost, printed at its end: each tox environment's time,
CPU time and test count, the total, and the slowest tests of the whole run,
by wall time and by CPU time, so that a change that makes the suite slower
shows in its own CI output.

Reads tox's report at the end of the run's saved output (ENV_LINE), and
each environment's JUnit report, which tox.ini has pytest write to
.tox/<env>/junit.xml.

    python3 .ci/summary.py --machine > MACHINE_AT_START
    python3 .ci/summary.py --sample PYTHON_SAMPLES &   # until killed
    python3 .ci/summary.py OUTPUT_LOG WALL_SECONDS [PROC_STAT_AT_START [MACHINE_AT_START [PYTHON_SAMPLES]]]

The heading gives the machine's CPU, its single-core memcpy speed and its
Python speed (a fixed interpreter loop), which say how far runs on
different VMs compare: measured as the run ends, and as it began where
MACHINE_AT_START was saved then, since a VM's speed can change within a
run. PYTHON_SAMPLES, the loop timed every SAMPLE_SECONDS through the run
beside the tests, adds its median and range: one sample at either end
said little about a 40-minute run (two runs of the same time and CPU
ended at 173 and 347 ns).

PROC_STAT_AT_START, the first line of /proc/stat saved as the run began,
adds how busy the machine's cores were over the run: a run whose cores
idle much of the time could run more environments side by side; one whose
cores are busy throughout gets faster only by doing less, and its tests'
CPU time (conftest.py records each one's, its jobs' ranks included) says
where.
"""
import os
import re
import sys
import time
import xml.etree.ElementTree as ElementTree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOWEST = 15
SAMPLE_SECONDS = 120  # each sample is 1,000,000 loop iterations: about 0.2 s of one core
# tox's report at the end of the run: "  core: OK (799.78=setup[66.71]+cmd[733.07] seconds)", or
# "  mpi: FAIL code 1 (506.69=...)", with a cmd entry per command (an env's own build, in commands_pre, comes before its pytest).
ENV_LINE = re.compile(r"^\s*(\S+): (OK|FAIL|SKIP)[^(]* \(([\d.]+)=setup\[([\d.]+)\]\+cmd\[([\d.,]*)\] seconds\)")


def memcpy_gigabytes_per_second(nbytes=64 << 20):
    """Single-core copy speed, the figure that says how fast a VM moves
    memory: runs on different VMs compare only beside it."""
    source, target = bytearray(b"\1") * nbytes, bytearray(nbytes)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            target[:] = source
        best = min(best, (time.perf_counter() - start) / 10)
    return nbytes / best / 1e9


def python_nanoseconds_an_iteration(iterations=200000):
    """The interpreter's speed: a fixed loop of dict, int and str work, the
    best of 5. Most of the suite's CPU is Python (the tests, and the
    frameworks' imports in every rank), and a VM's Python speed can change
    where its memcpy does not: on 2026-12-07 one VM ran this loop at
    173-200 ns an iteration, and for a few minutes at 306-397 ns, at 9-10
    GB/s throughout."""
    def loop():
        table, total = {}, 0
        for i in range(iterations):
            table[i & 255] = i
            total += len(str(i)) + table[i & 255]
        return total
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        loop()
        best = min(best, time.perf_counter() - start)
    return best / iterations * 1e9


def machine_speed():
    """(single-core memcpy GB/s, Python ns a loop iteration), now."""
    return memcpy_gigabytes_per_second(), python_nanoseconds_an_iteration()


def cpu_model():
    """The CPU as /proc/cpuinfo names it ("" where it does not)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def speed_heading(at_start, at_end):
    """The heading's figures: each at the run's start and end, where the
    start was measured."""
    def both(index, form):
        end = form % at_end[index]
        return end if at_start is None else "%s at the start, %s at the end" % (form % at_start[index], end)
    return "single-core memcpy %s; Python loop iteration %s" % (both(0, "%.1f GB/s"), both(1, "%.0f ns"))


def sample_forever(path):
    """Appends the Python loop's time to `path` every SAMPLE_SECONDS, until
    killed or until the run that started it is gone (a CI run stopped from
    outside leaves no sampler behind)."""
    parent = os.getppid()
    while True:
        time.sleep(SAMPLE_SECONDS)
        if os.getppid() != parent:
            return
        with open(path, "a") as f:
            f.write("%.1f\n" % python_nanoseconds_an_iteration())


def samples_line(path):
    """What the samples taken through the run say, or None without any."""
    samples = []
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):  # not a line cut short as the sampler was stopped
                samples.append(float(line))
    samples.sort()
    if not samples:
        return None
    return ("the Python loop through the run, beside the tests: median %.0f ns an iteration, %.0f-%.0f ns "
            "(%d samples, one every %d s)" % (samples[len(samples) // 2], samples[0], samples[-1], len(samples),
                                              SAMPLE_SECONDS))


def env_times(log_path):
    """{env: (status, seconds, seconds before its tests)} from tox's report,
    in run order. Before the tests: making the env, installing, building."""
    times = {}
    with open(log_path, errors="replace") as f:
        for line in f:
            found = ENV_LINE.match(line.rstrip())
            if found:
                commands = [float(c) for c in found.group(5).split(",") if c]
                before = float(found.group(4)) + sum(commands[:-1])
                times[found.group(1)] = (found.group(2), float(found.group(3)), before)
    return times


def junit(env):
    """(counts by outcome and CPU seconds, [(seconds, CPU seconds, test id)],
    {skip reason: count}) from the env's JUnit report."""
    path = os.path.join(ROOT, ".tox", env, "junit.xml")
    counts = {"passed": 0, "failed": 0, "skipped": 0, "in ranks": 0, "cpu": 0.0}
    cases = []
    skips = {}
    if not os.path.exists(path):
        return None, cases, skips
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        cpu = 0.0
        for prop in case.iter("property"):
            if prop.get("name") == "rank_tests":
                counts["in ranks"] += int(prop.get("value"))
            elif prop.get("name") == "cpu_seconds":
                cpu = float(prop.get("value"))
        counts["cpu"] += cpu
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
                reason = child.get("message", "")
                skips[reason] = skips.get(reason, 0) + 1
        counts[outcome] += 1
        name = "%s::%s" % (case.get("classname", "").replace(".", "/") + ".py", case.get("name", ""))
        cases.append((float(case.get("time", 0) or 0), cpu, "%s %s" % (env, name)))
    return counts, cases, skips


def busy_fraction(stat_at_start):
    """The share of the cores' time spent running anything (user, nice,
    system, interrupts, steal) since /proc/stat's first line read
    `stat_at_start`, and the number of cores."""
    def times(line):
        fields = [int(v) for v in line.split()[1:]]
        idle = fields[3] + fields[4]  # idle and iowait
        return sum(fields[:8]), idle  # guest time is counted in user already
    total_then, idle_then = times(stat_at_start)
    with open("/proc/stat") as f:
        total_now, idle_now = times(f.readline())
    elapsed = total_now - total_then
    return (1 - (idle_now - idle_then) / elapsed if elapsed > 0 else 0.0), os.cpu_count()


def minutes(seconds):
    return "%d:%02d" % (seconds // 60, seconds % 60)


def main(log_path, wall_seconds, stat_path=None, machine_path=None, samples_path=None):
    times = env_times(log_path)
    reports = {env: junit(env) for env in times}
    everything = [case for counts, cases, skips in reports.values() for case in cases]
    # The environments run side by side, and tox shows an env's own output
    # only when it fails: what each skipped, and why, is said here instead.
    print("\nskipped, and why:")
    for env, reason, n in sorted((env, reason, n) for env, (_, _, skips) in reports.items()
                                 for reason, n in skips.items()):
        print("  %-10s %3d x %s" % (env, n, reason))
    print("\nthe %d slowest tests of the run (wall time, CPU time):" % SLOWEST)
    for seconds, cpu, name in sorted(everything, reverse=True)[:SLOWEST]:
        print("%8.1f s %8.1f s  %s" % (seconds, cpu, name))
    print("\nthe %d tests that took the most CPU time (wall time, CPU time):" % SLOWEST)
    for seconds, cpu, name in sorted(everything, key=lambda case: -case[1])[:SLOWEST]:
        print("%8.1f s %8.1f s  %s" % (seconds, cpu, name))
    # The table last: where only the end of CI's output is shown, it is
    # what shows.
    at_start = None
    if machine_path:
        with open(machine_path) as f:
            at_start = tuple(float(x) for x in f.read().split())
    model = cpu_model()
    print("\n==== CI summary (%s%s) ====" % (model + "; " if model else "", speed_heading(at_start, machine_speed())))
    print("%-12s %-6s %8s %8s %8s %8s %8s %8s %9s" % ("env", "status", "time", "set-up", "tests' CPU", "passed",
                                                      "failed", "skipped", "in ranks"))
    totals = {"passed": 0, "failed": 0, "skipped": 0, "in ranks": 0, "cpu": 0.0}
    for env, (status, seconds, before) in times.items():
        counts = reports[env][0]
        if counts is None:
            print("%-12s %-6s %8s %8s %8s" % (env, status, minutes(seconds), minutes(before), "(no report)"))
            continue
        for k in totals:
            totals[k] += counts[k]
        print("%-12s %-6s %8s %8s %8s %8d %8d %8d %9d" % (env, status, minutes(seconds), minutes(before),
                                                           minutes(counts["cpu"]), counts["passed"], counts["failed"],
                                                           counts["skipped"], counts["in ranks"]))
    print("%-12s %-6s %8s %8s %8s %8d %8d %8d %9d" % ("total", "", minutes(wall_seconds), "", minutes(totals["cpu"]),
                                                       totals["passed"], totals["failed"], totals["skipped"],
                                                       totals["in ranks"]))
    print("(tests' CPU: what the env's tests and their jobs' ranks ran on the cores, set-up not included;"
          " in ranks: the tests that rank 0 of each job ran inside it, each job counting once above)")
    if stat_path:
        with open(stat_path) as f:
            busy, cores = busy_fraction(f.readline())
        print("the %d cores were busy %.0f%% of the run" % (cores, 100 * busy))
    if samples_path:
        line = samples_line(samples_path)
        if line:
            print(line)


if __name__ == "__main__":
    if sys.argv[1:] == ["--machine"]:
        print("%.3f %.1f" % machine_speed())
    elif sys.argv[1] == "--sample":
        sample_forever(sys.argv[2])
    else:
        main(sys.argv[1], float(sys.argv[2]), *sys.argv[3:6])
