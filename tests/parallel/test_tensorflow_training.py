"""DistributedGradientTape and SyncBatchNormalization against one process:
N ranks on N shards end with the parameters of one process on the whole
batch. Float64, so the tolerance only absorbs summation order."""
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
import numpy as np  # noqa: E402

import unison  # noqa: E402
import unison.tensorflow as hvd  # noqa: E402

hvd.init()
N, RANK = hvd.size(), hvd.rank()
keras.backend.set_floatx("float64")
B, STEPS = 4, 5   # rows per rank per step, steps


def data(features=5, outputs=3, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.normal(size=(STEPS * N * B, features))
    y = rng.normal(size=(STEPS * N * B, outputs))
    return x, y


def shard(a, step):
    """This rank's rows of global step `step`: the global batch is the
    ranks' batches one after another."""
    start = step * N * B + RANK * B
    return a[start:start + B]


def whole(a, step):
    return a[step * N * B:(step + 1) * N * B]


def make_model(seed, layers=None):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(layers or [keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    model.build((None, 5))
    return model


def make_optimizer(kind):
    if kind == "sgd":
        return keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    return keras.optimizers.Adam(learning_rate=0.01)


def mse(model, x, y, training=True):
    return tf.reduce_mean(tf.square(model(x, training=training) - y))


def train_reference(initial, x, y, kind, layers=None):
    model = make_model(123, layers)
    model.set_weights(initial)
    optimizer = make_optimizer(kind)
    for step in range(STEPS):
        with tf.GradientTape() as tape:
            loss = mse(model, whole(x, step), whole(y, step))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return model


def assert_same_weights(model, reference, atol=1e-10):
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=atol, rtol=0)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("num_groups", [0, 2])
@pytest.mark.parametrize("predivide", [1.0, 2.0])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_gradient_tape_matches_one_process(kind, predivide, num_groups, mode):
    x, y = data()
    model = make_model(RANK)   # different on purpose: the broadcast aligns them
    hvd.broadcast_variables(model.variables, root_rank=0)
    initial = model.get_weights()
    optimizer = make_optimizer(kind)
    optimizer.build(model.trainable_variables)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = mse(model, xb, yb)
        tape = hvd.DistributedGradientTape(tape, gradient_predivide_factor=predivide, num_groups=num_groups)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    step = tf.function(step) if mode == "function" else step
    for s in range(STEPS):
        step(tf.constant(shard(x, s)), tf.constant(shard(y, s)))
    assert_same_weights(model, train_reference(initial, x, y, kind))


def uses_extra(step, rank):
    """Whether `rank`'s batch of `step` reaches the extra variable: at 2 and
    3 ranks some steps reach it on one rank, and some on none."""
    return (step + rank) % 3 == 0


def extra_variable(initial, holder):
    """A tf.Variable, or a Keras layer's kernel (a Keras 3 variable, whose
    dtype is a string)."""
    if holder == "tf.Variable":
        return tf.Variable(initial)
    layer = keras.layers.Dense(initial.shape[1], use_bias=False)
    layer.build((None, initial.shape[0]))
    layer.kernel.assign(initial)
    return layer.kernel


@pytest.mark.parametrize("holder", ["tf.Variable", "keras"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_variable_only_some_ranks_used_is_averaged_as_one_process_eagerly(kind, holder):
    """A Python branch takes the extra variable into some ranks' losses
    only: its gradient is None on the others. Averaged with zeros in their
    place it is what one process gets; where no rank used it, it is None,
    which the optimizer skips (Adam's moments and SGD's momentum would move
    a zero gradient's variable)."""
    x, y = data()
    rng = np.random.RandomState(7)
    extra_initial = rng.normal(size=(5, 3))

    def extra_loss(extra, xb, yb):
        return tf.reduce_mean(tf.square(tf.matmul(xb, extra) - yb))

    model = make_model(RANK)
    hvd.broadcast_variables(model.variables, root_rank=0)
    initial = model.get_weights()
    extra = extra_variable(extra_initial, holder)
    variables = model.trainable_variables + [extra]
    optimizer = make_optimizer(kind)
    for s in range(STEPS):
        xb, yb = tf.constant(shard(x, s)), tf.constant(shard(y, s))
        with tf.GradientTape() as tape:
            loss = mse(model, xb, yb)
            if uses_extra(s, RANK):
                loss += extra_loss(extra, xb, yb)
        grads = hvd.DistributedGradientTape(tape).gradient(loss, variables)
        assert (grads[-1] is None) == (not any(uses_extra(s, r) for r in range(N))), s
        optimizer.apply_gradients(zip(grads, variables))

    reference = make_model(123)
    reference.set_weights(initial)
    reference_extra = extra_variable(extra_initial, holder)
    reference_variables = reference.trainable_variables + [reference_extra]
    reference_optimizer = make_optimizer(kind)
    for s in range(STEPS):
        xs, ys = whole(x, s), whole(y, s)
        with tf.GradientTape() as tape:
            loss = mse(reference, xs, ys)
            for r in range(N):
                if uses_extra(s, r):
                    rows = slice(r * B, (r + 1) * B)
                    loss += extra_loss(reference_extra, xs[rows], ys[rows]) / N
        grads = tape.gradient(loss, reference_variables)
        reference_optimizer.apply_gradients(zip(grads, reference_variables))
    assert_same_weights(model, reference)
    np.testing.assert_allclose(extra.numpy(), reference_extra.numpy(), atol=1e-10, rtol=0)
    assert not np.array_equal(extra.numpy(), extra_initial)


def test_gradient_tape_with_listed_groups():
    """groups= as lists of variables: the listed ones in their own nodes,
    the rest together; the result is the same averaged gradients."""
    x, y = data()
    model = make_model(RANK)
    hvd.broadcast_variables(model.variables, root_rank=0)
    initial = model.get_weights()
    optimizer = make_optimizer("sgd")
    variables = model.trainable_variables
    for s in range(STEPS):
        with tf.GradientTape() as tape:
            loss = mse(model, shard(x, s), shard(y, s))
        tape = hvd.DistributedGradientTape(tape, groups=[[variables[0], variables[3]], [variables[1]]])
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    assert_same_weights(model, train_reference(initial, x, y, "sgd"))


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients_match_one_process(sparse_as_dense):
    rng = np.random.RandomState(1)
    ids = rng.randint(0, 10, size=(STEPS * N * B, 3))
    y = rng.normal(size=(STEPS * N * B, 1))

    def build(seed):
        keras.utils.set_random_seed(seed)
        embedding, dense = keras.layers.Embedding(10, 4), keras.layers.Dense(1)
        dense.build((None, 4))
        embedding.build((None, 3))
        return embedding, dense

    def loss_of(layers, xb, yb):
        embedding, dense = layers
        return tf.reduce_mean(tf.square(dense(tf.reduce_mean(embedding(xb), axis=1)) - yb))

    layers = build(RANK)
    variables = [v for layer in layers for v in layer.trainable_variables]
    hvd.broadcast_variables(variables, root_rank=0)
    reference = build(99)
    reference_variables = [v for layer in reference for v in layer.trainable_variables]
    for v, r in zip(variables, reference_variables):
        r.assign(v)
    optimizer, reference_optimizer = keras.optimizers.SGD(0.5), keras.optimizers.SGD(0.5)
    for s in range(STEPS):
        with tf.GradientTape() as tape:
            loss = loss_of(layers, shard(ids, s), shard(y, s))
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        grads = tape.gradient(loss, variables)
        assert isinstance(grads[0], tf.IndexedSlices) != sparse_as_dense
        optimizer.apply_gradients(zip(grads, variables))
        with tf.GradientTape() as tape:
            loss = loss_of(reference, whole(ids, s), whole(y, s))
        reference_optimizer.apply_gradients(zip(tape.gradient(loss, reference_variables), reference_variables))
    for v, r in zip(variables, reference_variables):
        np.testing.assert_allclose(v.numpy(), r.numpy(), atol=1e-10, rtol=0)


def test_gradient_tape_sum_and_fp16():
    v = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * (RANK + 1))
    grads = hvd.DistributedGradientTape(tape, op=hvd.Sum).gradient(loss, [v])
    np.testing.assert_array_equal(grads[0], [sum(range(1, N + 1))] * 2)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * (RANK + 1))
    grads = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16).gradient(loss, v)
    assert grads.dtype == v.dtype
    np.testing.assert_allclose(grads, [sum(range(1, N + 1)) / N] * 2, rtol=1e-3)


def test_mismatched_models_fail_on_every_rank():
    model = keras.Sequential([keras.layers.Dense(3 + RANK)])
    model.build((None, 2))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.ones([1, 2])))
    tape = hvd.DistributedGradientTape(tape)
    with pytest.raises(unison.MismatchError, match=r"DistributedGradientTape.*shape.*rank 0 \[2, 3\].*rank 1 \[2, 4\]"):
        tape.gradient(loss, model.trainable_variables)
    np.testing.assert_array_equal(hvd.allreduce(tf.ones([2]), op=hvd.Sum), [N, N])


# ---- SyncBatchNormalization ----------------------------------------------------------

def test_sync_batch_norm_forward_uneven_batches():
    rows = [r + 2 for r in range(N)]   # different batch sizes per rank
    rng = np.random.RandomState(3)
    everything = rng.normal(loc=5.0, size=(sum(rows), 4))
    start = sum(rows[:RANK])
    sync = hvd.SyncBatchNormalization(momentum=0.5)
    plain = keras.layers.BatchNormalization(momentum=0.5)
    out = sync(tf.constant(everything[start:start + rows[RANK]]), training=True)
    want = plain(tf.constant(everything), training=True)
    np.testing.assert_allclose(out, np.asarray(want)[start:start + rows[RANK]], atol=1e-10)
    np.testing.assert_allclose(sync.moving_mean, plain.moving_mean, atol=1e-12)
    np.testing.assert_allclose(sync.moving_variance, plain.moving_variance, atol=1e-12)
    np.testing.assert_allclose(sync(tf.constant(everything[:2]), training=False),
                               plain(tf.constant(everything[:2]), training=False), atol=1e-12)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_sync_batch_norm_training_matches_one_process(mode):
    x, y = data()

    def layers(sync):
        norm = hvd.SyncBatchNormalization if sync else keras.layers.BatchNormalization
        return [keras.layers.Dense(6), norm(momentum=0.8), keras.layers.Activation("tanh"), keras.layers.Dense(3)]
    model = make_model(RANK, layers(True))
    hvd.broadcast_variables(model.variables, root_rank=0)
    initial = model.get_weights()
    optimizer = make_optimizer("sgd")
    optimizer.build(model.trainable_variables)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = mse(model, xb, yb)
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    step = tf.function(step) if mode == "function" else step
    for s in range(STEPS):
        step(tf.constant(shard(x, s)), tf.constant(shard(y, s)))
    # get_weights() includes the moving statistics.
    assert_same_weights(model, train_reference(initial, x, y, "sgd", layers(False)))


@pytest.mark.parametrize("scale", [True, False])
def test_local_sources_keep_their_own_gradient(scale):
    """register_local_source and PartialDistributedGradientTape(local_layers):
    local variables keep this rank's gradient (divided by the size when
    scale_local_gradients), the others are averaged."""
    shared = tf.Variable([1.0, 1.0], dtype=tf.float64)
    mine = tf.Variable([1.0, 1.0], dtype=tf.float64)
    factor = float(RANK + 1)
    expected_local = [factor / N if scale else factor] * 2
    expected_shared = [np.mean([r + 1 for r in range(N)])] * 2
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(shared * factor) + tf.reduce_sum(mine * factor)
    tape = hvd.DistributedGradientTape(tape, scale_local_gradients=scale)
    tape.register_local_source(mine)
    g_shared, g_mine = tape.gradient(loss, [shared, mine])
    np.testing.assert_allclose(g_shared.numpy(), expected_shared, rtol=1e-12)
    np.testing.assert_allclose(g_mine.numpy(), expected_local, rtol=1e-12)

    layer = keras.layers.Dense(2, use_bias=False, kernel_initializer="ones", dtype="float64")
    layer.build((None, 2))
    x = tf.constant([[factor, 0.0]], dtype=tf.float64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(x)) + tf.reduce_sum(shared * factor)
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=layer, scale_local_gradients=scale)
    g_kernel, g_shared = tape.gradient(loss, [layer.kernel, shared])
    np.testing.assert_allclose(g_kernel.numpy(), [[expected_local[0]] * 2, [0.0, 0.0]], rtol=1e-12)
    np.testing.assert_allclose(g_shared.numpy(), expected_shared, rtol=1e-12)


def test_keras_partial_distributed_optimizer():
    from unison.tensorflow import keras as hvd_keras
    local = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", dtype="float64")
    local.build((None, 1))
    shared = keras.Variable(np.array([1.0]), dtype="float64")
    optimizer = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0), local_layers=[local])
    grad = float(RANK + 1)
    optimizer.apply_gradients([(tf.constant([[grad]], dtype=tf.float64), local.kernel),
                               (tf.constant([grad], dtype=tf.float64), shared)])
    np.testing.assert_allclose(np.asarray(local.kernel.numpy()), [[1.0 - grad / N]], rtol=1e-12)
    np.testing.assert_allclose(np.asarray(shared.numpy()), [1.0 - np.mean([r + 1 for r in range(N)])], rtol=1e-12)
    plain = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0))
    other = keras.Variable(np.array([0.0]), dtype="float64")
    plain.register_local_var(other)
    plain.apply_gradients([(tf.constant([grad], dtype=tf.float64), other)])
    np.testing.assert_allclose(np.asarray(other.numpy()), [-grad / N], rtol=1e-12)


# ---- hvd.DistributedOptimizer of unison.tensorflow: TF1-style optimizers --------

def legacy_weights(seed):
    rng = np.random.RandomState(seed)
    return [tf.Variable(rng.normal(size=shape)) for shape in [(5, 8), (8,), (8, 3), (3,)]]


def legacy_loss(weights, x, y):
    w1, b1, w2, b2 = weights
    return tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2) + b2 - y))


def make_legacy_optimizer(kind):
    if kind == "momentum":
        return tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
    return tf.compat.v1.train.AdamOptimizer(0.01)


def train_tf1_in_a_session(kind, passes, x, y):
    """The TF1 way, as Horovod's tensorflow_mnist.py: placeholders, minimize()
    in a graph, a MonitoredTrainingSession whose BroadcastGlobalVariablesHook
    aligns the ranks' different initial weights. Returns (the weights the
    session started from, the final weights, global_step, the optimizer)."""
    with tf.Graph().as_default():
        weights = legacy_weights(RANK)   # different on purpose: the hook aligns them
        xb = tf.compat.v1.placeholder(tf.float64, [None, x.shape[1]])
        yb = tf.compat.v1.placeholder(tf.float64, [None, y.shape[1]])
        optimizer = hvd.DistributedOptimizer(make_legacy_optimizer(kind), backward_passes_per_step=passes)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        train = optimizer.minimize(legacy_loss(weights, xb, yb), var_list=weights, global_step=global_step)
        last = Last(weights + [global_step])
        hooks = [hvd.BroadcastGlobalVariablesHook(0), tf.compat.v1.train.StopAtStepHook(last_step=STEPS), last]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as session:
            initial = session.run(weights)
            s = 0
            while not session.should_stop():
                session.run(train, feed_dict={xb: shard(x, s), yb: shard(y, s)})
                s += 1
    assert s == STEPS
    return initial, last.values[:-1], last.values[-1], optimizer


class Last(tf.compat.v1.train.SessionRunHook):
    """Reads `fetches` when the session ends."""

    def __init__(self, fetches):
        self.fetches = fetches

    def end(self, session):
        self.values = session.run(self.fetches)


@pytest.mark.parametrize("mode", ["eager", "function", "tf1-session"])
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_tf1_optimizer_matches_one_process(kind, passes, mode):
    """hvd.DistributedOptimizer around a tf.compat.v1.train optimizer: N ranks
    on N shards end where one process on the whole batch ends, eagerly, in
    a tf.function and in a TF1 session. With backward_passes_per_step=2 the
    reference applies, every second step, the sum of two whole-batch
    gradients taken at the same weights."""
    x, y = data()
    if mode == "tf1-session":
        initial, final, step, optimizer = train_tf1_in_a_session(kind, passes, x, y)
        np.testing.assert_array_equal(initial[0], legacy_weights(0)[0].numpy())
    else:
        weights = legacy_weights(RANK)   # different on purpose: the broadcast aligns them
        hvd.broadcast_variables(weights, root_rank=0)
        initial = [w.numpy() for w in weights]
        optimizer = hvd.DistributedOptimizer(make_legacy_optimizer(kind), backward_passes_per_step=passes)
        global_step = tf.Variable(0, dtype=tf.int64)

        def train(xb, yb):
            optimizer.minimize(lambda: legacy_loss(weights, xb, yb), var_list=weights, global_step=global_step)
        train = tf.function(train) if mode == "function" else train
        for s in range(STEPS):
            train(tf.constant(shard(x, s)), tf.constant(shard(y, s)))
        final, step = [w.numpy() for w in weights], global_step.numpy()
    assert isinstance(optimizer, tf.compat.v1.train.Optimizer)

    reference = [tf.Variable(w) for w in initial]
    plain = make_legacy_optimizer(kind)
    pending = None
    for s in range(STEPS):
        with tf.GradientTape() as tape:
            loss = legacy_loss(reference, whole(x, s), whole(y, s))
        grads = tape.gradient(loss, reference)
        pending = grads if pending is None else [p + g for p, g in zip(pending, grads)]
        if (s + 1) % passes == 0:
            plain.apply_gradients(zip(pending, reference))
            pending = None
    for got, want in zip(final, reference):
        np.testing.assert_allclose(got, want.numpy(), atol=1e-10, rtol=0)
    assert int(step) == STEPS   # every pass counts, applied or not
    assert optimizer.get_slot_names() == plain.get_slot_names()


def test_tf1_optimizer_compute_gradients_returns_the_average():
    """compute_gradients() itself gives the averaged gradients, so a script
    that clips them before apply_gradients() clips the average."""
    v = tf.Variable(np.array([1.0, 2.0]))
    optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0))
    [(grad, variable)] = optimizer.compute_gradients(lambda: tf.reduce_sum(v * float(RANK + 1)), var_list=[v])
    assert variable is v
    mean = np.mean([r + 1.0 for r in range(N)])
    np.testing.assert_allclose(grad.numpy(), [mean, mean], rtol=1e-12)


def test_distributed_optimizer_of_a_keras_optimizer_is_the_keras_one():
    """Horovod's hvd.DistributedOptimizer, given a Keras optimizer, returns
    the Keras DistributedOptimizer: an optimizer of the same class name."""
    variable = keras.Variable(np.array([1.0]), dtype="float64")
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0))
    assert isinstance(optimizer, keras.optimizers.SGD) and type(optimizer).__name__ == "SGD"
    optimizer.apply_gradients([(tf.constant([float(RANK + 1)], dtype=tf.float64), variable)])
    np.testing.assert_allclose(np.asarray(variable.numpy()), [1.0 - np.mean([r + 1 for r in range(N)])], rtol=1e-12)


def test_distributed_optimizer_refuses_what_it_cannot_wrap():
    with pytest.raises(ValueError, match="wraps a Keras optimizer or a tf.compat.v1.train.Optimizer; got str"):
        hvd.DistributedOptimizer("sgd")
    with pytest.raises(ValueError, match="backward_passes_per_step must be a whole number of at least 1, got 0"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0), backward_passes_per_step=0)
    with pytest.raises(TypeError, match=r"DistributedGradientTape: compression must be a compressor.*float 2\.0"):
        hvd.DistributedGradientTape(tf.GradientTape(), compression=2.0)
    v = tf.Variable([1.0])
    accumulating = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                            backward_passes_per_step=2)
    with pytest.raises(ValueError, match="call compute_gradients\\(\\) \\(or minimize\\(\\)\\) first"):
        accumulating.apply_gradients([(tf.constant([1.0]), v)])
    np.testing.assert_array_equal(v.numpy(), [1.0])
