"""What the TensorFlow op path costs: the same float32 allreduce through
unison.numpy (the raw core), through unison.tensorflow eagerly, inside a
tf.function and in a TF1 graph run by a tf.compat.v1.Session (on a
variable's value), timed in the same processes. Graphs are timed through
the compiled kernels (tf_adapter/kernels.cc) and through the tf.py_function
nodes they fall back to, beside the same tf.function without the
allreduce ("fn alone": what TensorFlow charges to call a function at all),
and once more with both functions compiled by XLA (jit_compile=True), where
the allreduce is a custom call of the XLA program (tf_adapter/kernels_xla.cc).

    unisonrun -np 2 python benchmarks/tf_op_path.py

"compiled - alone" is what an allreduce adds to a tf.function through the
kernels (the issue's target: at most 30 us for a small one); the py_function
column is what it added before them. "xla - alone" is the same under XLA.

    unisonrun -np 2 python benchmarks/tf_op_path.py --autograph-converts-unison

takes unison off AutoGraph's list of libraries it leaves alone
(tf_adapter/ops.py, _keep_autograph_out), as before 2026-11-29: each
tf.function then runs its nodes' Python as AutoGraph's generated code. The
last column, a tf.function step of ten 64 x 64 layers whose gradients go
through DistributedGradientTape, and the time its first call takes to
trace, show what that costs a training step.
"""
import argparse
import contextlib
import statistics
import time

import numpy as np
import tensorflow as tf

import unison
import unison.numpy as unp
import unison.tensorflow as hvd
from unison.tensorflow import ops as tf_ops

import results

results.capture()  # --json PATH: this run's figures as JSON (results.py)


def timed(fn, repeats):
    fn()   # warm up (and trace)
    unp.barrier()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def side_by_side(fns, repeats):
    """The median time of each of `fns`, called in turn within one loop, so
    that the machine's drift (these VMs are noisy) falls on all alike."""
    for fn in fns:
        fn()   # warm up (and trace)
    unp.barrier()
    times = [[] for _ in fns]
    clock = time.perf_counter
    for _ in range(repeats):
        for fn, kept in zip(fns, times):
            started = clock()
            fn()
            kept.append(clock() - started)
    return [statistics.median(kept) for kept in times]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="4096,65536,1048576,16777216,67108864", help="bytes")
    parser.add_argument("--autograph-converts-unison", action="store_true",
                        help="let AutoGraph convert unison's Python, as before 2026-11-29")
    args = parser.parse_args()
    if args.autograph_converts_unison:
        from tensorflow.python.autograph.core import config
        config.CONVERSION_RULES = tuple(r for r in config.CONVERSION_RULES if "unison" not in str(r))
    unison.init()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rank = unison.rank()
    if rank == 0:
        print("float32 allreduce, %d ranks: mean time per op; graphs through the compiled kernels (%s) and "
              "the py_function nodes" % (unison.size(), "loaded" if tf_ops._kernels is not None else "NOT LOADED"))
        columns = ["bytes", "numpy", "tf eager", "fn alone", "fn kernel", "fn py_func", "kernel - alone",
                   "sess kernel", "sess py_fn", "xla alone", "xla allreduce", "xla - alone"]
        print("| " + " | ".join(columns) + " |")
        print("|" + "|".join(" ---: " for _ in columns) + "|")
    for nbytes in [int(s) for s in args.sizes.split(",")]:
        count = nbytes // 4
        repeats = max(5, min(500, int(2e8 // max(nbytes, 1) // 50)))
        array = np.ones(count, dtype=np.float32)
        tensor = tf.constant(array)
        alone = tf.function(lambda t: t * 1.0)
        xla_alone = tf.function(lambda t: t * 1.0, jit_compile=True)
        xla = tf.function(lambda t: hvd.allreduce(t * 1.0, op=hvd.Sum, name="bench.xla"), jit_compile=True)
        numpy_time = timed(lambda: unp.allreduce(array, op=unison.Sum, name="bench.numpy"), repeats)
        eager_time = timed(lambda: hvd.allreduce(tensor, op=hvd.Sum, name="bench.eager"), repeats)
        graphs, session_times = [], []
        for kernels in (tf_ops._kernels, None):
            with nodes(kernels):
                # The same work as `alone`, and the allreduce.
                graphs.append(tf.function(lambda t: hvd.allreduce(t * 1.0, op=hvd.Sum, name="bench.graph")))
                graphs[-1](tensor)   # traced here, with these nodes
                # As a TF1 step's gradients: read in the graph, reduced, used
                # there (nothing fed or fetched, which would copy).
                with tf.Graph().as_default() as graph:
                    variable = tf.compat.v1.get_variable("v", initializer=array)
                    step = tf.group(hvd.allreduce(variable.read_value(), op=hvd.Sum, name="bench.session"))
                    session = tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(
                        inter_op_parallelism_threads=1, use_per_session_threads=True))
                    session.run(variable.initializer)
            session_times.append(timed(lambda: session.run(step), repeats))
            session.close()
        alone_time, *graph_times, xla_alone_time, xla_time = side_by_side(
            [lambda: alone(tensor)] + [lambda g=g: g(tensor) for g in graphs]
            + [lambda: xla_alone(tensor), lambda: xla(tensor)], repeats)
        if rank == 0:
            print("| %d | %.1f us | %.1f us | %.1f us | %.1f us | %.1f us | %+.1f us | %.1f us | %.1f us | %.1f us "
                  "| %.1f us | %+.1f us |" % (
                nbytes, numpy_time * 1e6, eager_time * 1e6, alone_time * 1e6, graph_times[0] * 1e6,
                graph_times[1] * 1e6, (graph_times[0] - alone_time) * 1e6, session_times[0] * 1e6,
                session_times[1] * 1e6, xla_alone_time * 1e6, xla_time * 1e6, (xla_time - xla_alone_time) * 1e6),
                flush=True)
    for kernels, how in ((tf_ops._kernels, "compiled kernel"), (None, "py_function node")):
        with nodes(kernels):
            trace_time, step_time = tape_step()
        if rank == 0:
            print("a tf.function step of 10 layers through DistributedGradientTape (a %s): %.1f us; its first "
                  "call (tracing) %.2f s" % (how, step_time * 1e6, trace_time), flush=True)


@contextlib.contextmanager
def nodes(kernels):
    """Graphs traced inside are built with `kernels` (None: py_function nodes)."""
    saved, tf_ops._kernels = tf_ops._kernels, kernels
    try:
        yield
    finally:
        tf_ops._kernels = saved


def tape_step():
    """A small model's training step in a tf.function, its ten gradients
    allreduced by DistributedGradientTape (one grouped node)."""
    layers = [tf.Variable(tf.ones([64, 64]) * 0.01) for _ in range(10)]
    batch = tf.ones([8, 64])
    optimizer = tf.keras.optimizers.SGD(0.001)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            hidden = batch
            for layer in layers:
                hidden = tf.tanh(hidden @ layer)
            loss = tf.reduce_sum(hidden)
        gradients = hvd.DistributedGradientTape(tape).gradient(loss, layers)
        optimizer.apply_gradients(zip(gradients, layers))
        return loss

    started = time.perf_counter()
    step()
    trace_time = time.perf_counter() - started
    return trace_time, timed(step, 500)


if __name__ == "__main__":
    main()
