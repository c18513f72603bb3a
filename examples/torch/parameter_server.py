"""A parameter server beside data-parallel trainers: the digits (UCI's
handwritten digits, examples/data/), with an embedding table that lives on rank 0
only and a dense head that every trainer replicates.

    unisonrun -np 3 python examples/torch/parameter_server.py

Each image becomes 64 tokens, one per pixel and intensity level (64 x 5 =
320 rows of the table). Rank 0 owns the table and serves it over torch's RPC;
ranks 1.. are trainers, each on its own shard of the training set. In each
step a trainer looks its tokens up on rank 0, runs the head, and
backpropagates through distributed autograd: the table's gradient goes back
to rank 0, whose optimizer applies it, while unison averages the head's
gradients across the trainers' process set (the hybrid
unison.torch.rpc.DistributedOptimizer). Rank 0 waits in rpc.shutdown(),
which fails fast if a trainer dies.
"""
import argparse
import os
import threading

import numpy as np
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as torch_rpc

import unison.torch as hvd
from unison.torch import rpc

# UCI's handwritten digits (the set scikit-learn bundles), split 3:1 into
# training and test rows once for every example: examples/data/README.md.
DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "data", "digits.npz")

WIDTH = 32
LEVELS = 5  # intensities 0..16 in five levels
_table, _creating = None, threading.Lock()


# ---- on rank 0 --------------------------------------------------------------------

def table():
    """The table, created by the first trainer to ask; every trainer's RRef
    points at this one tensor."""
    global _table
    with _creating:
        if _table is None:
            _table = torch.nn.Parameter(0.1 * torch.randn(64 * LEVELS, WIDTH, generator=torch.Generator().manual_seed(0)))
        return _table


def lookup(tokens):
    return torch.nn.functional.embedding(tokens, _table)


# ---- on the trainers ----------------------------------------------------------------

def tokens_of(images):
    """Pixel p at intensity v (0..16) is token LEVELS p + v // 4."""
    return torch.arange(64) * LEVELS + images.long() // 4


def predict(head, tokens):
    rows = torch_rpc.rpc_sync("worker0", lookup, args=(tokens,))
    return head(rows.sum(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    if hvd.size() < 2:
        raise SystemExit("run with unisonrun -np 2 or more: rank 0 serves the table, the others train")
    rpc.init_rpc()
    trainers = hvd.add_process_set(list(range(1, hvd.size())))

    if hvd.rank() == 0:
        rpc.shutdown()  # serves RPC until every trainer is done
        return

    digits = np.load(DIGITS)
    x_train, x_test, y_train, y_test = digits["x_train"], digits["x_test"], digits["y_train"], digits["y_test"]
    me, k = trainers.rank(), trainers.size()
    x_train, y_train = torch.tensor(x_train)[me::k], torch.tensor(y_train)[me::k]
    x_test, y_test = torch.tensor(x_test), torch.tensor(y_test)

    torch.manual_seed(1)  # the same head on every trainer
    head = torch.nn.Sequential(torch.nn.Linear(WIDTH, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    # The owner applies each trainer's step, so its rate is shared out.
    optimizer = rpc.DistributedOptimizer(torch.optim.SGD, [torch_rpc.remote("worker0", table)], lr=args.lr / k,
                                         dense_optimizer=torch.optim.SGD(head.parameters(), lr=args.lr),
                                         process_set=trainers)
    generator = torch.Generator().manual_seed(1234 + me)
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=generator)
        total, batches = 0.0, 0
        for start in range(0, len(order), args.batch_size):
            index = order[start:start + args.batch_size]
            with dist_autograd.context() as context_id:
                loss = torch.nn.functional.cross_entropy(predict(head, tokens_of(x_train[index])), y_train[index])
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            total, batches = total + loss.item(), batches + 1
        mean = hvd.allreduce(torch.tensor(total / batches), name="loss", process_set=trainers).item()
        if me == 0:
            print("epoch %d: loss %.4f" % (epoch + 1, mean), flush=True)

    with torch.no_grad():
        accuracy = (predict(head, tokens_of(x_test)).argmax(1) == y_test).float().mean().item()
    if me == 0:
        print("test accuracy %.4f with the table on rank 0 and %d trainer(s)" % (accuracy, k), flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    main()
