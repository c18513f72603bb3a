"""The shared grid (shared_grid.py) for unison.numpy, the reference front
end: numpy arrays in, numpy arrays out."""
import numpy as np
import pytest

import unison
import unison.numpy as unp

from shared_grid import *  # noqa: F401,F403  (the grid's tests and pytest_generate_tests)
from shared_grid import Shim

pytest.importorskip("ml_dtypes")

ALL = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "bfloat16",
       "float32", "float64"]


def _ps(process_set):
    return unison.global_process_set if process_set is None else process_set


class NumpyShim(Shim):
    name = "numpy"
    hvd = unison
    dtypes = ALL + ["bool"]
    reduce_dtypes = ALL

    def tensor(self, array):
        return np.array(array)

    def numpy(self, tensor):
        return np.asarray(tensor)

    def allreduce_forms(self):
        def sync(x, op, name, pre, post, ps):
            return unp.allreduce(x, op=op, name=name, prescale_factor=pre, postscale_factor=post,
                                 process_set=_ps(ps))

        def asynchronous(x, op, name, pre, post, ps):
            return unp.synchronize(unp.allreduce_async(x, op=op, name=name, prescale_factor=pre,
                                                       postscale_factor=post, process_set=_ps(ps)))

        def in_place(x, op, name, pre, post, ps):
            assert unp.allreduce_(x, op=op, name=name, prescale_factor=pre, postscale_factor=post,
                                  process_set=_ps(ps)) is x
            return x

        def grouped(x, op, name, pre, post, ps):
            return unp.grouped_allreduce([x], op=op, name=name, prescale_factor=pre, postscale_factor=post,
                                         process_set=_ps(ps))[0]
        return {"sync": sync, "async": asynchronous, "in_place": in_place, "grouped": grouped}

    def grouped_allreduce(self, xs, op, name, ps):
        return unp.grouped_allreduce(xs, op=op, name=name, process_set=_ps(ps))

    def allgather_forms(self):
        return {"sync": lambda x, name, ps: unp.allgather(x, name=name, process_set=_ps(ps)),
                "async": lambda x, name, ps: unp.synchronize(unp.allgather_async(x, name=name,
                                                                                 process_set=_ps(ps)))}

    def grouped_allgather(self, xs, name, ps):
        return unp.grouped_allgather(xs, name=name, process_set=_ps(ps))

    def broadcast_forms(self):
        def in_place(x, root, name, ps):
            assert unp.broadcast_(x, root, name=name, process_set=_ps(ps)) is x
            return x
        return {"sync": lambda x, root, name, ps: unp.broadcast(x, root, name=name, process_set=_ps(ps)),
                "async": lambda x, root, name, ps: unp.synchronize(unp.broadcast_async(x, root, name=name,
                                                                                       process_set=_ps(ps))),
                "in_place": in_place}

    def alltoall(self, x, splits, name, ps):
        out, received = unp.alltoall(x, splits=splits, name=name, process_set=_ps(ps))
        return out, [int(s) for s in received]

    def alltoall_even(self, x, name, ps):
        return unp.alltoall(x, name=name, process_set=_ps(ps))

    def reducescatter_forms(self):
        return {"sync": lambda x, op, name, ps: unp.reducescatter(x, op=op, name=name, process_set=_ps(ps)),
                "async": lambda x, op, name, ps: unp.synchronize(unp.reducescatter_async(
                    x, op=op, name=name, process_set=_ps(ps)))}

    def grouped_reducescatter(self, xs, op, name, ps):
        return unp.grouped_reducescatter(xs, op=op, name=name, process_set=_ps(ps))

    def barrier(self, ps):
        unp.barrier(process_set=_ps(ps))


SHIM = NumpyShim()
