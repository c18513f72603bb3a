"""unison.mxnet training: N ranks, each on its shard of the batch, end with
the parameters one process reaches on the whole batch (Gluon, and the
symbolic Module API); broadcast_parameters
reaches parameters whose initialisation Gluon defers to the first forward."""
import pytest

mx = pytest.importorskip("mxnet")
import numpy as np  # noqa: E402

import unison.mxnet as hvd  # noqa: E402

ROWS = 4
STEPS = 3


def make_net(seed=3):
    mx.random.seed(seed)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(8, activation="tanh", in_units=5), mx.gluon.nn.Dense(3, in_units=8))
    net.initialize(mx.init.Uniform(0.5))
    net.cast("float64")
    return net


def batch(step):
    rng = np.random.RandomState(100 + step)
    n = ROWS * hvd.size()
    return mx.nd.array(rng.randn(n, 5), dtype="float64"), mx.nd.array(rng.randn(n, 3), dtype="float64")


def train(net, trainer, shard, steps=STEPS):
    loss_fn = mx.gluon.loss.L2Loss()
    rows = slice(hvd.rank() * ROWS, (hvd.rank() + 1) * ROWS) if shard else slice(None)
    for step in range(steps):
        x, y = batch(step)
        with mx.autograd.record():
            loss = loss_fn(net(x[rows]), y[rows])
        loss.backward()
        trainer.step(x[rows].shape[0])


def params_of(net):
    return {k.split("_", 1)[-1]: v.data().asnumpy() for k, v in net.collect_params().items()}


def assert_same(a, b):
    # MXNet hands rescale_grad to its update kernels as a float32 attribute,
    # so a rescale of 1/12 (one process) and one of 1/4 (a shard) agree only
    # to float32 precision, even in float64 training.
    for (ka, va), (kb, vb) in zip(sorted(params_of(a).items()), sorted(params_of(b).items())):
        np.testing.assert_allclose(va, vb, rtol=1e-6, atol=1e-9, err_msg=ka)


def reference(optimizer, options):
    net = make_net()
    train(net, mx.gluon.Trainer(net.collect_params(), optimizer, dict(options), kvstore=None), shard=False)
    return net


OPTIMIZERS = [("sgd", {"learning_rate": 0.1, "momentum": 0.9}), ("adam", {"learning_rate": 0.01})]


@pytest.mark.parametrize("optimizer,options", OPTIMIZERS, ids=["sgd-momentum", "adam"])
@pytest.mark.parametrize("num_groups", [0, 2])
def test_distributed_trainer_matches_one_process(optimizer, options, num_groups):
    net = make_net()
    trainer = hvd.DistributedTrainer(net.collect_params(), optimizer, dict(options), num_groups=num_groups)
    train(net, trainer, shard=True)
    assert_same(net, reference(optimizer, options))


@pytest.mark.parametrize("factor", [2.0, "size"])
def test_gradient_predivide_factor(factor):
    factor = float(hvd.size()) if factor == "size" else factor
    net = make_net()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                     gradient_predivide_factor=factor)
    train(net, trainer, shard=True)
    assert_same(net, reference("sgd", {"learning_rate": 0.1}))


@pytest.mark.parametrize("optimizer,options", OPTIMIZERS, ids=["sgd-momentum", "adam"])
@pytest.mark.parametrize("num_groups,factor", [(0, 1.0), (1, 1.0), (0, 2.0)])
def test_distributed_optimizer_in_a_plain_trainer(optimizer, options, num_groups, factor):
    net = make_net()
    opt = hvd.DistributedOptimizer(mx.optimizer.create(optimizer, **options), num_groups=num_groups,
                                   gradient_predivide_factor=factor)
    trainer = mx.gluon.Trainer(net.collect_params(), opt, kvstore=None)
    train(net, trainer, shard=True)
    assert_same(net, reference(optimizer, options))
    opt.set_learning_rate(0.5)
    assert opt.learning_rate == 0.5 and opt._optimizer.learning_rate == 0.5


def train_module(optimizer, shard):
    """The symbolic Module API, as Horovod's MXNet ImageNet example's
    non-Gluon path: bind, initialise (each rank differently when sharded,
    then rank 0's parameters broadcast), and a forward_backward and
    update per step. Returns the final parameters."""
    data, label = mx.sym.var("data"), mx.sym.var("label")
    hidden = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=8, name="fc1"), act_type="tanh")
    net = mx.sym.LinearRegressionOutput(mx.sym.FullyConnected(hidden, num_hidden=3, name="fc2"), label)
    rows = slice(hvd.rank() * ROWS, (hvd.rank() + 1) * ROWS) if shard else slice(None)
    x, y = batch(0)
    module = mx.mod.Module(net, data_names=["data"], label_names=["label"], context=mx.cpu())
    module.bind(data_shapes=[("data", x[rows].shape)], label_shapes=[("label", y[rows].shape)])
    mx.random.seed(hvd.rank() if shard else 0)
    module.init_params(mx.init.Uniform(0.5))
    if shard:
        arg_params, aux_params = module.get_params()
        hvd.broadcast_parameters(arg_params, root_rank=0)
        module.set_params(arg_params, aux_params)
    module.init_optimizer(kvstore=None, optimizer=optimizer)
    for step in range(STEPS):
        x, y = batch(step)
        module.forward_backward(mx.io.DataBatch([x[rows].astype("float32")], [y[rows].astype("float32")]))
        module.update()
    return {k: v.asnumpy() for k, v in module.get_params()[0].items()}


# MXNet's Module warns of any rescale_grad but 1/batch; DistributedOptimizer's
# carries the 1/size of the average too, as Horovod's does.
@pytest.mark.filterwarnings("ignore:Optimizer created manually outside Module")
@pytest.mark.parametrize("optimizer,options", OPTIMIZERS, ids=["sgd-momentum", "adam"])
def test_distributed_optimizer_in_a_symbolic_module(optimizer, options):
    distributed = hvd.DistributedOptimizer(mx.optimizer.create(optimizer, rescale_grad=1.0 / ROWS, **options))
    got = train_module(distributed, shard=True)
    want = train_module(mx.optimizer.create(optimizer, rescale_grad=1.0 / (ROWS * hvd.size()), **options),
                        shard=False)
    assert sorted(got) == ["fc1_bias", "fc1_weight", "fc2_bias", "fc2_weight"]
    for name in sorted(got):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


class Doubling(hvd.Compression.none):
    """Sends twice each gradient and halves it back: exact in float64, and
    a new array, as fp16's is. Counts what it compressed."""
    calls = 0

    @classmethod
    def compress(cls, tensor):
        cls.calls += 1
        return tensor * 2, "halve"

    @staticmethod
    def decompress(tensor, ctx):
        assert ctx == "halve"
        return tensor / 2


def test_trainer_compression_in_horovods_argument_order():
    # Horovod's order puts compression fourth: passed by position here.
    net = make_net()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, Doubling)
    train(net, trainer, shard=True)
    assert_same(net, reference("sgd", {"learning_rate": 0.1}))
    assert Doubling.calls == STEPS * len(list(net.collect_params().keys()))


def test_trainer_refuses_a_number_where_compression_goes():
    net = make_net()
    with pytest.raises(TypeError, match=r"DistributedTrainer: compression must be a compressor.*float 2\.0"):
        hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, 2.0)


def test_trainer_fp16_compression_ends_near_one_process():
    net = make_net()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                     compression=hvd.Compression.fp16)
    train(net, trainer, shard=True)
    want = params_of(reference("sgd", {"learning_rate": 0.1}))
    exact = make_net()
    train(exact, hvd.DistributedTrainer(exact.collect_params(), "sgd", {"learning_rate": 0.1}, prefix="exact."),
          shard=True)
    for key, got in params_of(net).items():
        np.testing.assert_allclose(got, want[key], rtol=0, atol=2e-3, err_msg=key)  # float16's 11 bits
    assert any(not np.array_equal(got, params_of(exact)[key]) for key, got in params_of(net).items()), \
        "float16 compression left no trace: were the gradients sent as float16?"


def test_trainer_unwraps_a_distributed_optimizer_with_a_warning():
    net = make_net()
    opt = hvd.DistributedOptimizer(mx.optimizer.create("sgd", learning_rate=0.1))
    with pytest.warns(UserWarning, match="uses the optimizer inside it"):
        trainer = hvd.DistributedTrainer(net.collect_params(), opt)
    train(net, trainer, shard=True)
    assert_same(net, reference("sgd", {"learning_rate": 0.1}))


def test_two_trainers_apart_by_prefix():
    a, b = make_net(), make_net()
    ta = hvd.DistributedTrainer(a.collect_params(), "sgd", {"learning_rate": 0.1}, prefix="a.")
    tb = hvd.DistributedTrainer(b.collect_params(), "sgd", {"learning_rate": 0.1}, prefix="b.")
    loss_fn = mx.gluon.loss.L2Loss()
    rows = slice(hvd.rank() * ROWS, (hvd.rank() + 1) * ROWS)
    x, y = batch(0)
    for net in (a, b):
        with mx.autograd.record():
            loss = loss_fn(net(x[rows]), y[rows])
        loss.backward()
    ta.step(ROWS)
    tb.step(ROWS)
    want = make_net()
    train(want, mx.gluon.Trainer(want.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=None),
          shard=False, steps=1)
    assert_same(a, want)
    assert_same(b, want)


def test_broadcast_parameters_including_deferred_ones():
    mx.random.seed(hvd.rank())          # different on every rank on purpose
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(4), mx.gluon.nn.Dense(2, in_units=4))   # the first layer's input size is deferred
    net.initialize(mx.init.Uniform(1.0))
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)
    net(mx.nd.ones((2, 6)))              # the deferred weights appear, and are broadcast
    mine = {k: v.data().asnumpy() for k, v in params.items()}
    rank0 = hvd.broadcast_object(mine, root_rank=0)
    for k in mine:
        np.testing.assert_array_equal(mine[k], rank0[k])


def test_ranks_whose_gluon_names_differ_still_match_parameters():
    # Rank r first builds 9 x r throwaway layers, so its network's keys are
    # "dense9_weight", "dense10_weight", ... where rank 0 has "dense0_weight",
    # "dense1_weight" (and they sort in another order). Parameters are matched
    # by their place in the network, so broadcast and training still agree.
    for _ in range(9 * hvd.rank()):
        mx.gluon.nn.Dense(1)
    mx.random.seed(hvd.rank())
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(8, activation="tanh", in_units=5), mx.gluon.nn.Dense(3, in_units=8))
    net.initialize(mx.init.Uniform(0.5))
    net.cast("float64")
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix="renamed.")
    initial = [p.data().asnumpy() for p in net.collect_params().values()]
    train(net, hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, prefix="renamed."),
          shard=True)
    one = make_net()
    for p, value in zip(one.collect_params().values(), hvd.broadcast_object(initial, root_rank=0)):
        p.set_data(mx.nd.array(value, dtype="float64"))
    train(one, mx.gluon.Trainer(one.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=None), shard=False)
    for got, want in zip(net.collect_params().values(), one.collect_params().values()):
        np.testing.assert_allclose(got.data().asnumpy(), want.data().asnumpy(), rtol=1e-6, atol=1e-9)


def test_broadcast_parameters_of_a_dict_of_arrays():
    arrays = {"w": mx.nd.ones((2, 2)) * hvd.rank(), "b": mx.nd.ones(3) * (hvd.rank() + 5)}
    hvd.broadcast_parameters(arrays, root_rank=hvd.size() - 1)
    np.testing.assert_array_equal(arrays["w"].asnumpy(), np.full((2, 2), hvd.size() - 1))
    np.testing.assert_array_equal(arrays["b"].asnumpy(), np.full(3, hvd.size() + 4))
    with pytest.raises(ValueError, match="must be a dict or a ParameterDict"):
        hvd.broadcast_parameters([mx.nd.ones(1)])
