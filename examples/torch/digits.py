"""A digits classifier (UCI's handwritten digits, examples/data/) trained with
unison.torch, written as a Horovod script with one import changed.

    unisonrun -np 2 python examples/torch/digits.py

Each rank trains on its own shard of the training set with a
DistributedOptimizer, which averages gradients across ranks as backward
produces them; rank 0's initial weights and optimizer state are broadcast
first, so every rank holds the same model throughout.
"""
import argparse
import os

import numpy as np
import torch

import unison.torch as hvd

# UCI's handwritten digits (the set scikit-learn bundles), split 3:1 into
# training and test rows once for every example: examples/data/README.md.
DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "data", "digits.npz")


def train(epochs=20, batch_size=32, lr=0.05):
    """Trains on this rank's shard; returns the test accuracy (every rank's
    is the same). examples/ray/digits_on_ray.py runs it on Ray's workers."""
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(hvd.rank())  # different on purpose: the broadcast below aligns them

    digits = np.load(DIGITS)
    x_train, x_test = digits["x_train"] / 16.0, digits["x_test"] / 16.0
    y_train, y_test = digits["y_train"], digits["y_test"]
    x_train = torch.tensor(x_train, dtype=torch.float32)[hvd.rank()::hvd.size()]
    y_train = torch.tensor(y_train)[hvd.rank()::hvd.size()]
    x_test, y_test = torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    # Horovod's advice: scale the learning rate with the number of ranks.
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    generator = torch.Generator().manual_seed(1234 + hvd.rank())
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(x_train), generator=generator)
        total, batches = 0.0, 0
        for start in range(0, len(order), batch_size):
            index = order[start:start + batch_size]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[index]), y_train[index])
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
        mean_loss = hvd.allreduce(torch.tensor(total / max(batches, 1)), name="epoch_loss").item()
        if hvd.rank() == 0 and (epoch % 5 == 4 or epoch == epochs - 1):
            print("epoch %d: loss %.4f" % (epoch + 1, mean_loss), flush=True)

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    if hvd.rank() == 0:
        print("test accuracy %.3f on %d ranks" % (accuracy, hvd.size()), flush=True)
    return accuracy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    train(args.epochs, args.batch_size, args.lr)


if __name__ == "__main__":
    main()
