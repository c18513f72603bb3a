"""More ranks on one host than the other suites use (test_parallel.py runs
this at 5, 8 and 9): the reduction kernel combines one input per rank, in
one pass for 2 to 8 inputs and in L1 blocks beyond (native/reduce.cc).
Every rank computes, in rank order, what the kernel must give bit for bit,
small (every rank reduces everything) and large (each rank reduces its
chunk, across shared-memory rounds)."""
import numpy as np
import pytest

import unison
import unison.numpy as unp


def contribution(rank, count, dtype):
    # Values whose sum depends on the order they are added in, so that a
    # kernel combining the inputs out of rank order gives other bits.
    rng = np.random.default_rng(1000 + rank)
    return (rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count)).astype(dtype)


def in_rank_order(count, dtype):
    total = contribution(0, count, dtype)
    for r in range(1, unison.size()):
        total = total + contribution(r, count, dtype)
    return total


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("count", [1, 1031, 700_001], ids=["one", "small", "rounds"])
def test_sum_and_average_are_combined_in_rank_order(dtype, count):
    n = unison.size()
    mine = contribution(unison.rank(), count, dtype)
    expected = in_rank_order(count, dtype)
    x = mine.copy()
    assert unp.allreduce_(x, op=unison.Sum, name="wide.sum.%s.%d" % (np.dtype(dtype).name, count)) is x
    np.testing.assert_array_equal(x, expected)
    average = unp.allreduce(mine, op=unison.Average, name="wide.avg.%s.%d" % (np.dtype(dtype).name, count))
    np.testing.assert_array_equal(average, expected / dtype(n))


def test_scaled_sum_takes_the_blocked_kernel_with_the_same_order():
    n = unison.size()
    count = 70_001
    mine = contribution(unison.rank(), count, np.float32)
    out = unp.allreduce(mine, op=unison.Sum, prescale_factor=0.5, name="wide.scaled")
    expected = contribution(0, count, np.float32) * np.float32(0.5)
    for r in range(1, n):
        expected = expected + contribution(r, count, np.float32) * np.float32(0.5)
    np.testing.assert_array_equal(out, expected)
