"""Softmax regression on UCI's handwritten digits (examples/data/), data-parallel.

    unisonrun -np 2 python examples/numpy/logistic_regression.py

Each rank trains on its own shard of the training set; gradients are
averaged with unison.numpy.allreduce, so every rank holds the same weights
after every step (as one process on the whole batch would). Rank 0 starts
the weights and broadcasts them.
"""
import numpy as np
import os

import unison
import unison.numpy as unp

# UCI's handwritten digits (the set scikit-learn bundles), split 3:1 into
# training and test rows once for every example: examples/data/README.md.
DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "data", "digits.npz")


def softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def main(steps=300, learning_rate=0.5, batch_size=64):
    unison.init()
    rank, size = unison.rank(), unison.size()
    digits = np.load(DIGITS)
    x_train, x_test = digits["x_train"] / 16.0, digits["x_test"] / 16.0
    y_train, y_test = digits["y_train"], digits["y_test"]
    x_shard, y_shard = x_train[rank::size], y_train[rank::size]

    rng = np.random.default_rng(rank)  # deliberately different per rank...
    weights = rng.normal(scale=0.01, size=(64, 10))
    bias = np.zeros(10)
    weights = unp.broadcast(weights, 0, name="weights")  # ...until rank 0's are broadcast
    bias = unp.broadcast(bias, 0, name="bias")

    batch_rng = np.random.default_rng(1234 + rank)
    for step in range(steps):
        idx = batch_rng.integers(0, len(x_shard), batch_size // size)
        xb, yb = x_shard[idx], y_shard[idx]
        probs = softmax(xb @ weights + bias)
        onehot = np.eye(10)[yb]
        loss = -np.log(probs[np.arange(len(yb)), yb] + 1e-12).mean()
        grad_logits = (probs - onehot) / len(yb)
        grad_w = unp.allreduce(xb.T @ grad_logits, name="grad.w")  # Average, as Horovod
        grad_b = unp.allreduce(grad_logits.sum(axis=0), name="grad.b")
        weights -= learning_rate * grad_w
        bias -= learning_rate * grad_b
        loss = unp.allreduce(np.array(loss), name="loss")
        if rank == 0 and (step % 50 == 0 or step == steps - 1):
            print("step %3d  loss %.4f" % (step, loss), flush=True)

    same = unp.allreduce(weights, op=unison.Max, name="check") == weights
    accuracy = (np.argmax(x_test @ weights + bias, axis=1) == y_test).mean()
    if rank == 0:
        print("test accuracy %.3f on %d ranks; weights identical on every rank: %s"
              % (accuracy, size, bool(same.all())), flush=True)
    unison.shutdown()


if __name__ == "__main__":
    main()
