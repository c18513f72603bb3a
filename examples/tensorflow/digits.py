"""A digits classifier (UCI's handwritten digits, examples/data/) trained with
unison.tensorflow and a DistributedGradientTape, written as a Horovod
TensorFlow 2 script with one import changed.

    unisonrun -np 2 python examples/tensorflow/digits.py

Each rank trains on its own shard; the tape averages the gradients across
ranks; rank 0's initial weights are broadcast first, so every rank holds
the same model throughout. The training step is a tf.function, so the
collectives run as nodes of TensorFlow's graph.
"""
import argparse
import os

import keras
import numpy as np
import tensorflow as tf

import unison.tensorflow as hvd

# UCI's handwritten digits (the set scikit-learn bundles), split 3:1 into
# training and test rows once for every example: examples/data/README.md.
DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "data", "digits.npz")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    hvd.init()
    keras.utils.set_random_seed(hvd.rank())  # different on purpose: the broadcast aligns them

    digits = np.load(DIGITS)
    x_train, x_test = (digits["x_train"] / 16.0).astype("float32"), (digits["x_test"] / 16.0).astype("float32")
    y_train, y_test = digits["y_train"], digits["y_test"]
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    # Horovod's advice: scale the learning rate with the number of ranks.
    optimizer = keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)
    optimizer.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables, root_rank=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    rng = np.random.RandomState(1234 + hvd.rank())
    # Every rank takes the same number of steps (shards may differ by a row).
    steps = min(hvd.allgather_object(len(x_train))) // args.batch_size
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_train))
        total = 0.0
        for step in range(steps):
            index = order[step * args.batch_size:(step + 1) * args.batch_size]
            total += float(train_step(x_train[index], y_train[index]))
        mean_loss = float(hvd.allreduce(tf.constant(total / steps), name="epoch_loss"))
        if hvd.rank() == 0 and (epoch % 5 == 4 or epoch == args.epochs - 1):
            print("epoch %d: loss %.4f" % (epoch + 1, mean_loss), flush=True)

    accuracy = float(np.mean(np.argmax(model(x_test), axis=1) == y_test))
    if hvd.rank() == 0:
        print("test accuracy %.3f on %d ranks" % (accuracy, hvd.size()), flush=True)


if __name__ == "__main__":
    main()
