"""What the MXNet op path costs: the same float32 allreduce through
unison.numpy (the raw core) and through unison.mxnet, whose collectives
are pushed to MXNet's engine (mxnet_adapter/engine.py), timed in the same
processes (the median of single calls), beside what the engine costs on its own: a tiny MXNet operator
pushed and waited for.

    unisonrun -np 2 python benchmarks/mxnet_op_path.py

The gradients column is a DistributedTrainer's step on a small model's
four gradients (the digits example's 64-128-10 network): their allreduces
pushed without waiting for the arrays, then waited for.
"""
import argparse
import time

import mxnet as mx
import numpy as np

import unison
import unison.mxnet as hvd
import unison.numpy as unp
from unison.mxnet.optimizer import _allreduce_gradients

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)


def median_time(fn, repeats, blocks=5):
    """The median of every call's own time: on this shared machine one
    descheduled call would move a block's mean by more than the path costs."""
    fn()
    times = []
    for _ in range(blocks):
        unp.barrier()
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="4096,65536,1048576", help="bytes")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    hvd.init()
    rank = hvd.rank()
    engine_alone = mx.nd.ones((1024,))

    def engine_round_trip():
        (engine_alone + 1).wait_to_read()

    gradients = [mx.nd.ones((128, 64)), mx.nd.ones((128,)), mx.nd.ones((10, 128)), mx.nd.ones((10,))]
    named = [("bench.grad%d" % i, g, -i) for i, g in enumerate(gradients)]

    def step():
        _allreduce_gradients(named, 1.0, 0, hvd.global_process_set)

    if rank == 0:
        print("float32 allreduce (Sum), %d ranks: median seconds per op" % hvd.size())
        print("%10s %12s %12s %14s" % ("bytes", "numpy (core)", "mxnet", "mxnet - core"))
    for nbytes in [int(s) for s in args.sizes.split(",")]:
        array = np.ones(nbytes // 4, dtype=np.float32)
        nd = mx.nd.ones((nbytes // 4,))
        core = median_time(lambda: unp.allreduce(array, op=unison.Sum, name="bench.numpy"), args.repeats)
        through_mxnet = median_time(lambda: hvd.allreduce_(nd, op=hvd.Sum, name="bench.mxnet"), args.repeats)
        if rank == 0:
            print("%10d %10.1fus %10.1fus %+12.1fus" % (nbytes, core * 1e6, through_mxnet * 1e6,
                                                       (through_mxnet - core) * 1e6), flush=True)
    trip = median_time(engine_round_trip, args.repeats)
    gradient_step = median_time(step, args.repeats)
    if rank == 0:
        print("a tiny MXNet operator, pushed and waited for: %.1f us" % (trip * 1e6))
        print("four gradients (9.6k parameters) allreduced as DistributedTrainer does: %.1f us"
              % (gradient_step * 1e6), flush=True)


if __name__ == "__main__":
    main()
