"""A digits classifier (UCI's handwritten digits, examples/data/) trained with
unison.mxnet and Gluon, written as a Horovod script with one import changed.

    unisonrun -np 2 python examples/mxnet/digits.py

Each rank trains on its own shard of the training set. DistributedTrainer
sums the gradients across ranks in `step()` and folds the division by the
number of ranks into its gradient scale; broadcast_parameters hands rank 0's
initial weights to every rank, after the first forward for the layers whose
input size Gluon only learns then (deferred initialisation).

`--kvstore local` trains the same model in one process with MXNet's own
`local` kvstore and the whole batch (the reference for the benchmark line in
docs/design-notes.md); `--samples-per-second` prints training throughput.
"""
import argparse
import os
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import unison.mxnet as hvd

# UCI's handwritten digits (the set scikit-learn bundles), split 3:1 into
# training and test rows once for every example: examples/data/README.md.
DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "data", "digits.npz")


def build_model():
    model = gluon.nn.HybridSequential()
    # No in_units: the first layer's weights are initialised at the first
    # forward, which is what broadcast_parameters has to wait for.
    model.add(gluon.nn.Dense(128, activation="relu"), gluon.nn.Dense(10))
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--kvstore", choices=["unison", "local"], default="unison",
                        help="local: one process, MXNet's kvstore, batch-size x ranks per step")
    parser.add_argument("--ranks", type=int, default=2,
                        help="with --kvstore local: the number of ranks whose global batch to use")
    parser.add_argument("--samples-per-second", action="store_true")
    args = parser.parse_args()

    distributed = args.kvstore == "unison"
    if distributed:
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    else:
        rank, size = 0, 1
    batch_size = args.batch_size if distributed else args.batch_size * args.ranks
    mx.random.seed(rank)  # different on purpose: the broadcast aligns them

    digits = np.load(DIGITS)
    x_train, x_test = digits["x_train"] / 16.0, digits["x_test"] / 16.0
    y_train, y_test = digits["y_train"], digits["y_test"]
    x_train = mx.nd.array(x_train[rank::size], dtype="float32")
    y_train = mx.nd.array(y_train[rank::size], dtype="float32")
    x_test, y_test = mx.nd.array(x_test, dtype="float32"), mx.nd.array(y_test, dtype="float32")

    model = build_model()
    model.initialize(mx.init.Xavier())
    model.hybridize()
    params = model.collect_params()
    # Horovod's advice: scale the learning rate with the number of ranks.
    optimizer_params = {"learning_rate": args.lr * (size if distributed else args.ranks),
                        "momentum": 0.9}
    if distributed:
        hvd.broadcast_parameters(params, root_rank=0)
        trainer = hvd.DistributedTrainer(params, "sgd", optimizer_params)
    else:
        trainer = gluon.Trainer(params, "sgd", optimizer_params, kvstore="local")
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    rng = np.random.RandomState(1234 + rank)
    samples, train_seconds = 0, 0.0
    for epoch in range(args.epochs):
        order = mx.nd.array(rng.permutation(x_train.shape[0]), dtype="int64")
        total, batches = 0.0, 0
        started = time.perf_counter()
        for start in range(0, len(order), batch_size):
            index = order[start:start + batch_size]
            data, label = x_train.take(index), y_train.take(index)
            with autograd.record():
                loss = loss_fn(model(data), label)
            loss.backward()
            # Gradients are averaged over the global batch: the trainer
            # divides by this rank's batch and, distributed, by the ranks.
            trainer.step(data.shape[0])
            total, batches = total + loss.mean().asscalar(), batches + 1
            samples += data.shape[0]
        train_seconds += time.perf_counter() - started
        mean_loss = total / max(batches, 1)
        if distributed:
            mean_loss = hvd.allreduce(mx.nd.array([mean_loss]), name="epoch_loss").asscalar()
        if rank == 0 and (epoch % 5 == 4 or epoch == args.epochs - 1):
            print("epoch %d: loss %.4f" % (epoch + 1, mean_loss), flush=True)

    accuracy = (model(x_test).argmax(axis=1) == y_test).mean().asscalar()
    if rank == 0:
        where = "%d ranks" % size if distributed else "1 process (local kvstore)"
        print("test accuracy %.3f on %s" % (accuracy, where), flush=True)
    if args.samples_per_second:
        rate = samples / train_seconds
        if distributed:  # every rank's samples: the job's throughput
            rate = hvd.allreduce(mx.nd.array([rate]), op=hvd.Sum, name="rate").asscalar()
        if rank == 0:
            print("samples/s %.0f" % rate, flush=True)


if __name__ == "__main__":
    main()
