"""More ranks on one host than the other suites use (test_parallel.py runs
this at 2, 3, 5, 8 and 9): the reduction kernel combines one input per
rank, in one pass for 2 to 8 inputs and in L1 blocks beyond, and half
precision through F16C where the CPU has it (native/reduce.cc,
reduce_f16c.cc). Every rank computes, in rank order, what the kernel must
give bit for bit: halves and bfloat16 are summed in float and rounded once.
Small tensors (every rank reduces everything) and large ones (each rank
reduces its chunk, across shared-memory rounds); counts that are not a
multiple of 8 leave a tail for the portable kernel."""
import functools

import ml_dtypes
import numpy as np
import pytest

import unison
import unison.numpy as unp
from shared_grid import assert_same

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]


POWERS_OF_TEN = 10.0 ** np.arange(-3, 4)


def contribution(rank, count, dtype):
    # Values whose sum depends on the order they are added in, so that a
    # kernel combining the inputs out of rank order gives other bits. The
    # powers of ten are looked up, not raised per element (the same values).
    rng = np.random.default_rng(1000 + rank)
    return (rng.standard_normal(count) * POWERS_OF_TEN[rng.integers(-3, 4, count) + 3]).astype(dtype)


def widened(x):
    return x.astype(np.float64 if x.dtype == np.float64 else np.float32)


@functools.lru_cache(maxsize=1)
def wide_total(count, dtype, scale, ranks):
    """The kernel's steps up to the division: widen, scale each input, add
    in rank order. Kept for the next call: a test's sum and average share
    it (at 9 ranks, 700,001 elements: nine inputs drawn and widened)."""
    wide = widened(np.zeros(1, dtype)).dtype
    total = widened(contribution(0, count, dtype)) * wide.type(scale)
    for r in range(1, ranks):
        total += widened(contribution(r, count, dtype)) * wide.type(scale)
    total.flags.writeable = False
    return total


def expected_result(count, dtype, scale=1.0, divisor=1):
    # The kernel's steps: wide_total's, then divide, and round back once.
    total = wide_total(count, dtype, scale, unison.size())
    return (total / total.dtype.type(divisor)).astype(dtype)


def name(what, dtype, count):
    return "wide.%s.%s.%d" % (what, np.dtype(dtype).name, count)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("count", [1, 1031, 700_001], ids=["one", "small", "rounds"])
def test_sum_and_average_are_combined_in_rank_order(dtype, count):
    n = unison.size()
    mine = contribution(unison.rank(), count, dtype)
    x = mine.copy()
    assert unp.allreduce_(x, op=unison.Sum, name=name("sum", dtype, count)) is x
    assert_same(x.view(np.uint8), expected_result(count, dtype).view(np.uint8))
    average = unp.allreduce(mine, op=unison.Average, name=name("avg", dtype, count))
    assert_same(average.view(np.uint8), expected_result(count, dtype, divisor=n).view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_scaled_sum_keeps_the_same_steps(dtype):
    count = 70_001
    mine = contribution(unison.rank(), count, dtype)
    out = unp.allreduce(mine, op=unison.Sum, prescale_factor=0.5, name=name("scaled", dtype, count))
    assert_same(out.view(np.uint8), expected_result(count, dtype, scale=0.5).view(np.uint8))
