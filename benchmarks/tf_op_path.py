"""What the TensorFlow op path costs: the same float32 allreduce through
unison.numpy (the raw core), through unison.tensorflow eagerly, inside a
tf.function (a py_function node) and in a TF1 graph run by a
tf.compat.v1.Session (the same node, on a variable's value), timed in the
same processes, with the cost of the two conversions a custom kernel would
avoid.

    unisonrun -np 2 python benchmarks/tf_op_path.py

The difference between the tf.function column and the numpy column is the
most a custom op kernel could save (tf_adapter/README.md).

    unisonrun -np 2 python benchmarks/tf_op_path.py --autograph-converts-unison

takes unison off AutoGraph's list of libraries it leaves alone
(tf_adapter/ops.py, _keep_autograph_out), as before 2026-11-29: each
tf.function then runs its nodes' Python as AutoGraph's generated code. The
last column, a tf.function step of ten 64 x 64 layers whose gradients go
through DistributedGradientTape, and the time its first call takes to
trace, show what that costs a training step.
"""
import argparse
import time

import numpy as np
import tensorflow as tf

import unison
import unison.numpy as unp
import unison.tensorflow as hvd


def timed(fn, repeats):
    fn()   # warm up (and trace)
    unp.barrier()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


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
        print("float32 allreduce, %d ranks: mean seconds per op" % unison.size())
        print("%10s %12s %12s %12s %12s %12s %12s %12s" % ("bytes", "numpy", "tf eager", "tf.function",
                                                            "fn - numpy", "session", "t.numpy()", "to tensor"))
    for nbytes in [int(s) for s in args.sizes.split(",")]:
        count = nbytes // 4
        repeats = max(5, min(500, int(2e8 // max(nbytes, 1) // 50)))
        array = np.ones(count, dtype=np.float32)
        tensor = tf.constant(array)
        in_graph = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name="bench.graph"))
        numpy_time = timed(lambda: unp.allreduce(array, op=unison.Sum, name="bench.numpy"), repeats)
        eager_time = timed(lambda: hvd.allreduce(tensor, op=hvd.Sum, name="bench.eager"), repeats)
        graph_time = timed(lambda: in_graph(tensor), repeats)
        # As a TF1 step's gradients: read in the graph, reduced, used there
        # (nothing fed or fetched, which would copy).
        with tf.Graph().as_default() as graph:
            variable = tf.compat.v1.get_variable("v", initializer=array)
            step = tf.group(hvd.allreduce(variable.read_value(), op=hvd.Sum, name="bench.session"))
            session = tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(
                inter_op_parallelism_threads=1, use_per_session_threads=True))
            session.run(variable.initializer)
        session_time = timed(lambda: session.run(step), repeats)
        session.close()
        view_time = timed(lambda: tensor.numpy(), repeats)
        result = np.ones(count, dtype=np.float32)
        convert_time = timed(lambda: tf.convert_to_tensor(result), repeats)
        if rank == 0:
            print("%10d %10.1fus %10.1fus %10.1fus %+10.1fus %10.1fus %10.1fus %10.1fus" % (
                nbytes, numpy_time * 1e6, eager_time * 1e6, graph_time * 1e6, (graph_time - numpy_time) * 1e6,
                session_time * 1e6, view_time * 1e6, convert_time * 1e6), flush=True)
    trace_time, step_time = tape_step()
    if rank == 0:
        print("a tf.function step of 10 layers through DistributedGradientTape: %.1f us; its first call "
              "(tracing) %.2f s" % (step_time * 1e6, trace_time), flush=True)


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
