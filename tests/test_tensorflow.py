"""unison.tensorflow jobs whose ranks go astray, under the launcher: inside
a tf.function (Keras's fit) the collectives run on TensorFlow's threads,
and a deadlock must still be told from a busy rank."""
import re
import subprocess
import sys
import textwrap

import pytest

from jobs import run_job

pytest.importorskip("tensorflow")

# Rank 0 takes a branch the others do not. Each rank's main thread has
# submitted eagerly first (the broadcast every TF2 script starts with),
# then waits inside TensorFlow for a graph whose collective is blocked.
BRANCH_IN_A_TF_FUNCTION = """
    import tensorflow as tf
    import unison.tensorflow as hvd
    hvd.init()
    r = hvd.rank()
    v = tf.Variable([float(r)])
    hvd.broadcast_variables([v], root_rank=0)

    @tf.function
    def step(x):
        y = hvd.allreduce(x, op=hvd.Sum, name="grad")
        if r == 0:   # a tf.cond branch: the collective's graph is an inner one
            return tf.cond(x[0] > 0, lambda: hvd.allreduce(y, op=hvd.Sum, name="metric"), lambda: y)
        return hvd.allreduce(y, op=hvd.Sum, name="loss")
    try:
        step(tf.ones(2))
    except tf.errors.OpError as e:
        print("rank %d: %s" % (r, e.message), flush=True)
"""

# Rank 0 averages a metric in a callback (eagerly, on the main thread) at
# the third batch; the others are already inside fit()'s traced step,
# waiting on the next batch's gradients.
BRANCH_IN_KERAS_FIT = """
    import keras
    import numpy as np
    import tensorflow as tf
    import unison.keras as hvd
    hvd.init()
    r = hvd.rank()

    class Metric(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if r == 0 and batch == 2:
                hvd.allreduce(tf.ones(1), name="metric")

    keras.utils.set_random_seed(r)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
    try:
        model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Metric()])
    except Exception as e:   # the callback raises unison's DeadlockError; fit's step a tf.errors.OpError
        print("rank %d: %s" % (r, getattr(e, "message", e)), flush=True)
"""

# The same parting inside hvd.elastic.run: the deadlock reaches the caller
# as unison.DeadlockError, and the job is not rolled back and replayed
# (it would only part again).
BRANCH_IN_ELASTIC_RUN = """
    import tensorflow as tf
    import unison
    import unison.tensorflow as hvd
    hvd.init()
    r = hvd.rank()
    state = hvd.elastic.TensorFlowState([tf.Variable([float(r)])], step=0)

    @tf.function
    def step(x):
        if r == 0:
            return hvd.allreduce(x, op=hvd.Sum, name="metric")
        return hvd.allreduce(x, op=hvd.Sum, name="loss")

    @hvd.elastic.run
    def train(state):
        return step(tf.ones(2))
    try:
        train(state)
    except unison.DeadlockError as e:
        print("rank %d: %s" % (r, e), flush=True)
"""

# The same parting in a TF1 graph run by a tf.compat.v1.Session, in a script
# that never runs eagerly. The main thread has submitted before (an object
# broadcast, as scripts agree on settings), then waits inside Session.run.
BRANCH_IN_A_SESSION = """
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    import unison.tensorflow as hvd
    hvd.init()
    r = hvd.rank()
    settings = hvd.broadcast_object({"lr": 0.1}, root_rank=0)
    x = tf.compat.v1.placeholder(tf.float32, [2])
    y = hvd.allreduce(x, op=hvd.Sum, name="grad")
    metric = hvd.allreduce(y, op=hvd.Sum, name="metric")
    loss = hvd.allreduce(y, op=hvd.Sum, name="loss")
    after = hvd.allreduce(tf.constant([r + 1.0]), op=hvd.Sum, name="after")
    with tf.compat.v1.Session() as session:
        try:
            session.run(metric if r == 0 else loss, feed_dict={x: [1.0, 1.0]})
        except tf.errors.OpError as e:
            print("rank %d: %s" % (r, e.message), flush=True)
        print("rank %d after: %s" % (r, session.run(after).tolist()), flush=True)
"""

# Ranks whose programs agree, but whose session has one inter-op thread and
# builds two independent collectives in another order on each rank: each
# rank's thread waits in the other's second node. The deadlock report says
# what the session needs.
SESSION_OUT_OF_THREADS = """
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    import unison.tensorflow as hvd
    hvd.init()
    r = hvd.rank()
    x = tf.constant([1.0, 2.0])
    built = {}
    for name in (["grad", "metric"] if r == 0 else ["metric", "grad"]):
        built[name] = hvd.allreduce(x, op=hvd.Sum, name=name)
    after = hvd.allreduce(tf.constant([r + 1.0]), op=hvd.Sum, name="after")
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1, use_per_session_threads=True)
    with tf.compat.v1.Session(config=config) as session:
        try:
            session.run([built["grad"], built["metric"]])
        except tf.errors.OpError as e:
            print("rank %d: %s" % (r, e.message), flush=True)
        print("rank %d after: %s" % (r, session.run(after).tolist()), flush=True)
"""

AFTERWARDS = """
    total = hvd.allreduce(tf.constant([r + 1.0]), op=hvd.Sum, name="after")
    print("rank %d after: %s" % (r, total.numpy().tolist()), flush=True)
"""


def launch(tmp_path, script, np_, warning_seconds):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    proc = run_job([sys.executable, "-m", "unison.run", "-np", str(np_), "--stall-check-warning-time-seconds",
                    str(warning_seconds), sys.executable, str(path)], 240, cwd=str(tmp_path),
                   stderr=subprocess.PIPE)
    return proc, proc.stdout.decode(), proc.stderr.decode()


def lines_of(out, rank):
    return "\n".join(line for line in out.splitlines() if line.startswith("[%d]<stdout>:" % rank))


@pytest.mark.parametrize("where", ["tf.function", "keras-fit", "elastic.run", "tf1-session"])
@pytest.mark.parametrize("np_", [2, 3])
def test_ranks_that_part_inside_a_traced_step_fail_as_a_deadlock_then_go_on(tmp_path, np_, where):
    # Before, a rank waiting inside a tf.function never looked blocked: the
    # TensorFlow thread that ran the collective, and the main thread (a
    # submitter since its eager broadcast) counted as busy, so the job
    # warned forever. Now every rank gets the deadlock report and the job's
    # collectives go on.
    script = {"tf.function": BRANCH_IN_A_TF_FUNCTION + AFTERWARDS, "keras-fit": BRANCH_IN_KERAS_FIT + AFTERWARDS,
              "elastic.run": BRANCH_IN_ELASTIC_RUN + AFTERWARDS, "tf1-session": BRANCH_IN_A_SESSION}[where]
    proc, out, err = launch(tmp_path, script, np_, 2)
    assert proc.returncode == 0, out + err
    for r in range(np_):
        mine = lines_of(out, r)
        assert ("rank %d: " % r) in mine and "unison: deadlock: every rank is blocked" in mine, out + err
        assert re.search(r"allreduce '\S*metric' waited \d+ s: submitted by ranks \[0\]", mine), out
        assert ("rank %d after: [%s]" % (r, float(np_ * (np_ + 1) // 2))) in out, out


@pytest.mark.parametrize("np_", [2, 3])
def test_a_tf1_session_out_of_threads_fails_as_a_deadlock_saying_so(tmp_path, np_):
    proc, out, err = launch(tmp_path, SESSION_OUT_OF_THREADS, np_, 2)
    assert proc.returncode == 0, out + err
    for r in range(np_):
        mine = lines_of(out, r)
        assert "unison: deadlock: every rank is blocked" in mine, out + err
        assert "each collective node holds one of the session's inter-op threads" in mine, out
        assert ("rank %d after: [%s]" % (r, float(np_ * (np_ + 1) // 2))) in out, out


# Rank 0's helper thread calls a tf.function that waits on 'a', which the
# others submit only after 'b'; rank 0's main thread is inside another
# tf.function (3.5 s of work) and then submits 'b'. Only the helper waits
# for the blocked node: a slow job, which must finish.
BUSY_IN_ANOTHER_TF_FUNCTION = """
    import threading, time
    import tensorflow as tf
    import unison.tensorflow as hvd
    hvd.init()
    r = hvd.rank()
    hvd.allreduce(tf.ones(1), name="w")

    @tf.function
    def waits(x):
        return hvd.allreduce(x, op=hvd.Sum, name="a")

    @tf.function
    def works(x):
        return tf.py_function(lambda t: (time.sleep(3.5), t)[1], [x], tf.float32)
    if r == 0:
        got = []
        helper = threading.Thread(target=lambda: got.append(waits(tf.ones(2))))
        helper.start()
        works(tf.ones(1))
        print("b", hvd.allreduce(tf.ones(2), op=hvd.Sum, name="b").numpy().tolist(), flush=True)
        helper.join()
        print("a", got[0].numpy().tolist(), flush=True)
    else:
        print("b", hvd.allreduce(tf.ones(2), op=hvd.Sum, name="b").numpy().tolist(), flush=True)
        print("a", hvd.allreduce(tf.ones(2), op=hvd.Sum, name="a").numpy().tolist(), flush=True)
"""


@pytest.mark.parametrize("np_", [2, 3])
def test_a_rank_busy_in_another_tf_function_is_not_a_deadlock(tmp_path, np_):
    proc, out, err = launch(tmp_path, BUSY_IN_ANOTHER_TF_FUNCTION, np_, 1)
    assert proc.returncode == 0, out + err
    assert "deadlock" not in out + err, out + err
    assert "some ranks have waited more than 1 s" in err, err
    for r in range(np_):
        for name in "ab":
            assert ("[%d]<stdout>:%s [%s, %s]" % (r, name, float(np_), float(np_))) in out, out
