"""The shared grid (shared_grid.py) for unison.mxnet: NDArrays in and out,
each op started on MXNet's engine, plain and in place."""
import numpy as np
import pytest

mx = pytest.importorskip("mxnet")

import unison.mxnet as hvd  # noqa: E402

from shared_grid import *  # noqa: F401,F403,E402  (the grid's tests and pytest_generate_tests)
from shared_grid import Shim  # noqa: E402


def _ps(process_set):
    return hvd.global_process_set if process_set is None else process_set


class MXNetShim(Shim):
    name = "mxnet"
    hvd = hvd
    # MXNet's NDArray has no unsigned types past uint8, no bfloat16 and no bool.
    dtypes = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]
    reduce_dtypes = dtypes
    bool_reductions = False

    def tensor(self, array):
        return mx.nd.array(array, dtype=array.dtype)

    def numpy(self, tensor):
        return tensor.asnumpy()

    def allreduce_forms(self):
        def sync(x, op, name, pre, post, ps):
            return hvd.allreduce(x, op=op, name=name, prescale_factor=pre, postscale_factor=post,
                                 process_set=_ps(ps))

        def in_place(x, op, name, pre, post, ps):
            assert hvd.allreduce_(x, op=op, name=name, prescale_factor=pre, postscale_factor=post,
                                  process_set=_ps(ps)) is x
            return x

        def grouped(x, op, name, pre, post, ps):
            return hvd.grouped_allreduce([x], op=op, name=name, prescale_factor=pre, postscale_factor=post,
                                         process_set=_ps(ps))[0]

        def grouped_in_place(x, op, name, pre, post, ps):
            hvd.grouped_allreduce_([x], op=op, name=name, prescale_factor=pre, postscale_factor=post,
                                   process_set=_ps(ps))
            return x
        return {"sync": sync, "in_place": in_place, "grouped": grouped, "grouped_in_place": grouped_in_place}

    def grouped_allreduce(self, xs, op, name, ps):
        return hvd.grouped_allreduce(xs, op=op, name=name, process_set=_ps(ps))

    def allgather_forms(self):
        return {"sync": lambda x, name, ps: hvd.allgather(x, name=name, process_set=_ps(ps))}

    def grouped_allgather(self, xs, name, ps):
        return hvd.grouped_allgather(xs, name=name, process_set=_ps(ps))

    def broadcast_forms(self):
        def in_place(x, root, name, ps):
            assert hvd.broadcast_(x, root, name=name, process_set=_ps(ps)) is x
            return x
        return {"sync": lambda x, root, name, ps: hvd.broadcast(x, root, name=name, process_set=_ps(ps)),
                "in_place": in_place}

    def alltoall(self, x, splits, name, ps):
        out, received = hvd.alltoall(x, splits=splits, name=name, process_set=_ps(ps))
        return out, received.asnumpy().tolist()

    def alltoall_even(self, x, name, ps):
        return hvd.alltoall(x, name=name, process_set=_ps(ps))

    def reducescatter_forms(self):
        return {"sync": lambda x, op, name, ps: hvd.reducescatter(x, op=op, name=name, process_set=_ps(ps))}

    def grouped_reducescatter(self, xs, op, name, ps):
        return hvd.grouped_reducescatter(xs, op=op, name=name, process_set=_ps(ps))

    def barrier(self, ps):
        hvd.barrier(process_set=_ps(ps))


SHIM = MXNetShim()
