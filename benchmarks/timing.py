"""Timing helpers the benchmarks share."""
import hashlib
import os
import time

import numpy as np

import unison
import unison.numpy as unp
from unison import basics, collective, dtypes
from unison._native import ffi, lib


def timed(fn, iterations):
    """Seconds per call of fn, over `iterations` calls."""
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations


def join_gloo(tag=""):
    """Joins every rank of this unison job to a torch.distributed gloo
    group on this host, beside unison, at a port derived from the job's id
    and `tag` (so that two benchmarks of one job do not collide)."""
    import torch.distributed as dist

    job = os.environ.get("UNISON_JOB_ID", "solo")
    port = 20000 + int(hashlib.md5((tag + job).encode()).hexdigest(), 16) % 20000
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=unison.rank(),
                            world_size=unison.size())


def agree(seconds):
    """The slowest rank's time, so every rank reports the same figure."""
    return float(unp.allreduce(np.array(seconds), op=unison.Max, name="bench.agree"))


def core_allreduces(arrays, names):
    """A function that Sum-allreduces the float32 `arrays` in place through
    the core's C API alone (unison.h's unison_enqueue, then
    unison_wait_release for each), their options filled once here: what
    the core costs, apart from any front end. It returns the seconds its
    loop of enqueues took. It holds the arrays: the structs point into them."""
    prepared = []  # each options struct with the C memory it points to, and its array
    for a, name in zip(arrays, names):
        p = collective.prepare(lib.UNISON_ALLREDUCE, name, dtypes.code_of("float32", name), a.shape, unison.Sum,
                               1.0, 1.0, 0, None, 0, lib.UNISON_CPU_DEVICE)
        p[0].input = p[0].output = ffi.from_buffer(a)
        prepared.append((*p, a))
    handle = ffi.new("unison_handle*")

    def run():
        started = []
        begun = time.perf_counter()
        for options, *_ in prepared:
            basics.check(lib.unison_enqueue(options, handle))
            started.append(handle[0])
        enqueued = time.perf_counter() - begun
        for handle_id in started:
            basics.check(lib.unison_wait_release(handle_id, 60.0))
        return enqueued
    return run
