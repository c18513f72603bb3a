"""Shared-memory round size: allreduce bandwidth for several
UNISON_SHM_SLOT_BYTES values, side by side in one run.

    unisonrun -np 2 python benchmarks/round_size.py
    unisonrun -np 2 python benchmarks/round_size.py --slots 16M,4M --blocks 9
    unisonrun -np 3 python benchmarks/round_size.py --sizes 256K,4M,38M

A collective larger than half a slot moves in rounds of half a slot. The
slot size is read when unison starts, so the ranks shut unison down and
start it again with the next size before every block: the sizes alternate
through the run and share the machine's noise. Each figure is the median
over blocks of the slowest rank's time; rank 0 prints the table.
"""
import argparse
import os
import statistics
import time

import numpy as np

import unison
import unison.numpy as unp

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)

SIZES = "1M,16M,64M"


def parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def block(nbytes, seconds_of_data=0.05):
    """One block at the current slot size: GB/s of the slowest rank."""
    x = np.ones(nbytes // 4, dtype=np.float32)
    iterations = max(3, int(seconds_of_data * 8e9 / nbytes))
    unp.allreduce_(x, name="round.%d" % nbytes)  # warm-up and negotiation cache
    unp.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        unp.allreduce_(x, name="round.%d" % nbytes)
    elapsed = (time.perf_counter() - start) / iterations
    slowest = float(unp.allreduce(np.array(elapsed), op=unison.Max, name="round.agree"))
    return nbytes / slowest / 1e9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--slots", default="16M,8M,4M,2M,1M", help="slot sizes to compare (bytes, or with K/M/G)")
    parser.add_argument("--sizes", default=SIZES, help="allreduce sizes to time (bytes, or with K/M/G)")
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    slots = [(label, parse_bytes(label)) for label in args.slots.split(",")]
    sizes = [(_human(parse_bytes(label)), parse_bytes(label)) for label in args.sizes.split(",")]
    results = {}
    rank = size = None
    for _ in range(args.blocks):
        for label, slot in slots:
            os.environ["UNISON_SHM_SLOT_BYTES"] = str(slot)
            unison.init()
            rank, size = unison.rank(), unison.size()
            for size_label, nbytes in sizes:
                results.setdefault((label, size_label), []).append(block(nbytes))
            unison.shutdown()
    if rank == 0:
        print("allreduce of float32 at %d ranks, algorithm bandwidth in GB/s, median of %d blocks"
              % (size, args.blocks))
        print()
        print("| UNISON_SHM_SLOT_BYTES (round) | " + " | ".join(s for s, _ in sizes) + " |")
        print("| --- |" + " --- |" * len(sizes))
        for label, slot in slots:
            cells = ["%.2f" % statistics.median(results[(label, s)]) for s, _ in sizes]
            print("| %s (%s rounds) | %s |" % (label, _human(slot // 2), " | ".join(cells)))


def _human(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return "%g %s" % (nbytes / scale, unit)
    return "%d B" % nbytes


if __name__ == "__main__":
    main()
