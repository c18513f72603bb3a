"""The digits classifier of digits.py, trained elastically with Keras 3's
model.fit: the job goes on when a worker dies, and grows when hosts are
added.

    unisonrun -np 2 python examples/keras/elastic_digits.py
    unisonrun -np 4 --min-np 2 --max-np 4 -H localhost:2,127.0.0.1:2 \\
        python examples/keras/elastic_digits.py --simulate-failure 3

With --simulate-failure E, the first round's last rank kills itself during
epoch E under the elastic launcher; its host is blacklisted and the other
host finishes the training from the last commit.

What makes it elastic:
- KerasState holds the model, its optimizer and the epoch;
- UpdateEpochStateCallback keeps state.epoch, and CommitStateCallback
  commits at the end of every epoch (and every --batches-per-commit
  batches); fit() resumes from initial_epoch=state.epoch, redoing at most
  the epoch a failure interrupted;
- each (re)start of fit() shards the data over the ranks there are now,
  and a reset callback rescales the learning rate to their number.
"""
import argparse
import os
import signal

import keras
import numpy as np

import unison.keras as hvd

# UCI's handwritten digits (the set scikit-learn bundles), split 3:1 into
# training and test rows once for every example: examples/data/README.md.
DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "data", "digits.npz")


class SimulatedFailure(keras.callbacks.Callback):
    def __init__(self, state, epoch):
        super().__init__()
        self.state, self.epoch = state, epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.state.epoch == self.epoch and batch == 2 and hvd.rank() == hvd.size() - 1
                and os.environ.get("UNISON_ELASTIC_ROUND") == "0"):
            print("rank %d: simulating a failure in epoch %d" % (hvd.rank(), self.epoch + 1), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batches-per-commit", type=int, default=8)
    parser.add_argument("--simulate-failure", type=int, metavar="EPOCH",
                        help="under the elastic launcher, the last rank of the first round kills itself "
                             "during this epoch")
    args = parser.parse_args()

    hvd.init()
    keras.utils.set_random_seed(0)
    digits = np.load(DIGITS)
    x_train, x_test = (digits["x_train"] / 16.0).astype("float32"), (digits["x_test"] / 16.0).astype("float32")
    y_train, y_test = digits["y_train"], digits["y_test"]

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    state.register_reset_callbacks([lambda: optimizer.learning_rate.assign(args.lr * hvd.size())])
    callbacks = [hvd.callbacks.MetricAverageCallback(), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit)]
    if args.simulate_failure is not None:
        callbacks.insert(0, SimulatedFailure(state, args.simulate_failure))

    @hvd.elastic.run
    def train(state):
        # This round's shard; every rank takes the same number of steps.
        rows = len(x_train) // hvd.size() // args.batch_size * args.batch_size
        x_mine, y_mine = x_train[hvd.rank()::hvd.size()][:rows], y_train[hvd.rank()::hvd.size()][:rows]
        history = model.fit(x_mine, y_mine, batch_size=args.batch_size, epochs=args.epochs,
                            initial_epoch=state.epoch, callbacks=callbacks, verbose=0)
        if hvd.rank() == 0:
            for index, epoch in enumerate(history.epoch):
                if epoch % 5 == 4 or epoch == args.epochs - 1:
                    print("epoch %d: loss %.4f, accuracy %.3f on %d ranks" % (
                        epoch + 1, history.history["loss"][index], history.history["accuracy"][index],
                        hvd.size()), flush=True)

    train(state)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    if hvd.rank() == 0:
        print("test accuracy %.3f on %d ranks" % (accuracy, hvd.size()), flush=True)


if __name__ == "__main__":
    main()
