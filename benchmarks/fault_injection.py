"""Fault injection: randomized jobs in which one rank dies, elastic and plain.

    python benchmarks/fault_injection.py [--runs 100] [--seed 1] [--json out.json]
    python benchmarks/fault_injection.py --second-dies-joining [--runs 30]

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
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        hung = True
    output = output.decode(errors="replace")
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
    args = parser.parse_args()
    results = []
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
