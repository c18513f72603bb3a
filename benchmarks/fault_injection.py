"""Fault injection: randomized jobs in which one rank dies, elastic and plain.

    python benchmarks/fault_injection.py [--runs 100] [--seed 1] [--json out.json]
    python benchmarks/fault_injection.py --second-dies-joining [--runs 30]
    python benchmarks/fault_injection.py --any-moment [--runs 40]

Each run picks, from its own seeded generator: 2 to 4 ranks over two
simulated hosts (localhost and 127.0.0.1), elastic or plain, the victim,
the step at which it fails, and how: SIGKILL, SIGSTOP (frozen, alive) or
os._exit(3). The job is tests/elastic/train_numpy.py, whose every step adds
exactly step + 1, so a finished job's total says whether every committed
step was applied once.

Expected endings:
- elastic: exit status 0, and every survivor ends with the exact total;
- plain: a non-zero exit status, and the output names the victim's rank.
A run still going after --timeout seconds is a hang.

Measured from the fault (the victim logs the moment before it fails):
- detection: until the first survivor's collective fails;
- recovery (elastic): until the first survivor resumes training in the
  next round.
Peer timeout is 3 s, so a frozen rank is detected after about 3 s, and an
elastic job's driver kills it 2 x 3 = 6 s after the first survivor
rejoined.

--second-dies-joining: elastic jobs over three simulated hosts (127.0.0.2
too) of one or two ranks each. One worker is killed at a random step, and a
worker of another host kills itself as soon as the driver places it in the
next round, before it reaches any other rank (ELASTIC_DIE_JOINING): the
survivors' first re-forming fails, and they must go on to the round after.
Recovery is then from the first fault until training resumes in the round
that follows the second.

--any-moment: plain jobs across two simulated hosts (flat TCP at 2 and 3
ranks, hierarchical and flat at 4), tests/killed_at_random.py: one rank is
SIGKILLed from outside at a random moment of a random stream of every
collective, so it dies mid-frame as often as between ops. The launcher's
grace period is long, so each survivor must end by itself. As expected:
every survivor fails with RankFailedError naming the victim (a survivor
that hears of it from another says so as well). Detection is from the kill
to the last survivor's error.
"""
import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "..", "tests", "elastic", "train_numpy.py")
STEPS = 30
PEER_TIMEOUT = 3


def plan(rng):
    np_ = rng.choice([2, 3, 4])
    first = rng.randint(1, np_ - 1)
    hosts = [("localhost", first), ("127.0.0.1", np_ - first)]
    victim_rank = rng.randrange(np_)
    host, slot = (hosts[0][0], victim_rank) if victim_rank < first else (hosts[1][0], victim_rank - first)
    return {"np": np_, "hosts": hosts, "elastic": rng.random() < 0.5, "how": rng.choice(["sigkill", "sigstop", "exit"]),
            "victim_rank": victim_rank, "victim": "%s:%d" % (host, slot), "step": rng.randint(3, STEPS - 8)}


def plan_second_dies_joining(rng):
    hosts = [(h, rng.choice([1, 2])) for h in ("localhost", "127.0.0.1", "127.0.0.2")]
    first, second = rng.sample(range(3), 2)
    victim = "%s:%d" % (hosts[first][0], rng.randrange(hosts[first][1]))
    joining = "%s:%d" % (hosts[second][0], rng.randrange(hosts[second][1]))
    return {"np": sum(n for _, n in hosts), "hosts": hosts, "elastic": True, "how": "sigkill", "victim": victim,
            "victim_rank": None, "step": rng.randint(3, STEPS - 8), "dies_joining": joining}


def run_job(command, env, timeout):
    """(the process, its output, whether it hung): a job still going after
    `timeout` seconds is killed, with every process of its session."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        hung = True
    return proc, output.decode(errors="replace"), hung


ANY_MOMENT_LAYOUTS = {"1+1": ["-np", "2", "-H", "localhost:1,127.0.0.1:1"],
                      "2+1": ["-np", "3", "-H", "localhost:2,127.0.0.1:1"],
                      "2x2": ["-np", "4", "-H", "localhost:2,127.0.0.1:2"],
                      "2x2-flat": ["-np", "4", "-H", "localhost:2,127.0.0.1:2", "--no-hierarchical-allreduce"]}


def plan_any_moment(rng):
    layout = rng.choice(sorted(ANY_MOMENT_LAYOUTS))
    np_ = int(ANY_MOMENT_LAYOUTS[layout][1])
    return {"layout": layout, "np": np_, "victim_rank": rng.randrange(np_), "delay": rng.uniform(0.3, 2.0),
            "seed": rng.randrange(1 << 30)}


def run_any_moment(run, timeout):
    import re

    script = os.path.join(HERE, "..", "tests", "killed_at_random.py")
    command = ([sys.executable, "-m", "unison.run"] + ANY_MOMENT_LAYOUTS[run["layout"]] +
               ["--failure-grace-seconds", str(timeout)] +
               [sys.executable, script, str(run["seed"]), str(run["victim_rank"]), "%.3f" % run["delay"]])
    started = time.time()
    _, output, hung = run_job(command, None, timeout)
    killed = re.search(r"killed at ([0-9.]+)", output)
    survivors = re.findall(r"survivor (\d) at ([0-9.]+), after [0-9.]+ s: (\w+): (.*)", output)
    victim = run["victim_rank"]
    result = dict(run, hung=hung, seconds=time.time() - started)
    result["as_expected"] = (not hung and bool(killed)
                             and sorted(int(r) for r, _, _, _ in survivors) == [r for r in range(run["np"]) if r != victim]
                             and all(kind == "RankFailedError" and message.startswith("unison: rank %d (" % victim)
                                     for _, _, kind, message in survivors))
    if killed and survivors:
        result["detection"] = max(float(at) for _, at, _, _ in survivors) - float(killed.group(1))
    if not result["as_expected"]:
        result["output_tail"] = output[-3000:]
    return result


def summarize_any_moment(results):
    lines = ["| layout | runs | every survivor names the victim | hangs | detection, last survivor (median / max) |",
             "| --- | --- | --- | --- | --- |"]
    for layout in sorted(ANY_MOMENT_LAYOUTS):
        group = [r for r in results if r["layout"] == layout]
        if not group:
            continue
        detections = [r["detection"] for r in group if r.get("detection") is not None]
        lines.append("| %s | %d | %d | %d | %s |" % (
            layout, len(group), sum(r["as_expected"] for r in group), sum(r["hung"] for r in group),
            "%.2f / %.2f s" % (statistics.median(detections), max(detections)) if detections else "-"))
    lines.append("")
    lines.append("%d runs: %d as expected, %d hangs." % (len(results), sum(r["as_expected"] for r in results),
                                                       sum(r["hung"] for r in results)))
    return "\n".join(lines)


def events_in(folder):
    events = []
    for path in glob.glob(os.path.join(folder, "*.jsonl")):
        with open(path) as f:
            events += [json.loads(line) for line in f]
    return events


def run_one(run, timeout):
    folder = tempfile.mkdtemp(prefix="unison-faults-")
    hosts = ",".join("%s:%d" % h for h in run["hosts"])
    options = ["-np", str(run["np"]), "-H", hosts, "--peer-timeout-seconds", str(PEER_TIMEOUT)]
    env = dict(os.environ, ELASTIC_LOG=folder, ELASTIC_STEPS=str(STEPS))
    if run["elastic"]:
        options += ["--min-np", "1"]
        env["ELASTIC_FAULT"] = "%s@%d:%s" % (run["victim"], run["step"], run["how"])
        if run.get("dies_joining"):
            env["ELASTIC_DIE_JOINING"] = run["dies_joining"] + "@1"
    else:
        env["ELASTIC_PLAIN"] = "1"
        env["ELASTIC_FAULT"] = "rank%d@%d:%s" % (run["victim_rank"], run["step"], run["how"])
    command = [sys.executable, "-m", "unison.run"] + options + [sys.executable, JOB]
    started = time.time()
    proc, output, hung = run_job(command, env, timeout)
    events = events_in(folder)
    fault = [e for e in events if e["event"] == "fault"]
    detected = sorted(e["time"] for e in events if e["event"] == "detected")
    result = dict(run, status=proc.returncode, hung=hung, seconds=time.time() - started)
    if fault:
        at = min(e["time"] for e in fault)
        result["detection"] = detected[0] - at if detected else None
        resumed = sorted(e["time"] for e in events if e["event"] == "sync" and e["time"] > at)
        last = max(e["time"] for e in fault)
        resumed = [t for t in resumed if t > last]
        result["recovery"] = resumed[0] - at if resumed else None
    expected_total = [float(sum(range(1, STEPS + 1)))] * 3
    done = [e for e in events if e["event"] == "done"]
    if hung:
        result["as_expected"] = False
    elif run["elastic"]:
        lost = {name.rsplit(":", 1)[0] for name in (run["victim"], run.get("dies_joining")) if name}
        survivors = run["np"] - sum(n for host, n in run["hosts"] if host in lost)
        result["as_expected"] = (proc.returncode == 0 and len(done) == survivors and len(fault) == len(lost)
                                 and all(e["total"] == expected_total for e in done))
    else:
        result["as_expected"] = (proc.returncode != 0 and bool(fault)
                                 and ("rank %d " % run["victim_rank"]) in output)
    if not result["as_expected"]:
        result["output_tail"] = output[-3000:]
    return result


def summarize(results):
    def seconds(values):
        values = [v for v in values if v is not None]
        if not values:
            return "-"
        return "%.2f / %.2f s" % (statistics.median(values), max(values))

    lines = ["| job | fault | runs | as expected | hangs | detection (median / max) | recovery (median / max) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for elastic in (True, False):
        for how in ("sigkill", "exit", "sigstop"):
            group = [r for r in results if r["elastic"] == elastic and r["how"] == how]
            if not group:
                continue
            lines.append("| %s | %s | %d | %d | %d | %s | %s |" % (
                "elastic" if elastic else "plain", how, len(group), sum(r["as_expected"] for r in group),
                sum(r["hung"] for r in group), seconds(r.get("detection") for r in group),
                seconds(r.get("recovery") for r in group) if elastic else "-"))
    total = len(results)
    lines.append("")
    lines.append("%d runs: %d as expected, %d hangs." % (total, sum(r["as_expected"] for r in results),
                                                       sum(r["hung"] for r in results)))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120, help="seconds after which a run counts as hung")
    parser.add_argument("--json", help="write every run's result here")
    parser.add_argument("--second-dies-joining", action="store_true",
                        help="elastic jobs on three hosts in which a second worker dies joining the next round")
    parser.add_argument("--any-moment", action="store_true",
                        help="plain jobs across hosts in which a rank is killed at any moment of any collective")
    args = parser.parse_args()
    results = []
    if args.any_moment:
        # No MPI: these layouts are for the TCP data plane.
        os.environ["PATH"] = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                                             if not os.path.exists(os.path.join(d, "mpirun")))
        for index in range(args.runs):
            run = plan_any_moment(random.Random(args.seed * 100003 + index))
            result = run_any_moment(run, args.timeout)
            results.append(result)
            print("run %3d: %-8s victim %d after %.2f s -> %s, last survivor %s s after the kill (%.1f s)" % (
                index, run["layout"], run["victim_rank"], run["delay"],
                "as expected" if result["as_expected"] else "UNEXPECTED" + (" HUNG" if result["hung"] else ""),
                "%.2f" % result["detection"] if result.get("detection") is not None else "-", result["seconds"]),
                flush=True)
            if not result["as_expected"]:
                print(result["output_tail"], flush=True)
        print()
        print(summarize_any_moment(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0 if all(r["as_expected"] for r in results) else 1
    for index in range(args.runs):
        rng = random.Random(args.seed * 100003 + index)
        run = plan_second_dies_joining(rng) if args.second_dies_joining else plan(rng)
        result = run_one(run, args.timeout)
        results.append(result)
        print("run %3d: %-7s np %d %-7s victim %-12s step %2d -> %s%s (%.1f s)" % (
            index, "elastic" if run["elastic"] else "plain", run["np"], run["how"], run["victim"], run["step"],
            "as expected" if result["as_expected"] else "UNEXPECTED", " HUNG" if result["hung"] else "",
            result["seconds"]), flush=True)
        if not result["as_expected"]:
            print(result["output_tail"], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print()
    print(summarize(results))
    return 0 if all(r["as_expected"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
