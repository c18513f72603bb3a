"""Allreduce of CUDA tensors: unison against its ceiling and against gloo.

    unisonrun -np 1 python benchmarks/gpu_allreduce.py   (NCCL, against a device-to-device copy)
    unisonrun -np 2 python benchmarks/gpu_allreduce.py   (ranks sharing one GPU: host staging, against gloo)
    unisonrun -np 2 -H localhost:1,127.0.0.1:1 python benchmarks/gpu_allreduce.py
                                      (a "host" per rank: hierarchical NCCL, TCP across, against gloo)

At one rank the collective goes through NCCL, and the ceiling is what the
GPU does with the same bytes anyway: a device-to-device copy of the
tensor. With ranks sharing one GPU (the only multi-rank layout a one-GPU
machine has), NCCL refuses them and unison stages through pinned host
memory and its shared-memory plane; torch.distributed's gloo does the same
job on CUDA tensors, so it is the alternative. Both are timed in
alternating blocks in the same processes, each call followed by a wait for
the stream (what a training step pays), median of the blocks.

Last, many small tensors: 200 tensors of 40 KB in one grouped allreduce
(fused on the device: batched copies in and out of the fusion buffer)
against one allreduce of the same bytes.
"""
import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

import unison.torch as hvd
from allreduce import setup_gloo
from timing import agree

SIZES_MIB = [1, 4, 16, 64, 256]


def timed(fn, iterations):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iterations


def start_gpu_job():
    """unison on GPU 0 with one torch thread, and gloo beside it where there
    are several ranks: (the device, whether this rank is alone)."""
    hvd.init()
    torch.set_num_threads(1)
    alone = hvd.size() == 1
    if not alone:
        setup_gloo()
    return torch.device("cuda", 0), alone


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    device, alone = start_gpu_job()
    say = print if hvd.rank() == 0 else (lambda *a: None)
    other = "device-to-device copy" if alone else "gloo"
    say("allreduce of float32 CUDA tensors, %d rank(s) on %s, median of %d blocks"
        % (hvd.size(), torch.cuda.get_device_name(0), args.blocks))
    say("| size | unison | %s | unison algbw | %s algbw | unison / %s speed |" % (other, other, other))
    say("| --- | --- | --- | --- | --- | --- |")
    for mib in SIZES_MIB:
        n = (mib << 20) // 4
        x = torch.ones(n, device=device)
        y = torch.empty_like(x)
        iterations = max(3, min(50, 512 // mib))

        def ours():
            # One rank: out of place, so that NCCL moves the bytes the copy
            # moves (in place, one rank's allreduce has nothing to do).
            if alone:
                hvd.allreduce(x, op=hvd.Sum, name="gpu.bench.%d" % mib)
            else:
                hvd.allreduce_(x, op=hvd.Sum, name="gpu.bench.%d" % mib)

        def theirs():
            if alone:
                y.copy_(x)
            else:
                dist.all_reduce(x)

        ours(), theirs()
        samples = [[], []]
        for _ in range(args.blocks):
            for fn, out in ((ours, samples[0]), (theirs, samples[1])):
                hvd.barrier()
                fn()
                out.append(agree(timed(fn, iterations)))
        a, b = statistics.median(samples[0]), statistics.median(samples[1])
        nbytes = n * 4
        say("| %d MiB | %.3f ms | %.3f ms | %.1f GB/s | %.1f GB/s | %.2fx |"
            % (mib, a * 1e3, b * 1e3, nbytes / a / 1e9, nbytes / b / 1e9, b / a))
        sys.stdout.flush()
    many_small_tensors(device, args.blocks, say)
    hvd.shutdown()


def many_small_tensors(device, blocks, say):
    small = [torch.ones(10240, device=device) for _ in range(200)]
    whole = torch.ones(10240 * 200, device=device)

    enqueue_seconds = []   # the call that starts the group, each time

    def grouped():
        started = time.perf_counter()
        handle = hvd.grouped_allreduce_async_(small, op=hvd.Sum, name="gpu.bench.small")
        enqueue_seconds.append(time.perf_counter() - started)
        hvd.synchronize(handle)

    def one():
        hvd.allreduce_(whole, op=hvd.Sum, name="gpu.bench.whole")

    grouped(), one()
    samples = [[], []]
    for _ in range(blocks):
        for fn, out in ((grouped, samples[0]), (one, samples[1])):
            hvd.barrier()
            fn()
            out.append(agree(timed(fn, 20)))
    a, b = statistics.median(samples[0]), statistics.median(samples[1])
    say("\n| 200 x 40 KB, grouped | one allreduce of 8000 KB | grouped / one time |")
    say("| --- | --- | --- |")
    say("| %.3f ms | %.3f ms | %.2fx |" % (a * 1e3, b * 1e3, a / b))
    # The host's share: a group is one fused collective on the device, so
    # what the 200 cost beyond one tensor is mostly starting them.
    say("  of which starting the group (grouped_allreduce_async_): %.3f ms, %.1f us a tensor"
        % (statistics.median(enqueue_seconds) * 1e3, statistics.median(enqueue_seconds) / len(small) * 1e6))


if __name__ == "__main__":
    main()
