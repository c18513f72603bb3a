"""What the TensorFlow op path costs: the same float32 allreduce through
unison.numpy (the raw core), through unison.tensorflow eagerly, inside a
tf.function (a py_function node) and in a TF1 graph run by a
tf.compat.v1.Session (the same node, on a variable's value), timed in the
same processes, with the cost of the two conversions a custom kernel would
avoid.

    unisonrun -np 2 python benchmarks/tf_op_path.py

The difference between the tf.function column and the numpy column is the
most a custom op kernel could save (tf_adapter/README.md).
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
