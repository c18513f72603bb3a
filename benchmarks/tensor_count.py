"""The same bytes allreduced as 1, 2, 20 or 200 tensors: what each tensor
costs the core, apart from any front end.

    unisonrun -np 2 python benchmarks/tensor_count.py [--megabytes 8] [--counts 1,2,20,200]

Every variant goes through the C API alone (unison.h's unison_enqueue and
unison_wait_release, options filled beforehand), so the figures are the
core's: negotiation, fusion, the data plane and completion. The variants
take turns every repetition, so machine noise falls on all of them alike.
Each rank prints the median wall time of each variant, its ratio to the
single tensor, the CPU time its process used per repetition (all threads),
and how long the loop of enqueues alone took.
"""
import argparse
import statistics
import time

import numpy as np

import unison
from timing import core_allreduces

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=8.0, help="bytes of every variant, in MB (1e6)")
    parser.add_argument("--counts", default="1,2,20,200", help="tensor counts to compare; the first is the base")
    parser.add_argument("--repetitions", type=int, default=300)
    args = parser.parse_args()
    unison.init()
    counts = [int(c) for c in args.counts.split(",")]
    variants = []  # (count, the function that allreduces that many arrays)
    for count in counts:
        each = int(args.megabytes * 1e6) // 4 // count
        arrays = [np.ones(each, dtype=np.float32) for _ in range(count)]
        variants.append((count, core_allreduces(arrays, ["count%d.%d" % (count, i) for i in range(count)])))

    wall = {count: [] for count in counts}
    cpu = dict.fromkeys(counts, 0.0)
    enqueue = {count: [] for count in counts}
    for _ in range(3):
        for _, run in variants:
            run()
    for _ in range(args.repetitions):
        for count, run in variants:
            cpu_before, before = time.process_time(), time.perf_counter()
            enqueue[count].append(run())
            wall[count].append(time.perf_counter() - before)
            cpu[count] += time.process_time() - cpu_before
    base = statistics.median(wall[counts[0]])
    lines = ["rank %d of %d, %.1f MB a repetition:" % (unison.rank(), unison.size(), args.megabytes)]
    for count in counts:
        median = statistics.median(wall[count])
        lines.append("  %4d tensors: %.3f ms (%.2fx %d), CPU %.3f ms, enqueue loop %.3f ms"
                     % (count, median * 1e3, median / base, counts[0], cpu[count] / args.repetitions * 1e3,
                        statistics.median(enqueue[count]) * 1e3))
    print("\n".join(lines), flush=True)
    unison.shutdown()


if __name__ == "__main__":
    main()
