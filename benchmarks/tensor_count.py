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
from unison import basics, collective, dtypes
from unison._native import ffi, lib


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=8.0, help="bytes of every variant, in MB (1e6)")
    parser.add_argument("--counts", default="1,2,20,200", help="tensor counts to compare; the first is the base")
    parser.add_argument("--repetitions", type=int, default=300)
    args = parser.parse_args()
    unison.init()
    counts = [int(c) for c in args.counts.split(",")]
    float32 = dtypes.code_of("float32", "tensor_count")
    handle = ffi.new("unison_handle*")
    variants = []
    for count in counts:
        each = int(args.megabytes * 1e6) // 4 // count
        arrays = [np.ones(each, dtype=np.float32) for _ in range(count)]
        options = []
        for i, a in enumerate(arrays):
            prepared = collective.prepare(lib.UNISON_ALLREDUCE, "count%d.%d" % (count, i), float32, a.shape,
                                          unison.Sum, 1.0, 1.0, 0, None, 0, lib.UNISON_CPU_DEVICE)
            prepared[0].input = prepared[0].output = ffi.from_buffer(a)
            options.append(prepared)  # keeps the struct's C memory alive
        variants.append((count, arrays, options))

    def run(options):
        started = []
        begun = time.perf_counter()
        for o, *_ in options:
            basics.check(lib.unison_enqueue(o, handle))
            started.append(handle[0])
        enqueued = time.perf_counter() - begun
        for handle_id in started:
            basics.check(lib.unison_wait_release(handle_id, 60.0))
        return enqueued

    wall = {count: [] for count in counts}
    cpu = dict.fromkeys(counts, 0.0)
    enqueue = {count: [] for count in counts}
    for _ in range(3):
        for _, _, options in variants:
            run(options)
    for _ in range(args.repetitions):
        for count, _, options in variants:
            cpu_before, before = time.process_time(), time.perf_counter()
            enqueue[count].append(run(options))
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
