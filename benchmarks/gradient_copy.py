"""What copying each gradient as autograd makes it would cost a training
step: the price of keeping gradients in memory of unison's own (a shared
arena the ranks of a host could reduce in place).

    python benchmarks/gradient_copy.py [--depth 10]

One process, one torch thread, the MLP of torch_train.py, three copies of
it in alternating steps: plain; with a post-accumulate hook that copies each
fresh gradient into a buffer kept for it and makes that buffer the
gradient; and with one in-place pass over the gradients after backward, for
scale. Prints the median step of each. Run it with glibc's heap kept
(torch_train.py's reason), as it does unless GLIBC_TUNABLES is set.
"""
import argparse
import os
import statistics
import sys
import time

import torch

from torch_train import make_model

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if "GLIBC_TUNABLES" not in os.environ:
        from heap_trim import KEPT
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, GLIBC_TUNABLES=KEPT))
    torch.set_num_threads(1)
    x = torch.randn(args.batch_size, args.width)
    y = torch.randint(0, 10, (args.batch_size,))
    plain, copied, touched = (make_model(args.width, args.depth) for _ in range(3))
    kept = {p: torch.zeros_like(p) for p in copied.parameters()}

    def into_kept(p):
        kept[p].copy_(p.grad)
        p.grad = kept[p]

    for p in copied.parameters():
        p.register_post_accumulate_grad_hook(into_kept)

    def one_pass(model):
        for p in model.parameters():
            p.grad.mul_(0.5)

    def step(model, after=None):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if after is not None:
            after(model)

    variants = {"plain": lambda: step(plain), "each gradient copied as it is made": lambda: step(copied),
                "one in-place pass after backward": lambda: step(touched, one_pass)}
    times = {name: [] for name in variants}
    for _ in range(3):
        for run in variants.values():
            run()
    for _ in range(args.steps):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain"])
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print("%s: %.2f ms a step (%+.2f ms)" % (name, median * 1e3, (median - base) * 1e3))


if __name__ == "__main__":
    main()
