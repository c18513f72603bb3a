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
(fused on the device: batched copies in and out of the fusion buffer) and
as 200 allreduce_async_ calls, against one allreduce of the same bytes,
each through unison.torch's compiled per-tensor path and its Python path.
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

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)

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
    """200 tensors of 40 KB, in one grouped allreduce and as 200
    allreduce_async_ calls (a gradient hook's), against one allreduce of
    the same bytes; each both through unison.torch's compiled per-tensor
    path (torch_adapter/fast_path.cc) and through its Python path, in the
    same alternating blocks. Prints what starting them cost per tensor,
    the host's share: a group is one fused collective on the device."""
    from unison import adapter_extension, handles
    from unison.torch import ops
    small = [torch.ones(10240, device=device) for _ in range(200)]
    whole = torch.ones(10240 * 200, device=device)
    # The compiled path: its starter and its waiter of grouped handles.
    compiled = (ops._fast, ops._front.fast, handles._group_waiter)
    paths = {"Python": (None, None, None)}
    if compiled[0] is not None:
        paths = {"compiled": compiled, **paths}
    else:
        say("\nunison.torch's compiled path is not in use: %s" % adapter_extension.ACTIVE.get("PyTorch"))
    starts = {}   # (form, path) -> seconds to start the 200, each time

    def grouped(label):
        def run():
            ops._fast, ops._front.fast, handles._group_waiter = paths[label]
            started = time.perf_counter()
            handle = hvd.grouped_allreduce_async_(small, op=hvd.Sum, name="gpu.bench.small." + label)
            starts.setdefault(("grouped", label), []).append(time.perf_counter() - started)
            hvd.synchronize(handle)
        return run

    def singles(label):
        names = ["gpu.bench.single.%s.%d" % (label, i) for i in range(len(small))]

        def run():
            ops._fast, ops._front.fast, handles._group_waiter = paths[label]
            started = time.perf_counter()
            handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=n) for t, n in zip(small, names)]
            starts.setdefault(("single", label), []).append(time.perf_counter() - started)
            for h in handles:
                hvd.synchronize(h)
        return run

    def one():
        hvd.allreduce_(whole, op=hvd.Sum, name="gpu.bench.whole")

    variants = [(("grouped", label), grouped(label)) for label in paths]
    variants += [(("single", label), singles(label)) for label in paths] + [(("one", ""), one)]
    samples = {key: [] for key, _ in variants}
    try:
        for _, fn in variants:
            fn()
        for _ in range(blocks):
            for key, fn in variants:
                hvd.barrier()
                fn()
                samples[key].append(agree(timed(fn, 20)))
    finally:
        ops._fast, ops._front.fast, handles._group_waiter = compiled
    median = {key: statistics.median(values) for key, values in samples.items()}
    whole_time = median[("one", "")]
    say("\n200 x 40 KB against one allreduce of 8000 KB (%.3f ms):" % (whole_time * 1e3))
    say("| form | path | time | / one | starting them, per tensor |")
    say("| --- | --- | --- | --- | --- |")
    for form, label in [key for key, _ in variants[:-1]]:
        took = median[(form, label)]
        say("| %s | %s | %.3f ms | %.2fx | %.2f us |" % (
            "grouped_allreduce_async_" if form == "grouped" else "200 x allreduce_async_", label, took * 1e3,
            took / whole_time, statistics.median(starts[(form, label)]) / len(small) * 1e6))
    if "compiled" in paths:
        start = statistics.median(starts[("single", "compiled")]) / len(small)
        say("target: starting a CUDA tensor's allreduce <= 2 us: %.2f us, %s"
            % (start * 1e6, "met" if start <= 2e-6 else "MISSED by %.0f%%" % (100 * (start / 2e-6 - 1))))
        if hvd.size() == 1:
            ratio = median[("grouped", "compiled")] / whole_time
            say("target: at 1 rank, 200 grouped within 3x of one allreduce: %.2fx, %s"
                % (ratio, "met" if ratio <= 3 else "MISSED by %.0f%%" % (100 * (ratio / 3 - 1))))


if __name__ == "__main__":
    main()
