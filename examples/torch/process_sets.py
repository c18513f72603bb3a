"""Two models trained at once in one job, with process sets.

    unisonrun -np 2 python examples/torch/process_sets.py
    unisonrun -np 4 python examples/torch/process_sets.py

The ranks split into two halves, each added as a process set. The
first half trains a small network on the digits dataset, the second a wider
one; each half's DistributedOptimizer averages gradients among that half's
ranks only, so the two models never wait on each other. Once per epoch the
whole job averages one metric over every rank (the global process set):
the mean test accuracy of the two models.
"""
import argparse
import os

import numpy as np
import torch

import unison.torch as hvd

# UCI's handwritten digits (the set scikit-learn bundles), split 3:1 into
# training and test rows once for every example: examples/data/README.md.
DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "data", "digits.npz")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    hvd.init(process_sets="dynamic")
    if hvd.size() < 2:
        raise SystemExit("run this with at least two ranks: unisonrun -np 2 python %s" % __file__)
    # Every rank adds the same sets, in the same order, members or not.
    first = hvd.add_process_set(range(hvd.size() // 2))
    second = hvd.add_process_set(range(hvd.size() // 2, hvd.size()))
    torch.set_num_threads(1)
    mine = first if first.included() else second
    which = "first" if mine is first else "second"
    width = 32 if mine is first else 256

    digits = np.load(DIGITS)
    x_train, x_test = digits["x_train"] / 16.0, digits["x_test"] / 16.0
    y_train, y_test = digits["y_train"], digits["y_test"]
    # Shards within the half: rank i of the half takes every size-th row.
    x_train = torch.tensor(x_train, dtype=torch.float32)[mine.rank()::mine.size()]
    y_train = torch.tensor(y_train)[mine.rank()::mine.size()]
    x_test, y_test = torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)

    torch.manual_seed(hvd.rank())  # differs on purpose: the broadcast aligns each half
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * mine.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), process_set=mine)
    # Roots are global ranks: each half starts from its own first rank.
    hvd.broadcast_parameters(model.state_dict(), root_rank=mine.ranks[0], process_set=mine)
    hvd.broadcast_optimizer_state(optimizer, root_rank=mine.ranks[0], process_set=mine)

    generator = torch.Generator().manual_seed(99 + hvd.rank())
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(x_train), generator=generator)
        for start in range(0, len(order), args.batch_size):
            index = order[start:start + args.batch_size]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x_train[index]), y_train[index]).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean()
        # The global metric: every rank of both halves takes part.
        mean_accuracy = hvd.allreduce(accuracy, name="mean_accuracy").item()
        if hvd.rank() == 0 and (epoch % 5 == 4 or epoch == args.epochs - 1):
            print("epoch %d: mean test accuracy of the two models %.3f" % (epoch + 1, mean_accuracy), flush=True)

    # Within a half every rank holds the same model; report it once per half.
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    spread = hvd.allreduce(weights, op=hvd.Max, name="spread.max", process_set=mine) - \
        hvd.allreduce(weights, op=hvd.Min, name="spread.min", process_set=mine)
    if mine.rank() == 0:
        print("%s half, ranks %s, width %d: test accuracy %.3f; weights identical within the half: %s"
              % (which, mine.ranks, width, accuracy.item(), bool(spread.max() == 0)), flush=True)
    # Leave together: as in Horovod, a rank that shuts down (here, at exit)
    # ends the job's collectives, and the other half may still be running.
    hvd.barrier()


if __name__ == "__main__":
    main()
