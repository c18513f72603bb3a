"""Autotune against the defaults and against a bad setting, on torch training.

    python benchmarks/autotune.py [--np 2] [--rounds 3]
    python benchmarks/autotune.py --width 128 --depth 100 --rounds 5 --steps 100   # many small tensors

Runs torch_train.py's MLP (unison's DistributedOptimizer) as separate
jobs, since settings are a job's: with the defaults, with two
deliberately bad settings (a 64 KiB fusion threshold, a 10 ms cycle time),
and with --autotune, in turn for each round so that all see the same
machine noise. A job trains
until the autotuner has settled (or as many warm-up steps for the others),
then times --steps steps and prints the slowest rank's samples/s. The
figure is the median over rounds; the autotuned job's choice is printed.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = [("defaults", []), ("64 KiB fusion threshold", ["--fusion-threshold-mb", "0.0625"]),
           ("10 ms cycle time", ["--cycle-time-ms", "10"]), ("--autotune", ["--autotune"])]


def job(args):
    """One rank of one job."""
    import torch
    import unison
    import unison.torch as hvd
    sys.path.insert(0, HERE)
    from torch_train import make_model, slowest

    torch.set_num_threads(1)
    hvd.init()
    x, y = torch.randn(args.batch_size, args.width), torch.randint(0, 10, (args.batch_size,))
    model = make_model(args.width, args.depth)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    warmup = 0
    while warmup < args.max_warmup:
        step()
        warmup += 1
        # Rank 0's answer for all: ranks must leave the loop at the same step.
        if hvd.broadcast_object(unison.basics.tuned_settings()["settled"], 0, name="settled"):
            break
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = slowest(time.perf_counter() - start)
    if hvd.rank() == 0:
        s = unison.basics.tuned_settings()
        print("RESULT %.1f samples/s after %d warm-up steps; fusion %d KiB, cycle %g ms, cache %s" % (
            args.steps * args.batch_size * hvd.size() / seconds, warmup, s["fusion_threshold_bytes"] >> 10,
            s["cycle_time_ms"], "on" if s["cache"] else "off"), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per job")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--max-warmup", type=int, default=400,
                        help="steps before timing: until the autotuner settles, at most this many")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(args)
    results = {name: [] for name, _ in CONFIGS}
    notes = {}
    for round_number in range(args.rounds):
        for name, options in CONFIGS:
            command = [sys.executable, "-m", "unison.run", "-np", str(args.np)] + options + [
                sys.executable, os.path.abspath(__file__), "--job", "--steps", str(args.steps),
                "--batch-size", str(args.batch_size), "--width", str(args.width), "--depth", str(args.depth),
                "--max-warmup", str(args.max_warmup if name == "--autotune" else 20)]
            out = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1200).stdout.decode()
            match = re.search(r"RESULT ([\d.]+) samples/s (.*)", out)
            if not match:
                print(out[-3000:])
                return 1
            results[name].append(float(match.group(1)))
            notes[name] = match.group(2)
            print("round %d  %-24s %8.1f samples/s  (%s)" % (round_number + 1, name, results[name][-1], notes[name]),
                  flush=True)
    base = statistics.median(results["defaults"])
    print()
    print("| setting | samples/s (median of %d) | / defaults | what the job ended with |" % args.rounds)
    print("| --- | --- | --- | --- |")
    for name, _ in CONFIGS:
        median = statistics.median(results[name])
        print("| %s | %.0f | %.2fx | %s |" % (name, median, median / base, notes[name]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
