"""The data, models and optimizers of the elastic test jobs, and the
single-process references they are checked against: one process applying
the same steps to whole batches. Torch and Keras are imported only by the
functions that need them, so each framework's env loads only its own."""
import numpy as np

FEATURES = 8
BATCH = 12  # a global batch: 12 samples split over 1, 2, 3 or 4 ranks
SAMPLES = 48  # four steps an epoch
STEPS = 24
LEARNING_RATE, MOMENTUM = 0.05, 0.9  # momentum: a restore that lost the optimizer's state would show


def _data():
    rng = np.random.RandomState(7)
    inputs = rng.normal(size=(SAMPLES, FEATURES)).astype(np.float32)
    targets = (inputs @ np.linspace(-1, 1, FEATURES, dtype=np.float32)[:, None]
               + 0.1 * rng.normal(size=(SAMPLES, 1)).astype(np.float32))
    return inputs, targets


_INPUTS, _TARGETS = _data()


def batch_of(step):
    start = (step * BATCH) % SAMPLES
    return _INPUTS[start:start + BATCH], _TARGETS[start:start + BATCH]


def make_torch_model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def make_torch_optimizer(model):
    import torch
    return torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)


def torch_reference(steps):
    """The torch job's parameters after `steps` steps (its loss sums over a
    global batch and divides by BATCH)."""
    import torch
    model = make_torch_model()
    optimizer = make_torch_optimizer(model)
    for step in range(steps):
        inputs, targets = (torch.from_numpy(a) for a in batch_of(step))
        optimizer.zero_grad()
        (((model(inputs) - targets) ** 2).sum() / BATCH).backward()
        optimizer.step()
    return {k: v.flatten().tolist() for k, v in model.state_dict().items()}


def make_keras_model(optimizer_wrapper=lambda o: o):
    import keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer_wrapper(keras.optimizers.SGD(learning_rate=LEARNING_RATE, momentum=MOMENTUM)),
                  loss="mse")
    return model


def keras_reference(steps):
    model = make_keras_model()
    for step in range(steps):
        model.train_on_batch(*batch_of(step))
    weights = model.get_weights()
    return {"weight": weights[0].flatten().tolist(), "bias": weights[1].flatten().tolist()}


def make_mxnet_model():
    import mxnet as mx
    mx.random.seed(0)
    net = mx.gluon.nn.Dense(1, in_units=FEATURES)
    net.initialize(mx.init.Normal(0.3))
    return net


def mxnet_reference(steps):
    import mxnet as mx
    net = make_mxnet_model()
    trainer = mx.gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": LEARNING_RATE, "momentum": MOMENTUM})
    for step in range(steps):
        inputs, targets = (mx.nd.array(a) for a in batch_of(step))
        with mx.autograd.record():
            loss = ((net(inputs) - targets) ** 2).sum()
        loss.backward()
        trainer.step(BATCH)
    return {"weight": net.weight.data().asnumpy().flatten().tolist(),
            "bias": net.bias.data().asnumpy().flatten().tolist()}
