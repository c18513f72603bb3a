"""An allreduce of a model's gradient bytes against the least any
allreduce of them must do: a barrier and one in-place pass.

    unisonrun -np 2 python benchmarks/allreduce_floor.py [--megabytes 38]

38 MB is the 10-layer, 1024-wide MLP of torch_train.py. The floor is what
an allreduce would cost if every rank could reduce straight out of the
others' memory and write the sum into all of them: each byte read once and
written once, after one meeting. The three variants take turns every
repetition; rank 0 prints the medians.
"""
import argparse
import statistics
import time

import numpy as np

import unison
import unison.numpy as unp

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=38.0)
    parser.add_argument("--repetitions", type=int, default=40)
    args = parser.parse_args()
    unison.init()
    gradients = np.ones(int(args.megabytes * 1e6) // 4, np.float32)
    private = np.ones_like(gradients)

    def allreduce():
        unp.allreduce_(gradients, op=unison.Sum, name="floor.gradients")

    def floor():
        unp.barrier()
        np.multiply(private, 0.5, out=private)

    variants = {"allreduce": allreduce, "barrier and one pass (the floor)": floor, "barrier alone": unp.barrier}
    times = {name: [] for name in variants}
    for run in variants.values():
        run()
    for _ in range(args.repetitions):
        for name, run in variants.items():
            unp.barrier()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    if unison.rank() == 0:
        print("%d ranks, %.0f MB:" % (unison.size(), args.megabytes))
        for name, seconds in times.items():
            print("  %s: %.2f ms" % (name, statistics.median(seconds) * 1e3))
    unison.shutdown()


if __name__ == "__main__":
    main()
