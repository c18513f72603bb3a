"""Many joins in a row, each followed by an allgather_object, with every
rank in turn joining first (tests/test_parallel.py runs it with the response
cache on and off): the long form of the shared grid's join test, for a race
that showed in a few runs in ten.

    join_loop.py REPEATS JOINS
Each rank prints "rank R: N joins" when all REPEATS x JOINS have passed.
"""
import sys

import numpy as np

import unison
import unison.numpy as unp
from unison.objects import allgather_object

unison.init()
rank, size = unison.rank(), unison.size()
repeats, joins = int(sys.argv[1]), int(sys.argv[2])
done = 0
for repeat in range(repeats):
    for i in range(joins):
        first = (i + repeat) % size
        dtype = [np.int32, np.int64, np.float32, np.float64][i % 4]
        a = np.full([5] * (1 + i % 3), rank + 1, dtype)
        b = np.full([17] * (1 + i % 3), rank + 1, dtype)
        if i % 2:  # every rank, before anyone joins
            unp.allreduce(a, name="tensor_a", op=unison.Sum)
            unp.allreduce(b, name="tensor_b", op=unison.Sum)
        if rank != first:
            handles = [unp.allreduce_async(a, name="tensor_a", op=unison.Sum),
                       unp.allreduce_async(b, name="tensor_b", op=unison.Sum)]
            expected = size * (size + 1) // 2 - (first + 1)  # the joined rank adds zeros
            for handle in handles:
                out = unp.synchronize(handle)
                assert (out == expected).all(), (repeat, i, out.ravel()[:3], expected)
        last = unp.join()
        assert allgather_object(last) == [last] * size, (repeat, i)
        done += 1
print("rank %d: %d joins" % (rank, done), flush=True)
