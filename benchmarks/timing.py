"""Timing helpers the benchmarks share."""
import time

import numpy as np

import unison
import unison.numpy as unp


def timed(fn, iterations):
    """Seconds per call of fn, over `iterations` calls."""
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations


def agree(seconds):
    """The slowest rank's time, so every rank reports the same figure."""
    return float(unp.allreduce(np.array(seconds), op=unison.Max, name="bench.agree"))
