"""An asynchronous allreduce followed by a loop of polls: unison's
allreduce_async_ and poll() against torch.distributed's (gloo) all_reduce
with async_op=True and Work.is_completed(), side by side.

    unisonrun -np 2 python benchmarks/poll.py [--kib 4] [--ops 300] [--blocks 7]

Horovod's users poll to overlap a collective with other work, or to keep
a thread responsive. A poll drives nothing itself, so what it costs is how
soon the library's own threads move the op. Each op starts after a
barrier; the two libraries take turns in alternating blocks in the same
processes. Rank 0 prints the median time from the start of an op to the
poll that saw it done, and the ratio.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import unison.torch as hvd
from timing import join_gloo

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kib", type=int, default=4, help="size of each allreduce, in KiB")
    parser.add_argument("--ops", type=int, default=300, help="ops in a block")
    parser.add_argument("--blocks", type=int, default=7)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    join_gloo("poll")
    x = torch.ones(args.kib * 1024 // 4)

    def unison_op():
        handle = hvd.allreduce_async_(x, op=hvd.Sum, name="poll")
        while not hvd.poll(handle):
            pass
        hvd.synchronize(handle)

    def gloo_op():
        work = dist.all_reduce(x, async_op=True)
        while not work.is_completed():
            pass
        work.wait()

    variants = [("unison", unison_op), ("gloo", gloo_op)]
    times = {name: [] for name, _ in variants}
    for block in range(args.blocks + 1):
        for name, op in variants:
            block_times = []
            for _ in range(args.ops):
                x.fill_(1.0)
                hvd.barrier()
                began = time.perf_counter()
                op()
                block_times.append(time.perf_counter() - began)
                assert x[0].item() == hvd.size()
            if block > 0:  # the first block warms up
                times[name].append(statistics.median(block_times))
    if hvd.rank() == 0:
        u, g = statistics.median(times["unison"]), statistics.median(times["gloo"])
        print("%d ranks, %d KiB: start to done, polling: unison %.1f us, gloo %.1f us; unison / gloo speed %.2fx"
              % (hvd.size(), args.kib, u * 1e6, g * 1e6, g / u), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
