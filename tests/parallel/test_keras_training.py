"""Keras 3 model.fit with unison.keras from one rank's point of view: the
DistributedOptimizer and the broadcast callback end every rank on the
parameters of one process trained on the whole batch; the callbacks do
what Horovod's do."""
import os
import warnings

import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
import numpy as np  # noqa: E402

import unison  # noqa: E402
import unison.keras as hvd  # noqa: E402
import unison.tensorflow.keras  # noqa: E402,F401  (Horovod's other import path)
from unison.tensorflow import ops as tf_ops  # noqa: E402

hvd.init()
N, RANK = hvd.size(), hvd.rank()
keras.backend.set_floatx("float64")
B, STEPS, EPOCHS = 4, 3, 2


def data(seed=0):
    rng = np.random.RandomState(seed)
    return rng.normal(size=(STEPS * N * B, 5)), rng.normal(size=(STEPS * N * B, 3))


def local(a, passes=1):
    """This rank's rows, in the order fit() takes them with batch B: the
    global batch of each update is every rank's next `passes` batches."""
    group = passes * N * B
    rows = [a[s * group + (RANK * passes + p) * B:s * group + (RANK * passes + p + 1) * B]
            for s in range(len(a) // group) for p in range(passes)]
    return np.concatenate(rows)


def make_model(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    return model


def reference_fit(initial, x, y, optimizer, batch_size, epochs=EPOCHS):
    model = make_model(321)
    model.set_weights(initial)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


def rank0_initial_weights(model):
    return hvd.broadcast_object(model.get_weights(), root_rank=0)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_fit_matches_one_process(kind):
    x, y = data()
    make = {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9), "adam": lambda: keras.optimizers.Adam(0.01)}[kind]
    model = make_model(RANK)   # different on purpose: the callback aligns them
    initial = rank0_initial_weights(model)
    optimizer = hvd.DistributedOptimizer(make())
    assert isinstance(optimizer, type(make())) and type(optimizer).__name__ == type(make()).__name__
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(local(x), local(y), batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    reference = reference_fit(initial, x, y, make(), N * B)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-10, rtol=0)
    assert int(optimizer.iterations) == EPOCHS * STEPS


def test_fit_compiled_with_xla_lowers_the_optimizers_allreduce_and_matches_one_process():
    # Keras 3's default jit_compile='auto' is True wherever a GPU is visible;
    # asked for here, on the CPU, XLA compiles the train step with the
    # optimizer's allreduce inside it (tf_adapter/kernels_xla.cc).
    x, y = data(9)
    model = make_model(RANK)
    initial = rank0_initial_weights(model)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse",
                  jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(local(x), local(y), batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert model.jit_compile and not [w for w in caught if "without XLA" in str(w.message)]
    reference = reference_fit(initial, x, y, keras.optimizers.SGD(0.1, momentum=0.9), N * B)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-10, rtol=0)


def test_fit_compiled_with_xla_without_the_lowering_trains_without_it_and_matches_one_process(monkeypatch):
    # Where allreduce cannot lower to XLA (here: the compiled kernels are
    # not in use, as where no compiler is found), the callback turns XLA
    # off, saying why, as Keras does for a layer XLA cannot compile.
    monkeypatch.setattr(tf_ops, "_kernels", None)
    x, y = data(12)
    model = make_model(RANK)
    initial = rank0_initial_weights(model)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse",
                  jit_compile=True)
    with pytest.warns(UserWarning, match=r"model '%s' trains without XLA \(jit_compile=False\): its "
                                         r"DistributedOptimizer's collectives cannot be compiled into the train step, "
                                         r"as allreduce lowers to XLA through unison's compiled kernels" % model.name):
        model.fit(local(x), local(y), batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert not model.jit_compile
    reference = reference_fit(initial, x, y, keras.optimizers.SGD(0.1, momentum=0.9), N * B)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-10, rtol=0)


def test_fit_compiled_with_xla_without_the_lowering_or_a_unison_callback_fails_on_every_rank_naming_the_fix(
        monkeypatch):
    monkeypatch.setattr(tf_ops, "_kernels", None)
    x, y = data(10)
    model = make_model(0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    with pytest.raises(unison.UnsupportedError, match=r"allreduce of 'DistributedOptimizer\.0\|.*compiled with "
                                                      r"XLA.*model\.compile\(\.\.\., jit_compile=False\)"):
        model.fit(local(x), local(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    # Refused while tracing, before any rank enqueued anything: the fix works.
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=False)
    model.fit(local(x), local(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    root = hvd.broadcast_object(model.get_weights(), root_rank=0)
    for got, want in zip(model.get_weights(), root):
        np.testing.assert_array_equal(got, want)


def test_load_model_of_a_model_compiled_with_xla_trains_with_it(tmp_path):
    x, y = data(11)
    model = make_model(0)
    initial = model.get_weights()
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse", jit_compile=True)
    path = os.path.join(str(tmp_path), "xla%d.keras" % RANK)
    model.save(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = hvd.load_model(path)
    assert loaded.jit_compile and not [w for w in caught if "without XLA" in str(w.message)]
    loaded.fit(local(x), local(y), batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0)
    reference = reference_fit(initial, x, y, keras.optimizers.SGD(0.1, momentum=0.9), N * B)
    for got, want in zip(loaded.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("wrapped_by", ["compile", "user"])
def test_a_loss_scale_optimizer_around_the_distributed_one_skips_the_same_steps_as_one_process(wrapped_by):
    # Under a mixed_float16 policy Keras's compile wraps the optimizer in a
    # LossScaleOptimizer ("compile"), or the user does, in Keras 2's order
    # ("user"). It skips a step whose gradients are not finite, looking at
    # them before the wrapped optimizer reduces them. Rank 0's rows of the
    # second batch overflow float16 while the other ranks' do not: one
    # process on the whole batch skips that step, and so must every rank.
    # Before, rank 0 alone skipped it, and the others waited in that step's
    # allreduce until this test's timeout.
    x, y = data(12)
    x[N * B:N * B + B] *= 1e4
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        def model_and_weights():
            keras.utils.set_random_seed(5)
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), keras.layers.Dense(3)])
            return model, model.get_weights()
        model, initial = model_and_weights()
        optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01))
        if wrapped_by == "user":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        model.compile(optimizer=optimizer, loss="mse")
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        model.fit(local(x), local(y), batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0)
        reference, _ = model_and_weights()
        reference.set_weights(initial)
        reference.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        reference.fit(x, y, batch_size=N * B, epochs=EPOCHS, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float64")
    assert int(reference.optimizer.iterations) < EPOCHS * STEPS, "the reference skipped no step: nothing shown"
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations)
    assert float(model.optimizer.dynamic_scale) == float(reference.optimizer.dynamic_scale)
    root = hvd.broadcast_object(model.get_weights(), root_rank=0)
    for got, want in zip(model.get_weights(), root):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)


def test_backward_passes_per_step():
    x, y = data(1)
    model = make_model(RANK)
    initial = rank0_initial_weights(model)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5), backward_passes_per_step=3,
                                         average_aggregated_gradients=True)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(local(x, passes=3), local(y, passes=3), batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    # One update per three local batches, from the mean gradient of the
    # 3 x N batches: one process with a batch 3 x N times as large.
    reference = reference_fit(initial, x, y, keras.optimizers.SGD(0.1, momentum=0.5), 3 * N * B)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-10, rtol=0)
    assert int(optimizer.iterations) == EPOCHS * STEPS // 3


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs, self.batch_lrs = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.batch_lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))


def test_metric_average_callback():
    x, y = data(2)
    x = x + RANK   # ranks see different data, so their losses differ
    model = make_model(0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse", metrics=["mae"])
    before, after = Recorder(), Recorder()
    history = model.fit(local(x), local(y), batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[before, hvd.callbacks.MetricAverageCallback(), after])
    for epoch in range(EPOCHS):
        for key in ("loss", "mae"):
            everyone = hvd.allgather_object(before.epochs[epoch][key])
            assert len(set(everyone)) == N   # really different per rank
            assert after.epochs[epoch][key] == pytest.approx(np.mean(everyone), rel=1e-12)
            assert history.history[key][epoch] == pytest.approx(np.mean(everyone), rel=1e-12)


def test_learning_rate_warmup():
    x, y = data(3)
    model = make_model(0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.5)), loss="mse")
    recorder = Recorder()
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2)
    model.fit(local(x), local(y), batch_size=B, epochs=3, shuffle=False, verbose=0, callbacks=[warmup, recorder])
    want = [0.4 / N * ((e + b / STEPS) * (N - 1) / 2 + 1) for e in range(2) for b in range(STEPS)] + [0.4] * STEPS
    np.testing.assert_allclose(recorder.batch_lrs, want, rtol=1e-6)


def test_learning_rate_schedule_with_momentum_correction():
    x, y = data(4)
    model = make_model(0)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.2, momentum=0.9))
    model.compile(optimizer=optimizer, loss="mse")
    velocities = {}

    class Velocity(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            velocities[("end", epoch)] = [v.numpy().copy() for v in getattr(optimizer, "momentums", [])]

        def on_epoch_begin(self, epoch, logs=None):
            velocities[("begin", epoch)] = [v.numpy().copy() for v in getattr(optimizer, "momentums", [])]
    recorder = Recorder()
    schedule = hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.2, multiplier=lambda epoch: 0.5 ** epoch,
                                                          start_epoch=1, end_epoch=3)
    model.fit(local(x), local(y), batch_size=B, epochs=4, shuffle=False, verbose=0,
              callbacks=[schedule, Velocity(), recorder])
    np.testing.assert_allclose(recorder.batch_lrs, [0.2] * STEPS + [0.1] * STEPS + [0.05] * 2 * STEPS, rtol=1e-6)
    # Each change of rate scales the accumulated velocity by new / old.
    assert len(velocities[("end", 0)]) == 4
    for before, after in zip(velocities[("end", 0)], velocities[("begin", 1)]):
        np.testing.assert_allclose(after, 0.5 * before, rtol=1e-6)
    for before, after in zip(velocities[("end", 2)], velocities[("begin", 3)]):
        np.testing.assert_allclose(after, before, rtol=0)


def test_best_model_checkpoint_written_by_rank_zero_only(tmp_path):
    x, y = data(5)
    path = os.path.join(str(tmp_path), "best.keras")
    model = make_model(0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    model.fit(local(x), local(y), batch_size=B, epochs=2, verbose=0, validation_data=(x[:4], y[:4]),
              callbacks=[hvd.callbacks.MetricAverageCallback(), hvd.callbacks.BestModelCheckpoint("val_loss", filepath=path)])
    assert os.path.exists(path) == (RANK == 0)


class CustomSGD(keras.optimizers.SGD):
    """A user's own optimizer class, which a saved model names by class."""


@pytest.mark.parametrize("kind", ["builtin", "custom"])
def test_load_model_resumes_with_a_distributed_optimizer(tmp_path, kind):
    # One epoch, saved by every rank to its own file; load_model(); one more
    # epoch. Each rank fits its own shard, so ending on one process's two
    # epochs over the whole batch needs both the averaging and the saved
    # momenta to have come back.
    x, y = data(6)
    make = {"builtin": keras.optimizers.SGD, "custom": CustomSGD}[kind]
    model = make_model(0)
    initial = model.get_weights()
    model.compile(optimizer=hvd.DistributedOptimizer(make(0.1, momentum=0.9)), loss="mse")
    model.fit(local(x), local(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(str(tmp_path), "rank%d.keras" % RANK)
    model.save(path)
    loaded = hvd.load_model(path, custom_optimizers=[CustomSGD] if kind == "custom" else None)
    optimizer = loaded.optimizer
    assert type(optimizer).__name__ == make.__name__ and isinstance(optimizer, make)
    assert hasattr(optimizer, "_unison_reducer"), "load_model's optimizer is not a DistributedOptimizer"
    assert int(optimizer.iterations) == STEPS
    loaded.fit(local(x), local(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    reference = reference_fit(initial, x, y, keras.optimizers.SGD(0.1, momentum=0.9), N * B, epochs=2)
    for got, want in zip(loaded.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-10, rtol=0)
    assert int(optimizer.iterations) == 2 * STEPS


def test_resume_as_horovods_examples_do_rank_zero_loads_the_rest_receive(tmp_path):
    # Horovod's Keras examples resume so: rank 0 loads the checkpoint with
    # load_model, the others build a fresh model, and the broadcast callback
    # hands them rank 0's weights, momenta and step count.
    x, y = data(7)
    model = make_model(0)
    initial = model.get_weights()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    model.fit(local(x), local(y), batch_size=B, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(str(tmp_path), "rank%d.keras" % RANK)
    model.save(path)
    if RANK == 0:
        resumed = hvd.load_model(path)
    else:
        resumed = make_model(RANK + 50)   # anything: the callback replaces it
        resumed.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    resumed.fit(local(x), local(y), batch_size=B, epochs=2, initial_epoch=1, shuffle=False, verbose=0,
                callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    reference = reference_fit(initial, x, y, keras.optimizers.SGD(0.1, momentum=0.9), N * B, epochs=2)
    for got, want in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-10, rtol=0)
    assert int(resumed.optimizer.iterations) == 2 * STEPS


def test_load_model_of_an_uncompiled_model_has_no_optimizer(tmp_path):
    path = os.path.join(str(tmp_path), "rank%d.keras" % RANK)
    make_model(0).save(path)
    loaded = hvd.load_model(path)
    assert getattr(loaded, "optimizer", None) is None
    np.testing.assert_array_equal(loaded.get_weights()[0], make_model(0).get_weights()[0])


def test_mismatched_models_fail_fit_on_every_rank():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3 + RANK)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = np.ones((B, 5)), np.ones((B, 3 + RANK))
    with pytest.raises(tf.errors.OpError, match=r"MismatchError.*DistributedOptimizer.*shape.*rank 0 \[5, 3\]"):
        model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    np.testing.assert_array_equal(hvd.allreduce(tf.ones([2]), op=hvd.Sum), [N, N])


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_model_built_by_its_first_batch_ends_alike_on_every_rank(kind):
    """A Sequential without an Input has no weights until fit() has run its
    first batch: the callback sets root_rank's after that batch, as
    Horovod's does, so the ranks still end on the same weights."""
    x, y = data()
    keras.utils.set_random_seed(RANK)   # every rank draws other initial weights
    model = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    make = {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9), "adam": lambda: keras.optimizers.Adam(0.01)}[kind]
    model.compile(optimizer=hvd.DistributedOptimizer(make()), loss="mse")
    model.fit(local(x), local(y), batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    mine = model.get_weights() + [v.numpy() for v in model.optimizer.variables]
    root = hvd.broadcast_object(mine, root_rank=0)
    assert len(mine) == len(root)
    for got, want in zip(mine, root):
        np.testing.assert_array_equal(got, want)


def test_broadcast_callback_leaves_local_variables_alone():
    model = make_model(RANK)
    mine = model.layers[0].bias
    mine.assign(tf.fill(mine.shape, float(RANK)))
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[mine])
    callback.set_model(model)
    callback.on_train_batch_begin(0)
    np.testing.assert_array_equal(mine.numpy(), np.full(mine.shape, float(RANK)))
    root_kernel = hvd.broadcast_object(model.layers[0].kernel.numpy(), root_rank=0, name="check.kernel")
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), root_kernel)


def test_keras_on_another_backend_is_refused_at_import_naming_the_setting(monkeypatch):
    import importlib
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(ImportError, match="TensorFlow backend, but Keras is using 'jax' \\(KERAS_BACKEND='jax'\\)"):
        importlib.reload(unison.tensorflow.keras)
    monkeypatch.undo()
    importlib.reload(unison.tensorflow.keras)

