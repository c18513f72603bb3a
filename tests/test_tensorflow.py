"""unison.tensorflow jobs whose ranks go astray, under the launcher: inside
a tf.function (Keras's fit) the collectives run on TensorFlow's threads,
and a deadlock must still be told from a busy rank."""
import json
import re
import subprocess
import sys
import textwrap

import pytest

from jobs import run_job

pytest.importorskip("tensorflow")

# Each job below runs several ways for ranks to part, one after another:
# every one must fail as a deadlock on every rank and leave the job's
# collectives working, which the next way then relies on. One job per rank
# count, not one per way, since each rank's TensorFlow import costs seconds.
# Each way's error is printed as one JSON line, so the checks read it whole.

# Three ways in eager scripts.
# - tf.function: rank 0 takes a branch the others do not. Each rank's main
#   thread has submitted eagerly first (the broadcast every TF2 script
#   starts with), then waits inside TensorFlow for a graph whose collective
#   is blocked; rank 0's is in a tf.cond branch, an inner graph.
# - keras-fit: rank 0 averages a metric in a callback (eagerly, on the main
#   thread) at the third batch; the others are already inside fit()'s traced
#   step, waiting on the next batch's gradients.
# - elastic.run: the first parting inside hvd.elastic.run. The deadlock
#   reaches the caller as unison.DeadlockError, and the job is not rolled
#   back and replayed (it would only part again).
PARTINGS_IN_EAGER_SCRIPTS = """
    import json
    import keras
    import numpy as np
    import tensorflow as tf
    import unison
    import unison.keras as hvd_keras
    import unison.tensorflow as hvd
    from unison.tensorflow import ops as tf_ops
    hvd.init()
    r = hvd.rank()

    def parted(where, error):
        message = getattr(error, "message", None) or str(error)
        print("rank %d %s: %s" % (r, where, json.dumps(message)), flush=True)
        total = hvd.allreduce(tf.constant([r + 1.0]), op=hvd.Sum, name=where + ".after")
        print("rank %d %s after: %s" % (r, where, total.numpy().tolist()), flush=True)

    v = tf.Variable([float(r)])
    hvd.broadcast_variables([v], root_rank=0)
    kernels = tf_ops._kernels
    for nodes in ("compiled", "py_function"):   # NODES
        tf_ops._kernels = kernels if nodes == "compiled" else None

        @tf.function
        def step(x):
            y = hvd.allreduce(x, op=hvd.Sum, name="grad")
            if r == 0:
                return tf.cond(x[0] > 0, lambda: hvd.allreduce(y, op=hvd.Sum, name="metric"), lambda: y)
            return hvd.allreduce(y, op=hvd.Sum, name="loss")
        try:
            step(tf.ones(2))
        except tf.errors.OpError as e:
            parted("tf.function/" + nodes, e)

        class Metric(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if r == 0 and batch == 2:
                    hvd_keras.allreduce(tf.ones(1), name="fit.metric")

        keras.utils.set_random_seed(r)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
        x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
        try:
            model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                      callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), Metric()])
        except Exception as e:   # the callback raises unison's DeadlockError; fit's step a tf.errors.OpError
            parted("keras-fit/" + nodes, e)

        state = hvd.elastic.TensorFlowState([tf.Variable([float(r)])], step=0)

        @tf.function
        def elastic_step(x):
            if r == 0:
                return hvd.allreduce(x, op=hvd.Sum, name="elastic.metric")
            return hvd.allreduce(x, op=hvd.Sum, name="elastic.loss")

        @hvd.elastic.run
        def train(state):
            return elastic_step(tf.ones(2))
        try:
            train(state)
        except unison.DeadlockError as e:
            parted("elastic.run/" + nodes, e)
"""

# Two ways in TF1 graphs run by tf.compat.v1.Session, in a script that never
# runs eagerly.
# - tf1-session: the parting in a graph. The main thread has submitted
#   before (an object broadcast, as scripts agree on settings), then waits
#   inside Session.run.
# - out-of-threads: ranks whose programs agree, but whose session has one
#   inter-op thread and builds two independent collectives in another order
#   on each rank. With tf.py_function nodes each rank's thread waits in the
#   other's second node, and the deadlock report says what the session
#   needs; the compiled kernels hold no thread while they wait, so there
#   the session completes.
PARTINGS_IN_SESSIONS = """
    import json
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    import unison.tensorflow as hvd
    from unison.tensorflow import ops as tf_ops
    hvd.init()
    r = hvd.rank()
    settings = hvd.broadcast_object({"lr": 0.1}, root_rank=0)

    def parted(where, error, session, after):
        print("rank %d %s: %s" % (r, where, json.dumps(error.message)), flush=True)
        print("rank %d %s after: %s" % (r, where, session.run(after).tolist()), flush=True)

    kernels = tf_ops._kernels
    for nodes in ("compiled", "py_function"):   # NODES
        tf_ops._kernels = kernels if nodes == "compiled" else None
        with tf.Graph().as_default():
            x = tf.compat.v1.placeholder(tf.float32, [2])
            y = hvd.allreduce(x, op=hvd.Sum, name="grad")
            metric = hvd.allreduce(y, op=hvd.Sum, name="metric")
            loss = hvd.allreduce(y, op=hvd.Sum, name="loss")
            after = hvd.allreduce(tf.constant([r + 1.0]), op=hvd.Sum, name="tf1-session.after." + nodes)
            with tf.compat.v1.Session() as session:
                try:
                    session.run(metric if r == 0 else loss, feed_dict={x: [1.0, 1.0]})
                except tf.errors.OpError as e:
                    parted("tf1-session/" + nodes, e, session, after)

        with tf.Graph().as_default():
            x = tf.constant([1.0, 2.0])
            built = {}
            for name in (["threads.grad", "threads.metric"] if r == 0 else ["threads.metric", "threads.grad"]):
                built[name] = hvd.allreduce(x, op=hvd.Sum, name=name)
            after = hvd.allreduce(tf.constant([r + 1.0]), op=hvd.Sum, name="out-of-threads.after." + nodes)
            config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1, use_per_session_threads=True)
            with tf.compat.v1.Session(config=config) as session:
                try:
                    values = session.run([built["threads.grad"], built["threads.metric"]])
                    print("rank %d out-of-threads/%s completed: %s" % (r, nodes, [v.tolist() for v in values]),
                          flush=True)
                except tf.errors.OpError as e:
                    parted("out-of-threads/" + nodes, e, session, after)
"""


# Each job runs its ways through the compiled kernels (tf_adapter/kernels.cc),
# which wait for no thread, then again through the tf.py_function nodes they
# fall back to (ops._kernels set aside while the graphs are built), which
# wait on TensorFlow's threads: the deadlock test must tell a deadlock from a
# busy rank either way. One job for both, since a launch costs each rank
# its TensorFlow import.
NODES = ["compiled", "py_function"]


def launch(tmp_path, script, np_, warning_seconds):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    proc = run_job([sys.executable, "-m", "unison.run", "-np", str(np_), "--stall-check-warning-time-seconds",
                    str(warning_seconds), sys.executable, str(path)], 240, cwd=str(tmp_path),
                   stderr=subprocess.PIPE)
    return proc, proc.stdout.decode(), proc.stderr.decode()


def parting_reports(out, rank, where):
    """What rank `rank` printed for the way `where`: the error's message and
    the collective after it."""
    prefix = "[%d]<stdout>:rank %d %s" % (rank, rank, where)
    errors = [json.loads(line[len(prefix) + 2:]) for line in out.splitlines() if line.startswith(prefix + ": ")]
    afters = [line[len(prefix) + len(" after: "):] for line in out.splitlines() if line.startswith(prefix + " after: ")]
    return errors, afters


@pytest.mark.parametrize("script,ways", [
    (PARTINGS_IN_EAGER_SCRIPTS, ["tf.function", "keras-fit", "elastic.run"]),
    (PARTINGS_IN_SESSIONS, ["tf1-session", "out-of-threads"])], ids=["eager", "tf1-session"])
@pytest.mark.parametrize("np_", [2, 3])
def test_ranks_that_part_inside_traced_steps_and_sessions_fail_as_a_deadlock_then_go_on(tmp_path, np_, script,
                                                                                          ways):
    # Before, a rank waiting inside a tf.function never looked blocked: the
    # TensorFlow thread that ran the collective, and the main thread (a
    # submitter since its eager broadcast) counted as busy, so the job
    # warned forever. Now every rank gets the deadlock report and the job's
    # collectives go on.
    proc, out, err = launch(tmp_path, script, np_, 1)
    assert proc.returncode == 0, out + err
    for where in ["%s/%s" % (way, nodes) for nodes in NODES for way in ways]:
        for r in range(np_):
            errors, afters = parting_reports(out, r, where)
            if where == "out-of-threads/compiled":
                assert errors == [] and afters == [], (where, out + err)
                assert "rank %d out-of-threads/compiled completed: [[%s, %s], [%s, %s]]" % (
                    r, float(np_), 2.0 * np_, float(np_), 2.0 * np_) in out, out + err
                continue
            assert len(errors) == 1 and "unison: deadlock: every rank is blocked" in errors[0], (where, out + err)
            if where == "out-of-threads/py_function":
                assert "each collective node holds one of the session's inter-op threads" in errors[0], out
            else:
                assert re.search(r"allreduce '\S*metric' waited \d+ s: submitted by ranks \[0\]", errors[0]), out
            assert afters == ["[%s]" % float(np_ * (np_ + 1) // 2)], (where, out)


# Rank 0's helper thread calls a tf.function that waits on 'a', which the
# others submit only after 'b'; rank 0's main thread is inside another
# tf.function (3.5 s of work) and then submits 'b'. Only the helper waits
# for the blocked node: a slow job, which must finish.
BUSY_IN_ANOTHER_TF_FUNCTION = """
    import threading, time
    import tensorflow as tf
    import unison.tensorflow as hvd
    from unison.tensorflow import ops as tf_ops
    hvd.init()
    r = hvd.rank()
    hvd.allreduce(tf.ones(1), name="w")
    kernels = tf_ops._kernels
    for nodes in ("compiled", "py_function"):   # NODES
        tf_ops._kernels = kernels if nodes == "compiled" else None
        a, b = "a/" + nodes, "b/" + nodes

        @tf.function
        def waits(x):
            return hvd.allreduce(x, op=hvd.Sum, name=a)

        @tf.function
        def works(x):
            return tf.py_function(lambda t: (time.sleep(3.5), t)[1], [x], tf.float32)
        if r == 0:
            got = []
            helper = threading.Thread(target=lambda: got.append(waits(tf.ones(2))))
            helper.start()
            works(tf.ones(1))
            print(b, hvd.allreduce(tf.ones(2), op=hvd.Sum, name=b).numpy().tolist(), flush=True)
            helper.join()
            print(a, got[0].numpy().tolist(), flush=True)
        else:
            print(b, hvd.allreduce(tf.ones(2), op=hvd.Sum, name=b).numpy().tolist(), flush=True)
            print(a, hvd.allreduce(tf.ones(2), op=hvd.Sum, name=a).numpy().tolist(), flush=True)
"""


@pytest.mark.parametrize("np_", [2, 3])
def test_a_rank_busy_in_another_tf_function_is_not_a_deadlock(tmp_path, np_):
    proc, out, err = launch(tmp_path, BUSY_IN_ANOTHER_TF_FUNCTION, np_, 1)
    assert proc.returncode == 0, out + err
    assert "deadlock" not in out + err, out + err
    assert "some ranks have waited more than 1 s" in err, err
    for r in range(np_):
        for name in ("%s/%s" % (op, nodes) for op in "ab" for nodes in NODES):
            assert ("[%d]<stdout>:%s [%s, %s]" % (r, name, float(np_), float(np_))) in out, out
