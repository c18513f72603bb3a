"""Where a tensor lies against a page: 200 views of one array against 200
separate arrays, allreduced asynchronously, side by side in one run.

    unisonrun -np 2 python benchmarks/copy_distance.py

The same 200 x 40 KB take a different path through memcpy depending on
how far each tensor starts from the shared slot it is copied to or from,
modulo 4 KiB (native/copy.h): glibc's `rep movsb` is ten times slower on
AMD CPUs when that distance is a few bytes. Views of one array all share
one distance, set here by where the array starts in its page; separate
arrays each have their own. Rank 0 prints, for each starting offset, the
views' time over the separate arrays': about 1.0 when the core copies at
full speed at every distance, 1.5-2x when it does not (before native/copy.h).
"""
import argparse
import statistics

import numpy as np

import unison
import unison.numpy as unp
from timing import agree, timed

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)

COUNT, EACH = 200, 10_000   # 200 float32 tensors of 40 KB


def array_at_page_offset(offset, count):
    """`count` float32 elements starting `offset` bytes into a page."""
    raw = np.empty(count * 4 + 8192, dtype=np.uint8)
    start = (offset - raw.ctypes.data) % 4096
    out = raw[start:start + count * 4].view(np.float32)
    out[:] = 1
    return out


def allreduce_all(arrays, names):
    def run():
        handles = [unp.allreduce_async_(a, op=unison.Sum, name=n) for a, n in zip(arrays, names)]
        for h in handles:
            unp.synchronize(h)
    return run


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    unison.init()
    names = ["dist.%d" % i for i in range(COUNT)]
    separate = [np.ones(EACH, dtype=np.float32) for _ in range(COUNT)]
    cases = [("separate arrays", allreduce_all(separate, names))]
    for offset in (0, 4, 16, 28, 60):
        whole = array_at_page_offset(offset, COUNT * EACH)
        views = [whole[i * EACH:(i + 1) * EACH] for i in range(COUNT)]
        cases.append(("views, %d bytes into a page" % offset, allreduce_all(views, names)))
    times = {label: [] for label, _ in cases}
    for _ in range(args.blocks):
        for label, run in cases:   # every case in every block: the same noise for each
            unp.barrier()
            run()
            times[label].append(agree(timed(run, args.iterations)))
    medians = {label: statistics.median(t) for label, t in times.items()}
    base = medians["separate arrays"]
    if unison.rank() == 0:
        print("200 x 40 KB float32, allreduce_async_ then synchronize, %d ranks, median of %d blocks"
              % (unison.size(), args.blocks))
        print()
        print("| tensors | time | / separate arrays |")
        print("| --- | --- | --- |")
        for label, _ in cases:
            print("| %s | %.2f ms | %.2fx |" % (label, medians[label] * 1e3, medians[label] / base))
    unison.shutdown()


if __name__ == "__main__":
    main()
