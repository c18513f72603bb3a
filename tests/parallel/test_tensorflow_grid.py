"""The shared grid (shared_grid.py) for unison.tensorflow: every op eagerly
and traced into a tf.function, and broadcast_ into variables."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import unison.tensorflow as hvd  # noqa: E402

from shared_grid import *  # noqa: F401,F403,E402  (the grid's tests and pytest_generate_tests)
from shared_grid import Shim  # noqa: E402

ALL = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "bfloat16",
       "float32", "float64"]


def _ps(process_set):
    return hvd.global_process_set if process_set is None else process_set


def eager_and_traced(fn):
    """{'eager': fn, 'tf.function': fn traced into a graph}: tensors are
    arguments of the traced function, everything else is closed over."""
    def traced(x, *rest):
        return tf.function(lambda t: fn(t, *rest))(x)
    return {"eager": fn, "tf.function": traced}


class TensorFlowShim(Shim):
    name = "tensorflow"
    hvd = hvd
    dtypes = ALL + ["bool"]
    reduce_dtypes = ALL

    def tensor(self, array):
        return tf.constant(array)

    def numpy(self, tensor):
        return np.asarray(tensor.numpy())

    def allreduce_forms(self):
        return eager_and_traced(lambda x, op, name, pre, post, ps: hvd.allreduce(
            x, op=op, name=name, prescale_factor=pre, postscale_factor=post, process_set=_ps(ps)))

    def grouped_allreduce(self, xs, op, name, ps):
        return hvd.grouped_allreduce(xs, op=op, name=name, process_set=_ps(ps))

    def allgather_forms(self):
        return eager_and_traced(lambda x, name, ps: hvd.allgather(x, name=name, process_set=_ps(ps)))

    def grouped_allgather(self, xs, name, ps):
        return hvd.grouped_allgather(xs, name=name, process_set=_ps(ps))

    def broadcast_forms(self):
        def into_variable(x, root, name, ps):
            variable = tf.Variable(x)
            hvd.broadcast_([variable], root, name=name, process_set=_ps(ps))
            return variable
        forms = eager_and_traced(lambda x, root, name, ps: hvd.broadcast(x, root, name=name, process_set=_ps(ps)))
        forms["variable"] = into_variable
        return forms

    def alltoall(self, x, splits, name, ps):
        out, received = hvd.alltoall(x, splits=tf.constant(splits, tf.int32), name=name, process_set=_ps(ps))
        return out, received.numpy().tolist()

    def alltoall_even(self, x, name, ps):
        return hvd.alltoall(x, name=name, process_set=_ps(ps))

    def reducescatter_forms(self):
        return eager_and_traced(lambda x, op, name, ps: hvd.reducescatter(x, op=op, name=name,
                                                                          process_set=_ps(ps)))

    def grouped_reducescatter(self, xs, op, name, ps):
        return hvd.grouped_reducescatter(xs, op=op, name=name, process_set=_ps(ps))

    def barrier(self, ps):
        hvd.barrier(process_set=_ps(ps))


SHIM = TensorFlowShim()
