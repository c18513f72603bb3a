"""Optimizer-state memory per rank: ZeroRedundancyOptimizer against a plain
optimizer under DistributedOptimizer, with the training speed of each.

    unisonrun -np 2 python benchmarks/zero_memory.py
    unisonrun -np 3 python benchmarks/zero_memory.py --optimizer sgd

Memory is counted exactly, as the bytes of every tensor in the optimizer's
state after the first step (process RSS would mix in the allocator's
caching and the model itself). Speed is samples/s over alternating timed
blocks of the two trainers, the median of the slowest rank's blocks.
"""
import argparse
import statistics
import time

import torch

import unison.torch as hvd

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)

OPTIMIZERS = {"adam": (torch.optim.Adam, dict(lr=1e-3)),
              "sgd": (torch.optim.SGD, dict(lr=0.01, momentum=0.9))}


def make_model(width, depth):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def state_bytes(state):
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    cls, options = OPTIMIZERS[args.optimizer]

    plain_model = make_model(args.width, args.depth)
    plain = hvd.DistributedOptimizer(cls(plain_model.parameters(), **options),
                                     named_parameters=plain_model.named_parameters())
    zero_model = make_model(args.width, args.depth)
    zero = hvd.ZeroRedundancyOptimizer(zero_model.parameters(), cls, **options)
    x = torch.randn(args.batch_size, args.width)
    y = torch.randint(0, 10, (args.batch_size,))

    def run(model, optimizer, steps):
        for _ in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

    trainers = {"plain": (plain_model, plain), "zero": (zero_model, zero)}
    for model, optimizer in trainers.values():
        run(model, optimizer, 1)
    memory = {"plain": state_bytes(plain.state), "zero": state_bytes(zero.optim.state)}
    times = {name: [] for name in trainers}
    for _ in range(args.blocks):
        for name, (model, optimizer) in trainers.items():
            hvd.barrier()
            start = time.perf_counter()
            run(model, optimizer, args.steps)
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            times[name].append(hvd.allreduce(elapsed, op=hvd.Max).item())
    same = all(torch.equal(p, q) for p, q in zip(plain_model.parameters(), zero_model.parameters()))
    every = hvd.allgather(torch.tensor([[memory["plain"], memory["zero"]]], dtype=torch.int64))

    if hvd.rank() == 0:
        params = sum(p.numel() for p in plain_model.parameters())
        samples = hvd.size() * args.steps * args.batch_size
        speed = {name: samples / statistics.median(t) for name, t in times.items()}
        print("MLP %dx%d (%.1f M parameters, %d tensors), %s, %d ranks, batch %d per rank"
              % (args.depth, args.width, params / 1e6, len(list(plain_model.parameters())),
                 args.optimizer, hvd.size(), args.batch_size))
        print("| rank | plain state | ZeRO state | ZeRO / plain |")
        print("| --- | --- | --- | --- |")
        for rank, (p, z) in enumerate(every.tolist()):
            print("| %d | %.1f MB | %.1f MB | %.2f |" % (rank, p / 1e6, z / 1e6, z / p))
        print("samples/s: plain %.0f, ZeRO %.0f (ZeRO / plain %.2fx); parameters identical "
              "after training: %s" % (speed["plain"], speed["zero"], speed["zero"] / speed["plain"], same))
    hvd.shutdown()


if __name__ == "__main__":
    main()
