"""What a DistributedOptimizer's gradient hook costs, per gradient.

    unisonrun -np 2 python benchmarks/gradient_hooks.py

A model of many small parameters (200 of 1,000 floats, so that the
per-gradient work shows and the bytes do not): backward alone, with a plain
optimizer, against backward with unison's DistributedOptimizer, whose hook
starts each gradient's allreduce as autograd produces it; the hooks' cost
is the difference, over the 200. Three ways, in alternating blocks in the
same processes: the C hook with the compiled start (both of
torch_adapter/fast_path.cc, the default), the Python hook with the
compiled start, and the Python hook with the Python start (as without the
extension). Rank 0 prints the medians over blocks.
"""
import argparse
import statistics
import time

import torch

import unison.torch as hvd
from unison.torch import ops

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--elements", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=20, help="timed backward passes per block")
    parser.add_argument("--blocks", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    x = torch.ones(args.elements)
    compiled = (ops._fast, ops._front.fast)

    def copy(hooks, label):
        """A copy of the parameters (hooks, once registered, stay on a
        tensor) and its optimizer: a DistributedOptimizer whose hooks are
        C ("C") or Python ("Python"), or a plain one (None)."""
        params = [torch.nn.Parameter(torch.zeros(args.elements)) for _ in range(args.tensors)]
        if hooks is None:
            return torch.optim.SGD(params, lr=0.0), params
        ops._fast, ops._front.fast = compiled if hooks == "C" else (None, None)   # what _make_hook sees
        try:
            return hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.0),
                                            named_parameters=[("%s.%d" % (label, i), p)
                                                              for i, p in enumerate(params)]), params
        finally:
            ops._fast, ops._front.fast = compiled

    variants = {"backward alone": (*copy(None, "bare"), compiled),
                "C hook, compiled start": (*copy("C", "c"), compiled),
                "Python hook, compiled start": (*copy("Python", "mixed"), compiled),
                "Python hook, Python start": (*copy("Python", "python"), (None, None))}
    times = {label: [] for label in variants}

    def block(optimizer, tensors, path):
        ops._fast, ops._front.fast = path
        samples = []
        for _ in range(args.steps + 1):   # the first of each block untimed
            optimizer.zero_grad()
            loss = sum((p * x).sum() for p in tensors)
            hvd.barrier()
            started = time.perf_counter()
            loss.backward()
            samples.append(time.perf_counter() - started)
            optimizer.step()
        return statistics.median(samples[1:])

    try:
        for _ in range(args.blocks):
            for label, (optimizer, tensors, path) in variants.items():
                times[label].append(block(optimizer, tensors, path))
    finally:
        ops._fast, ops._front.fast = compiled
    median = {label: statistics.median(samples) for label, samples in times.items()}
    if hvd.rank() == 0:
        alone = median["backward alone"]
        print("%d ranks, %d gradients of %d floats; median of %d blocks of %d backward passes"
              % (hvd.size(), args.tensors, args.elements, args.blocks, args.steps))
        print("| | backward | per gradient beyond backward alone |")
        print("| --- | --- | --- |")
        for label, value in median.items():
            print("| %s | %.3f ms | %s |" % (label, value * 1e3, "" if label == "backward alone" else
                                             "%.2f us" % ((value - alone) / args.tensors * 1e6)))
        if compiled[0] is None:
            print("(the compiled path is not in use here: both hook rows took the Python path)")
    hvd.shutdown()


if __name__ == "__main__":
    main()
