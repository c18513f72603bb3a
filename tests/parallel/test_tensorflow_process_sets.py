"""unison.tensorflow and unison.keras with process sets: the collectives,
eagerly and inside tf.function, DistributedGradientTape, the Keras
DistributedOptimizer, SyncBatchNormalization and broadcast_variables, each
among the ranks of one half of the job (the `half` fixture, conftest.py). tests/test_parallel.py runs this at
2, 3 and 4 ranks."""
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
import numpy as np  # noqa: E402

import unison  # noqa: E402
import unison.tensorflow as hvd  # noqa: E402
import unison.tensorflow.keras as hvd_keras  # noqa: E402




@pytest.mark.parametrize("mode", ["eager", "function"])
def test_collectives_in_a_set(half, mode):
    me = hvd.rank()

    def run():
        total = hvd.allreduce(tf.fill([3], float(me)), op=hvd.Sum, name="tps.ar", process_set=half)
        gathered = hvd.allgather(tf.fill([me + 1], me), name="tps.ag", process_set=half)
        root = hvd.broadcast(tf.constant([me, me]), root_rank=half.ranks[-1], name="tps.bc", process_set=half)
        received, splits = hvd.alltoall(tf.range(half.size()) + 10 * me, splits=[1] * half.size(),
                                        name="tps.a2a", process_set=half)
        part = hvd.reducescatter(tf.ones([2 * half.size()]), op=hvd.Sum, name="tps.rs", process_set=half)
        return total, gathered, root, received, splits, part

    total, gathered, root, received, splits, part = tf.function(run)() if mode == "function" else run()
    assert total.numpy().tolist() == [float(sum(half.ranks))] * 3
    assert gathered.numpy().tolist() == [r for r in half.ranks for _ in range(r + 1)]
    assert root.numpy().tolist() == [half.ranks[-1]] * 2
    assert received.numpy().tolist() == [10 * r + half.rank() for r in half.ranks]
    assert splits.numpy().tolist() == [1] * half.size()
    assert part.numpy().tolist() == [float(half.size())] * 2
    assert hvd.broadcast_object(me, root_rank=half.ranks[0], process_set=half) == half.ranks[0]
    assert hvd.allgather_object(me, process_set=half) == half.ranks
    hvd.barrier(process_set=half)


def test_gradient_tape_averages_over_the_set(half):
    w = tf.Variable([1.0, 2.0], dtype=tf.float64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * float(hvd.rank() + 1))
    tape = hvd.DistributedGradientTape(tape, process_set=half)
    grad = tape.gradient(loss, w)
    expected = np.mean([r + 1 for r in half.ranks])
    np.testing.assert_allclose(grad.numpy(), [expected, expected], rtol=0, atol=1e-12)


def test_keras_optimizer_step_uses_the_set_average(half):
    w = keras.Variable(np.array([1.0, -1.0]), dtype="float64")
    optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.5), process_set=half)
    grad = tf.constant([float(hvd.rank()), 2.0 * hvd.rank()], dtype=tf.float64)
    optimizer.apply_gradients([(grad, w)])
    mean = np.mean(half.ranks)
    np.testing.assert_allclose(np.asarray(w.numpy()), [1.0 - 0.5 * mean, -1.0 - 0.5 * 2 * mean], rtol=0, atol=1e-12)


def test_a_tape_and_an_optimizer_of_a_set_keep_their_own_gradients_outside_it(half):
    """As in Horovod, a script builds one tape or optimizer of a set on
    every rank and steps it everywhere: the set's ranks average over it, a
    rank outside it keeps its own gradient, as a plain tape or optimizer."""
    for chosen in [s for s in unison.process_sets._registered.values() if s.ranks is not None]:
        own = [float(hvd.rank() + 1), 2.0 * (hvd.rank() + 1)]
        if chosen.included():
            expected = [np.mean([r + 1 for r in chosen.ranks]), np.mean([2.0 * (r + 1) for r in chosen.ranks])]
        else:
            expected = own
        w = tf.Variable([1.0, 2.0], dtype=tf.float64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * tf.constant(own, dtype=tf.float64))
        grad = hvd.DistributedGradientTape(tape, process_set=chosen).gradient(loss, w)
        np.testing.assert_allclose(grad.numpy(), expected, rtol=0, atol=1e-12)
        v = keras.Variable(np.array([1.0, -1.0]), dtype="float64")
        optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.5), process_set=chosen)
        optimizer.apply_gradients([(tf.constant(own, dtype=tf.float64), v)])
        np.testing.assert_allclose(np.asarray(v.numpy()), [1.0 - 0.5 * expected[0], -1.0 - 0.5 * expected[1]],
                                   rtol=0, atol=1e-12)
        # A tf.compat.v1 optimizer, wrapped by unison.tensorflow's own DistributedOptimizer.
        u = tf.Variable([1.0, 2.0], dtype=tf.float64)
        legacy = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5), process_set=chosen)
        pairs = legacy.compute_gradients(lambda: tf.reduce_sum(u * tf.constant(own, dtype=tf.float64)), [u])
        np.testing.assert_allclose(pairs[0][0].numpy(), expected, rtol=0, atol=1e-12)


def test_sync_batch_norm_uses_the_set_statistics(half):
    rows = 3
    rng = np.random.RandomState(7 + half.process_set_id)
    whole = rng.normal(size=(rows * half.size(), 4)) * 2 + half.process_set_id
    me = half.rank()
    layer = hvd.SyncBatchNormalization(process_set=half, dtype="float64")
    out = layer(tf.constant(whole[me * rows:(me + 1) * rows]), training=True)
    expected = (whole - whole.mean(0)) / np.sqrt(whole.var(0) + layer.epsilon)
    np.testing.assert_allclose(out.numpy(), expected[me * rows:(me + 1) * rows], rtol=1e-9, atol=1e-9)


def test_broadcast_variables_in_a_set(half):
    v = tf.Variable([float(hvd.rank())] * 3)
    hvd.broadcast_variables([v], root_rank=half.ranks[0], process_set=half)
    assert v.numpy().tolist() == [float(half.ranks[0])] * 3


def test_ranks_outside_a_set_are_refused(half):
    for other in [s for s in unison.process_sets._registered.values() if s.ranks is not None and not s.included()]:
        message = "rank %d is not in process set %d" % (hvd.rank(), other.process_set_id)
        with pytest.raises(ValueError, match=message):
            hvd.allreduce(tf.ones([2]), name="tps.outsider", process_set=other)
        with pytest.raises(ValueError, match=message):
            hvd.SyncBatchNormalization(process_set=other)
