"""Data-parallel SGD on numpy equals one process on the whole batch.

Each rank takes its shard of every batch and averages gradients with
unison.numpy.allreduce; the reference is the same SGD run by this rank
alone on the whole batch. tests/test_mpi.py runs this suite on the MPI
layouts too, where the average is summed in another order (within hosts,
then across), so the check is a float tolerance, not equality."""
import numpy as np

import unison
import unison.numpy as unp
from shared_grid import assert_same


def data(samples=96, features=7, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features))
    true_w = rng.normal(size=(features, 2))
    y = x @ true_w + 0.1 * rng.normal(size=(samples, 2))
    return x, y


def gradients(w, b, x, y):
    """Mean squared error of a linear model: gradients of the batch mean."""
    error = x @ w + b - y
    return 2 * x.T @ error / len(x), 2 * error.mean(axis=0)


def train(steps, batch, step_size, reduce):
    x, y = data()
    w, b = np.zeros((x.shape[1], 2)), np.zeros(2)
    for step in range(steps):
        rows = np.arange(step * batch, (step + 1) * batch) % len(x)
        gw, gb = reduce(w, b, x[rows], y[rows], step)
        w -= step_size * gw
        b -= step_size * gb
    return w, b


def test_sgd_on_shards_equals_one_process_on_the_whole_batch():
    rank, size = unison.rank(), unison.size()
    batch = 6 * size  # equal shards, so the average of shard means is the batch mean

    def data_parallel(w, b, xb, yb, step):
        gw, gb = gradients(w, b, xb[rank::size], yb[rank::size])
        return (unp.allreduce(gw, name="train.gw"), unp.allreduce(gb, name="train.gb"))

    def whole_batch(w, b, xb, yb, step):
        return gradients(w, b, xb, yb)

    w, b = train(40, batch, 0.05, data_parallel)
    w_ref, b_ref = train(40, batch, 0.05, whole_batch)
    np.testing.assert_allclose(w, w_ref, rtol=0, atol=1e-12)
    np.testing.assert_allclose(b, b_ref, rtol=0, atol=1e-12)
    # Every rank holds the same bits.
    assert_same(unp.broadcast(w, 0, name="train.w0"), w)
