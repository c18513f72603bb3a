"""Blocking collectives from several threads of each rank at once: unison
against torch.distributed (gloo), side by side.

    unisonrun -np 2 python benchmarks/threads.py [--threads 1,2,4] [--kib 4] [--ops 400]

Each of T threads runs a loop of blocking allreduces (in place, Sum) of its
own tensors; the ranks' threads get to each op in whatever order the
scheduler gives them. unison negotiates which named tensors are ready, so
all T threads share one job. gloo needs every rank to issue a group's
collectives in one order, so each thread gets a process group of its own,
as a torch.distributed program would do it. The two take turns in
alternating blocks in the same processes. Rank 0 prints each variant's
aggregate ops per second (the median over blocks), unison's ratio to
gloo, and each one's T-thread rate against its own single thread.
"""
import argparse
import statistics
import threading
import time

import torch
import torch.distributed as dist

import unison.torch as hvd
from timing import join_gloo

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)


def run_threads(count, work):
    """Runs work(thread index) on `count` threads at once; the seconds taken."""
    start = threading.Barrier(count + 1)

    def body(index):
        start.wait()
        work(index)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - began


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2,4", help="thread counts to compare; the first is the base")
    parser.add_argument("--kib", type=int, default=4, help="size of each allreduce, in KiB")
    parser.add_argument("--ops", type=int, default=400, help="allreduces each thread runs in a block")
    parser.add_argument("--blocks", type=int, default=7)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    join_gloo("threads")

    counts = [int(c) for c in args.threads.split(",")]
    elements = args.kib * 1024 // 4
    tensors = [torch.ones(elements) for _ in range(max(counts))]
    # One gloo group per thread, made on every rank in the same order.
    groups = [dist.new_group(list(range(hvd.size()))) for _ in range(max(counts))]
    expected = float(hvd.size())

    def unison_loop(index):
        x = tensors[index]
        for _ in range(args.ops):
            x.fill_(1.0)
            hvd.allreduce_(x, op=hvd.Sum, name="threads.%d" % index)
        assert x[0].item() == expected, x[0].item()

    def gloo_loop(index):
        x = tensors[index]
        for _ in range(args.ops):
            x.fill_(1.0)
            dist.all_reduce(x, group=groups[index])
        assert x[0].item() == expected, x[0].item()

    variants = [("unison", unison_loop), ("gloo", gloo_loop)]
    rates = {(name, count): [] for name, _ in variants for count in counts}
    for block in range(args.blocks + 1):
        for count in counts:
            for name, loop in variants:
                hvd.barrier()
                seconds = run_threads(count, loop)
                if block > 0:  # the first block warms up
                    rates[(name, count)].append(count * args.ops / seconds)

    if hvd.rank() == 0:
        median = {key: statistics.median(values) for key, values in rates.items()}
        print("%d ranks, %d KiB blocking allreduces, %d per thread a block, medians of %d blocks"
              % (hvd.size(), args.kib, args.ops, args.blocks))
        print("threads | unison ops/s | gloo ops/s | unison / gloo | unison / its 1 thread | gloo / its 1 thread")
        for count in counts:
            u, g = median[("unison", count)], median[("gloo", count)]
            print("%7d | %12.0f | %10.0f | %12.2fx | %20.2fx | %18.2fx"
                  % (count, u, g, u / g, u / median[("unison", counts[0])], g / median[("gloo", counts[0])]),
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
