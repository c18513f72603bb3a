"""The shared grid (shared_grid.py) for unison.tensorflow: every op eagerly
and traced into a tf.function, and broadcast_ into variables."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import unison.tensorflow as hvd  # noqa: E402
from unison.tensorflow import ops as tf_ops  # noqa: E402

from shared_grid import *  # noqa: F401,F403,E402  (the grid's tests and pytest_generate_tests)
from shared_grid import Shim  # noqa: E402

NUMBERS = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "bfloat16",
           "float32", "float64"]


def with_py_function_nodes(form):
    """`form`, traced with the tf.py_function nodes that the compiled kernels
    fall back to where they cannot be built (tf_adapter/kernels.py)."""
    def run(*args):
        kernels, tf_ops._kernels = tf_ops._kernels, None
        try:
            return form(*args)
        finally:
            tf_ops._kernels = kernels
    return run


def eager_and_traced(forms):
    """Each of Horovod's forms eagerly, traced into a tf.function, and built
    into a TF1 graph run by a tf.compat.v1.Session: the tensor is the traced
    function's argument or the graph's placeholder, the rest is closed over.
    In graphs, each runs through the compiled kernels and once more through
    the py_function nodes."""
    def traced(fn):
        return lambda x, *rest: tf.function(lambda t: fn(t, *rest))(x)

    def in_a_session(fn):
        def run(x, *rest):
            with tf.Graph().as_default() as graph:
                fed = tf.compat.v1.placeholder(x.dtype, x.shape)
                out = fn(fed, *rest)
                with tf.compat.v1.Session(graph=graph) as session:
                    value = session.run(out, {fed: x.numpy()})
            return tf.constant(value)
        return run
    graph_forms = {"tf.function": traced(forms["sync"]), "tf1-session": in_a_session(forms["sync"])}
    fallback = {kind + "-py_function": with_py_function_nodes(form) for kind, form in graph_forms.items()}
    return dict(eager=forms["sync"], **graph_forms, **fallback)


class TensorFlowShim(Shim):
    name = "tensorflow"
    api = hvd
    dtypes = NUMBERS + ["bool", "complex64", "complex128"]
    reduce_dtypes = NUMBERS

    def tensor(self, array):
        return tf.constant(array)

    def numpy(self, tensor):
        return np.asarray(tensor.numpy())

    # TensorFlow's ops have no async or in-place forms (but for broadcast_
    # into variables); they run eagerly and inside tf.function instead.
    def allreduce_forms(self):
        return eager_and_traced(super().allreduce_forms())

    def allgather_forms(self):
        return eager_and_traced(super().allgather_forms())

    def reducescatter_forms(self):
        return eager_and_traced(super().reducescatter_forms())

    def broadcast_forms(self):
        def into_variable(x, root, name, process_set):
            variable = tf.Variable(x)
            hvd.broadcast_([variable], root, name=name, process_set=self.ps(process_set))
            return variable
        forms = eager_and_traced(super().broadcast_forms())
        forms["variable"] = into_variable
        return forms


SHIM = TensorFlowShim()
