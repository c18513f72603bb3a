"""The shared grid (shared_grid.py) for unison.tensorflow: every op eagerly,
traced into a tf.function and into a TF1 session graph, allreduce also in
a function XLA compiles, and broadcast_ into variables."""
import functools

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


def signature(x):
    """The dtypes and shapes of a tensor, or of a list of them."""
    if isinstance(x, (list, tuple)):
        return tuple(signature(t) for t in x)
    return x.dtype, tuple(x.shape)


class LastGraph:
    """The graph the last call built, kept for a call with the same tensor
    shapes and dtypes (x is a tensor or a list of them) and the same other
    arguments: a training step traced or built once and then run step
    after step, as TensorFlow users run them, so the grid's repeated steps
    (test_in_place_allreduce_repeated_step_...) run the same graph's ops
    again. Any other call builds its own."""

    def __init__(self, build):
        self.build = build  # (x, *rest) -> the call on x
        self.key = self.call = None

    def __call__(self, x, *rest):
        key = (signature(x), rest)
        if key != self.key:
            self.close()
            self.key, self.call = key, self.build(x, *rest)
        return self.call(x)

    def close(self):
        close = getattr(self.call, "close", None)
        self.key = self.call = None
        if close is not None:
            close()


def traced(fn, jit_compile=False):
    """fn traced into a tf.function, whose argument is the tensor; the rest
    is closed over. With jit_compile, XLA compiles it, and allreduce is a
    custom call of its program (tf_adapter/kernels_xla.cc)."""
    return LastGraph(lambda x, *rest: tf.function(lambda t: fn(t, *rest), jit_compile=jit_compile))


class InASession:
    """fn built into a TF1 graph, whose placeholders are fed the tensor (or
    each tensor of a list), run by a tf.compat.v1.Session."""

    def __init__(self, fn, x, *rest):
        self.many = isinstance(x, (list, tuple))
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.fed = [tf.compat.v1.placeholder(t.dtype, t.shape) for t in (x if self.many else [x])]
            self.out = fn(self.fed if self.many else self.fed[0], *rest)
        self.session = tf.compat.v1.Session(graph=self.graph)

    def __call__(self, x):
        values = self.session.run(self.out, {f: t.numpy() for f, t in zip(self.fed, x if self.many else [x])})
        return [tf.constant(v) for v in values] if self.many else tf.constant(values)

    def close(self):
        self.session.close()


def in_a_session(fn):
    return LastGraph(lambda x, *rest: InASession(fn, x, *rest))


def traced_every_root(fn):
    """fn from every root (xs[r] broadcast from root r) in one tf.function."""
    def run(xs, names, process_set):
        return tf.function(lambda *ts: in_root_order(fn, ts, names, process_set))(*xs)
    return run


def in_a_session_every_root(fn):
    """fn from every root in one TF1 graph, run once by a session."""
    def run(xs, names, process_set):
        graph = tf.Graph()
        with graph.as_default():
            fed = [tf.compat.v1.placeholder(x.dtype, x.shape) for x in xs]
            outs = in_root_order(fn, fed, names, process_set)
        with tf.compat.v1.Session(graph=graph) as session:  # the graph is the default one inside
            values = session.run(outs, {f: x.numpy() for f, x in zip(fed, xs)})
        return [tf.constant(v) for v in values]
    return run


def one_after_another(calls):
    """Each call's op, in one graph, after the op of the call before: every
    rank then starts them in the same order, as the eager loop does (the
    py_function nodes block their thread until their op completes, and a
    graph free to run them in any order could hold every thread of a rank
    in an op whose peers started another). Eagerly it only runs them."""
    outs = []
    for call in calls:
        with tf.control_dependencies(outs[-1:]):
            outs.append(call())
    return outs


def in_root_order(fn, tensors, names, process_set):
    """The broadcasts of one graph, from root 0 on."""
    return one_after_another(functools.partial(fn, t, root, name, process_set)
                             for root, (t, name) in enumerate(zip(tensors, names)))


def in_step_order(allreduce):
    """A step of allreduce's calls, in the order given."""
    def step(xs, ops, names):
        return one_after_another(functools.partial(allreduce, x, op, name, 1.0, 1.0, None)
                                 for x, op, name in zip(xs, ops, names))
    return step


def eager_and_traced(forms):
    """Each of Horovod's forms eagerly, traced into a tf.function, and built
    into a TF1 graph run by a tf.compat.v1.Session. In graphs, each runs
    through the compiled kernels and once more through the py_function
    nodes (graphs of their own: a graph's nodes are chosen when it is
    built)."""
    graph_forms = {"tf.function": traced, "tf1-session": in_a_session}
    compiled = {kind: make(forms["sync"]) for kind, make in graph_forms.items()}
    fallback = {kind + "-py_function": with_py_function_nodes(make(forms["sync"]))
                for kind, make in graph_forms.items()}
    return dict(eager=forms["sync"], **compiled, **fallback)


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
        # Allreduce alone lowers to XLA, grouped or not: in a function XLA
        # compiles, each form runs as a custom call of the XLA program.
        forms = super().allreduce_forms()
        return dict(eager_and_traced(forms), **{"xla": traced(forms["sync"], jit_compile=True),
                                                "xla-grouped": traced(forms["grouped"], jit_compile=True)})

    def allreduce_step_forms(self):
        # Each graph form builds one graph for the whole step, run again at
        # the next: 6 graphs a dtype, where a graph per call built 48.
        forms = super().allreduce_forms()
        step, grouped_step = in_step_order(forms["sync"]), in_step_order(forms["grouped"])
        return dict(eager_and_traced({"sync": step}), **{"xla": traced(step, jit_compile=True),
                                                         "xla-grouped": traced(grouped_step, jit_compile=True)})

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

    def broadcast_every_root_forms(self):
        # The graph forms build one graph for every root, not one per root:
        # 2/3 of their graphs at 3 ranks, where building is most of their cost.
        forms, sync = super().broadcast_every_root_forms(), super().broadcast_forms()["sync"]
        graph_forms = {"tf.function": traced_every_root, "tf1-session": in_a_session_every_root}
        for kind, make in graph_forms.items():
            forms[kind] = make(sync)
            forms[kind + "-py_function"] = with_py_function_nodes(make(sync))
        return forms


SHIM = TensorFlowShim()
