"""CPU training and glibc's heap: what returning freed memory to the kernel
costs a step, with unison's DistributedOptimizer and with independent
processes, side by side.

    python benchmarks/heap_trim.py                 # 2 ranks, 3 rounds
    python benchmarks/heap_trim.py --np 3 --rounds 5

PyTorch frees a step's gradients and activations (zero_grad(), the
autograd graph) and allocates them again in the next. glibc hands the freed
top of its heap back to the kernel once more than its trim threshold is
free there (by default twice its mmap threshold, which itself follows the
largest freed block, at most 32 MiB), so every step can fault the same pages
in again, one 4 KiB page at a time. Two settings keep them: a trim
threshold above a step's turnover, and a fixed mmap threshold, since
setting the first also stops the second from following the blocks freed:
at its fixed default of 128 KiB every tensor would get pages of its own,
faulted in afresh each time (measured: more faults than glibc's default).
32 MiB, the most glibc's documentation allows, puts every smaller tensor
on the heap. unisonrun passes GLIBC_TUNABLES to the ranks on every host
like the rest of its environment.

Each variant is a job of its own (the heap is a process's), the variants
take turns round by round, and each figure is the median over rounds of
the slowest rank's time a step, with the page faults a step on rank 0.
benchmarks/torch_train.py trains all its copies in one process, where
whether a copy faults depends on the others: it keeps the heap (KEPT).
"""
import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)

KEPT = "glibc.malloc.mmap_threshold=%d:glibc.malloc.trim_threshold=%d" % (32 << 20, 1 << 32)
VARIANTS = [("unison", "glibc's default"), ("unison", "heap kept"), ("independent", "glibc's default"),
            ("independent", "heap kept")]


def worker(args):
    import torch
    import unison.torch as hvd
    from torch_train import make_model

    torch.set_num_threads(1)
    hvd.init()
    x = torch.randn(args.batch_size, args.width)
    y = torch.randint(0, 10, (args.batch_size,))
    model = make_model(args.width, args.depth)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if args.worker == "unison":
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    for step in range(args.steps + 10):
        if step == 10:  # warmed up
            hvd.barrier()
            faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    seconds = time.perf_counter() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    slowest = hvd.allreduce(torch.tensor(seconds, dtype=torch.float64), op=hvd.Max, name="slowest").item()
    if hvd.rank() == 0:
        print("per step: %.3f ms, %.0f faults" % (slowest / args.steps * 1e3, faults / args.steps), flush=True)
    hvd.shutdown()


def run_variant(args, trainer, heap):
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"):
        env.pop(name, None)
    if heap == "heap kept":
        env["GLIBC_TUNABLES"] = KEPT
    command = [sys.executable, "-m", "unison.run", "-np", str(args.np), sys.executable, os.path.abspath(__file__),
               "--worker", trainer, "--steps", str(args.steps), "--depth", str(args.depth),
               "--width", str(args.width), "--batch-size", str(args.batch_size)]
    out = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=600,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout.decode(errors="replace")
    found = re.search(r"per step: ([\d.]+) ms, (\d+) faults", out)
    if found is None:
        raise SystemExit("%s, %s failed:\n%s" % (trainer, heap, out[-3000:]))
    return float(found.group(1)), float(found.group(2))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="timed steps a job")
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--worker", choices=["unison", "independent"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    figures = {variant: [] for variant in VARIANTS}
    for _ in range(args.rounds):
        for trainer, heap in VARIANTS:
            figures[(trainer, heap)].append(run_variant(args, trainer, heap))
    step = {v: statistics.median(ms for ms, _ in f) for v, f in figures.items()}
    faults = {v: statistics.median(n for _, n in f) for v, f in figures.items()}
    print("MLP %dx%d, batch %d a rank, %d ranks, median of %d rounds; heap kept: GLIBC_TUNABLES=%s"
          % (args.depth, args.width, args.batch_size, args.np, args.rounds, KEPT))
    print("| trainer | glibc's default: ms a step | faults a step | heap kept: ms a step | faults a step "
          "| speed-up |")
    print("| --- | --- | --- | --- | --- | --- |")
    for trainer in ("unison", "independent"):
        d, k = (trainer, "glibc's default"), (trainer, "heap kept")
        print("| %s | %.1f | %.0f | %.1f | %.0f | %.2fx |"
              % (trainer, step[d], faults[d], step[k], faults[k], step[d] / step[k]))
    for heap in ("glibc's default", "heap kept"):
        print("unison / independent samples/s, %s: %.2fx"
              % (heap, step[("independent", heap)] / step[("unison", heap)]))


if __name__ == "__main__":
    main()
