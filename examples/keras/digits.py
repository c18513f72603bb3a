"""A digits classifier (UCI's handwritten digits, examples/data/) trained with
Keras 3's model.fit and unison.keras, written as a Horovod Keras script
with one import changed.

    unisonrun -np 2 python examples/keras/digits.py

The DistributedOptimizer averages gradients across ranks inside fit()'s
train step; BroadcastGlobalVariablesCallback starts every rank from rank
0's weights; MetricAverageCallback reports metrics averaged over ranks.

`--checkpoint-dir DIR` resumes as Horovod's Keras examples do: rank 0
saves a checkpoint after every epoch; a later run finds the newest, rank 0
loads it with hvd.load_model (its optimizer comes back distributed, with its
momenta), the others build a fresh model, and the broadcast callback hands
them rank 0's state before the first step.

`--one-process` trains the same model in one process on the whole batch
(batch-size x ranks per step), the reference of the benchmark line in
docs/design-notes.md; `--samples-per-second` prints training throughput.
"""
import argparse
import glob
import os
import re
import time

import keras
import numpy as np

import unison.keras as hvd

# UCI's handwritten digits (the set scikit-learn bundles), split 3:1 into
# training and test rows once for every example: examples/data/README.md.
DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "data", "digits.npz")


class Throughput(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seconds, self.samples, self.batch_size = 0.0, 0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        if epoch > 0:   # the first epoch traces and compiles the step
            self.seconds += time.perf_counter() - self.started
            self.samples += self.params["steps"] * self.batch_size


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--one-process", action="store_true",
                        help="no unison: one process, batch-size x --ranks rows per step")
    parser.add_argument("--ranks", type=int, default=2, help="with --one-process: whose global batch to use")
    parser.add_argument("--samples-per-second", action="store_true")
    parser.add_argument("--checkpoint-dir", help="save a checkpoint each epoch here, and resume from the newest")
    args = parser.parse_args()

    distributed = not args.one_process
    if distributed:
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    else:
        rank, size = 0, 1
    ranks = size if distributed else args.ranks
    batch_size = args.batch_size if distributed else args.batch_size * args.ranks
    keras.utils.set_random_seed(rank)  # different on purpose: the broadcast aligns them

    digits = np.load(DIGITS)
    x_train, x_test = (digits["x_train"] / 16.0).astype("float32"), (digits["x_test"] / 16.0).astype("float32")
    y_train, y_test = digits["y_train"], digits["y_test"]
    x_train, y_train = x_train[rank::size], y_train[rank::size]
    if distributed:   # every rank takes the same number of steps
        rows = min(hvd.allgather_object(len(x_train))) // batch_size * batch_size
        x_train, y_train = x_train[:rows], y_train[:rows]

    resume_from_epoch, checkpoints = 0, []
    if args.checkpoint_dir and distributed:
        checkpoints = sorted(glob.glob(os.path.join(args.checkpoint_dir, "checkpoint-*.keras")),
                             key=lambda path: int(re.search(r"(\d+)\.keras$", path).group(1)))
        # Rank 0's view decides: the others may not share its disk.
        resume_from_epoch = hvd.broadcast_object(
            int(re.search(r"(\d+)\.keras$", checkpoints[-1]).group(1)) if checkpoints else 0, root_rank=0)
    if resume_from_epoch > 0 and rank == 0:
        model = hvd.load_model(checkpoints[-1])
        print("resumed from epoch %d" % resume_from_epoch, flush=True)
    else:
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dense(10)])
        # Horovod's advice: scale the learning rate with the number of ranks.
        optimizer = keras.optimizers.SGD(args.lr * ranks, momentum=0.9)
        if distributed:
            optimizer = hvd.DistributedOptimizer(optimizer)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    callbacks = []
    if distributed:
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
        if args.checkpoint_dir and rank == 0:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir,
                                                                          "checkpoint-{epoch}.keras")))
    throughput = Throughput()
    throughput.batch_size = batch_size
    history = model.fit(x_train, y_train, batch_size=batch_size, epochs=args.epochs, verbose=0,
                        initial_epoch=resume_from_epoch, callbacks=callbacks + [throughput])

    if rank == 0:
        for epoch in range(resume_from_epoch, args.epochs):
            if epoch % 5 == 4 or epoch == args.epochs - 1:
                done = epoch - resume_from_epoch
                print("epoch %d: loss %.4f, accuracy %.3f" % (epoch + 1, history.history["loss"][done],
                                                             history.history["accuracy"][done]), flush=True)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if rank == 0:
        where = "%d ranks" % size if distributed else "1 process"
        print("test accuracy %.3f on %s" % (accuracy, where), flush=True)
    if args.samples_per_second and throughput.seconds > 0:
        rate = throughput.samples / throughput.seconds
        if distributed:   # every rank's samples: the job's throughput
            rate = sum(hvd.allgather_object(rate))
        if rank == 0:
            print("samples/s %.0f" % rate, flush=True)


if __name__ == "__main__":
    main()
