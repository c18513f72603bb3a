"""The digits classifier of digits.py, trained elastically: the job goes on
when a worker dies, and grows when hosts are added.

    unisonrun -np 2 python examples/torch/elastic_digits.py
    unisonrun -np 4 --min-np 2 --max-np 4 -H localhost:2,127.0.0.1:2 \\
        python examples/torch/elastic_digits.py --simulate-failure 3

The second line runs on two hosts (localhost and 127.0.0.1 are two names
for this machine, each a host with shared memory of its own); with
--simulate-failure E the first round's last rank kills itself during epoch E, its
host is blacklisted, and the other host finishes the training from the last
commit. Real clusters name real hosts, or a --host-discovery-script.

What makes it elastic:
- TorchState holds the model, the optimizer, the ElasticSampler and the
  epoch; state.commit() every few batches is where a failure rolls back to;
- the ElasticSampler remembers which samples this epoch has processed, so a
  resumed epoch trains on the rest only, sharded over the ranks there are;
- a reset callback rescales the learning rate to the new number of ranks.
"""
import argparse
import os
import signal

import numpy as np
import torch

import unison.torch as hvd

# UCI's handwritten digits (the set scikit-learn bundles), split 3:1 into
# training and test rows once for every example: examples/data/README.md.
DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "data", "digits.npz")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batches-per-commit", type=int, default=4)
    parser.add_argument("--simulate-failure", type=int, metavar="EPOCH",
                        help="under the elastic launcher, the last rank of the first round kills itself "
                             "during this epoch")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    digits = np.load(DIGITS)
    x_train, x_test = digits["x_train"] / 16.0, digits["x_test"] / 16.0
    y_train, y_test = digits["y_train"], digits["y_test"]
    train_set = torch.utils.data.TensorDataset(torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train))
    x_test, y_test = torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)

    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=1234)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def rescale_learning_rate():
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
    state.register_reset_callbacks([rescale_learning_rate])

    @hvd.elastic.run
    def train(state):
        # state.sync() has run: every rank holds rank 0's committed state.
        for state.epoch in range(state.epoch, args.epochs):
            sampler.set_epoch(state.epoch)  # the same epoch again keeps its progress
            model.train()
            total, batches = 0.0, 0
            for index, (inputs, labels) in enumerate(loader):
                if (args.simulate_failure == state.epoch and index == 2 and hvd.rank() == hvd.size() - 1
                        and os.environ.get("UNISON_ELASTIC_ROUND") == "0"):
                    print("rank %d: simulating a failure in epoch %d" % (hvd.rank(), state.epoch + 1), flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(inputs), labels)
                loss.backward()
                optimizer.step()
                sampler.record_batch(index, args.batch_size)
                total, batches = total + loss.item(), batches + 1
                if index % args.batches_per_commit == args.batches_per_commit - 1:
                    state.commit()
            mean_loss = hvd.allreduce(torch.tensor(total / max(batches, 1)), name="epoch_loss").item()
            if hvd.rank() == 0 and (state.epoch % 5 == 4 or state.epoch == args.epochs - 1):
                print("epoch %d: loss %.4f on %d ranks" % (state.epoch + 1, mean_loss, hvd.size()), flush=True)
            state.commit()  # the finished epoch
        state.epoch = args.epochs

    train(state)
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    if hvd.rank() == 0:
        print("test accuracy %.3f on %d ranks" % (accuracy, hvd.size()), flush=True)


if __name__ == "__main__":
    main()
