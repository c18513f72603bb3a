"""The model, data and optimizer of the elastic torch tests, and the
single-process reference they are checked against."""
import torch

FEATURES = 8
BATCH = 12  # a global batch: 12 samples split over 2, 3 or 4 ranks
SAMPLES = 48  # four steps an epoch
STEPS = 24


def data():
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    targets = inputs @ torch.linspace(-1, 1, FEATURES).unsqueeze(1) + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    return inputs, targets


_INPUTS, _TARGETS = data()


def batch_of(step):
    start = (step * BATCH) % SAMPLES
    return _INPUTS[start:start + BATCH], _TARGETS[start:start + BATCH]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def make_optimizer(model):
    # Momentum, so that a restore that forgot the optimizer's state would show.
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def reference(steps):
    """The parameters after `steps` steps in one process, on whole batches."""
    model = make_model()
    optimizer = make_optimizer(model)
    for step in range(steps):
        inputs, targets = batch_of(step)
        optimizer.zero_grad()
        (((model(inputs) - targets) ** 2).sum() / BATCH).backward()
        optimizer.step()
    return {k: v.flatten().tolist() for k, v in model.state_dict().items()}
