"""Softmax regression on scikit-learn's bundled digits, data-parallel.

    unisonrun -np 2 python examples/numpy/logistic_regression.py

Each rank trains on its own shard of the training set; gradients are
averaged with unison.numpy.allreduce, so every rank holds the same weights
after every step (as one process on the whole batch would). Rank 0 starts
the weights and broadcasts them.
"""
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import unison
import unison.numpy as unp


def softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def main(steps=300, learning_rate=0.5, batch_size=64):
    unison.init()
    rank, size = unison.rank(), unison.size()
    x, y = load_digits(return_X_y=True)
    x = x / 16.0
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
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
