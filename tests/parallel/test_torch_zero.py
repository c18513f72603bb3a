"""ZeroRedundancyOptimizer: N ranks, each training on its shard of the
batch with the optimizer state sharded, end with the same parameters (and,
consolidated, the same optimizer state) as one process with the plain
optimizer on the whole batch; checkpoints move between the two."""
import io

import pytest

torch = pytest.importorskip("torch")
import unison.torch as hvd  # noqa: E402

torch.set_num_threads(1)
ROWS = 3


def make_model(widths=(6, 8, 8, 3), seed=5):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).double()


def data(step, model):
    g = torch.Generator().manual_seed(200 + step)
    n = ROWS * hvd.size()
    return (torch.randn(n, model[0].in_features, generator=g, dtype=torch.float64),
            torch.randn(n, model[-1].out_features, generator=g, dtype=torch.float64))


def train(model, optimizer, steps, shard, first_step=0):
    mine = slice(hvd.rank() * ROWS, (hvd.rank() + 1) * ROWS) if shard else slice(None)
    for step in range(first_step, first_step + steps):
        x, y = data(step, model)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        optimizer.step()


def saved_and_loaded(checkpoint):
    """`checkpoint` as torch.load gives it back from a file: no tensor shared."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def groups(model, split):
    params = list(model.parameters())
    if not split:
        return params
    return [{"params": params[:2]}, {"params": params[2:], "lr": 0.003}]


OPTIMIZERS = {
    "sgd-momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "adam": (torch.optim.Adam, dict(lr=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5)),
}


def assert_same_params(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-12)


def assert_same_state(a, b):
    assert sorted(a["state"]) == sorted(b["state"])
    for index, state in a["state"].items():
        assert sorted(state) == sorted(b["state"][index])
        for key, value in state.items():
            torch.testing.assert_close(torch.as_tensor(value), torch.as_tensor(b["state"][index][key]),
                                       rtol=0, atol=1e-12)
    assert a["param_groups"] == b["param_groups"]


@pytest.mark.parametrize("split", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_matches_single_process_and_its_state(name, split):
    cls, options = OPTIMIZERS[name]
    reference = make_model()
    plain = cls(groups(reference, split), **options)
    train(reference, plain, 4, shard=False)

    model = make_model()
    zero = hvd.ZeroRedundancyOptimizer(groups(model, split), cls, **options)
    train(model, zero, 4, shard=True)
    assert_same_params(model, reference)

    zero.consolidate_state_dict(to=0)
    if hvd.rank() == 0:
        assert_same_state(zero.state_dict(), plain.state_dict())
    else:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            zero.state_dict()


def test_state_is_sharded_and_balanced():
    model = make_model(widths=(16,) * 7)   # 12 tensors: 6 weights of 256, 6 biases of 16
    zero = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    train(model, zero, 1, shard=True)
    owned = [p for g in zero.optim.param_groups for p in g["params"]]
    assert set(zero.optim.state) == set(owned)
    counts = hvd.allgather(torch.tensor([len(owned), sum(p.numel() for p in owned)]).unsqueeze(0))
    assert int(counts[:, 0].sum()) == len(list(model.parameters()))   # each parameter owned once
    sizes = counts[:, 1]
    assert int(sizes.sum()) == sum(p.numel() for p in model.parameters())
    assert int(sizes.max() - sizes.min()) <= 256                        # within one largest tensor


def test_exchange_starts_during_backward_and_lands_in_place():
    model = make_model(widths=(16,) * 7)
    zero = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    flat = {p.data_ptr() for p in model.parameters()}
    x, y = data(0, model)
    torch.nn.functional.mse_loss(model(x), y).backward()
    # every gradient's reduction was started by its hook, before step()
    assert set(zero._in_flight) == set(model.parameters())
    zero.step()
    assert not zero._in_flight
    # the parameters are still the same views, updated in place by the allgather
    assert {p.data_ptr() for p in model.parameters()} == flat


def side_by_side():
    """(one process's model, the distributed model, [(model, optimizer, its rows)
    for each]): SGD with momentum, plain on the whole batch, ZeRO on this rank's shard."""
    reference, model = make_model(), make_model()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    zero = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    mine = slice(hvd.rank() * ROWS, (hvd.rank() + 1) * ROWS)
    return reference, model, [(reference, plain, slice(None)), (model, zero, mine)]


def test_gradients_changed_after_backward_are_averaged_as_they_are_at_step():
    """Accumulation over two backward passes, a gradient scaled in place
    after backward, and a parameter this step did not use: each is
    averaged as step() finds it, as one process would see it."""
    reference, model, trainers = side_by_side()
    for step in range(3):
        for net, optimizer, rows in trainers:
            optimizer.zero_grad()
            for micro in range(2):   # accumulation: the second backward adds to the first
                x, y = data(10 * step + micro, net)
                torch.nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
            with torch.no_grad():
                net[0].weight.grad.mul_(0.5)   # changed in place after backward (as clipping does)
            optimizer.step()
        assert_same_params(model, reference)
    for net, optimizer, rows in trainers:
        optimizer.zero_grad()
        x, y = data(99, net)
        # the last layer alone: the others get no gradient at all this step,
        # on any rank, and are left alone, as one process leaves them (the
        # momentum they built up does not move them)
        torch.nn.functional.mse_loss(net[-1](torch.tanh(net[:-1](x[rows]).detach())), y[rows]).backward()
        optimizer.step()
    assert_same_params(model, reference)


@pytest.mark.parametrize("then", ["kept-gradients", "a-layer-frozen"])
def test_a_parameter_only_rank_0_uses_when_gradients_are_sent_again_matches_one_process(then):
    """The last layer only trains on rank 0's rows, so only rank 0's backward
    starts its reductions. Then every rank sends its gradients again at
    step(): with zero_grad(set_to_none=False) (gradients accumulate into
    last step's averages), or after a layer is frozen (the layout is made
    again). The other ranks used to wait only on what their own backward
    had started and to send the rest in the second round, which rank 0
    paired with its first: a DeadlockError a minute later."""
    reference, model, trainers = side_by_side()
    for step in range(3):
        for net, optimizer, rows in trainers:
            if then == "a-layer-frozen":
                net[0].requires_grad_(step != 1)
            optimizer.zero_grad(set_to_none=then != "kept-gradients")
            x, y = data(step, net)
            hidden = torch.tanh(net[:-1](x))
            loss = torch.nn.functional.mse_loss(hidden[rows, :3], y[rows])
            if rows == slice(None):   # one process: rank 0's term, averaged over the ranks
                loss = loss + net[-1](hidden[:ROWS]).pow(2).mean() / hvd.size()
            elif hvd.rank() == 0:
                loss = loss + net[-1](hidden[:ROWS]).pow(2).mean()
            loss.backward()
            optimizer.step()
        assert_same_params(model, reference)


def test_parameters_given_new_memory_are_laid_out_again():
    reference, model = make_model(), make_model()
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    zero = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    train(reference, plain, 1, shard=False)
    train(model, zero, 1, shard=True)
    with torch.no_grad():
        for p in list(model.parameters()) + list(reference.parameters()):
            p.data = p.data.clone() + 1.0   # what .to() or a user's reassignment does
    train(reference, plain, 2, shard=False, first_step=1)
    train(model, zero, 2, shard=True, first_step=1)
    assert_same_params(model, reference)


def test_one_dominant_tensor_still_matches():
    reference = make_model(widths=(40, 40, 1))
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    train(reference, plain, 3, shard=False)
    model = make_model(widths=(40, 40, 1))
    zero = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    train(model, zero, 3, shard=True)
    assert_same_params(model, reference)


def test_more_ranks_than_parameters():
    # Linear(4, 1) has two tensors: with three ranks one owns nothing.
    torch.manual_seed(1)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 1)).double()
    model = torch.nn.Sequential(torch.nn.Linear(4, 1)).double()
    model.load_state_dict(reference.state_dict())
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    zero = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    train(reference, plain, 3, shard=False)
    train(model, zero, 3, shard=True)
    assert_same_params(model, reference)


def test_resume_from_a_single_process_checkpoint():
    # A plain optimizer's state_dict is what consolidate_state_dict writes,
    # so this is also resuming a checkpoint saved at another world size.
    reference = make_model()
    plain = torch.optim.Adam(groups(reference, True), lr=0.01)
    train(reference, plain, 2, shard=False)
    checkpoint = saved_and_loaded({"model": reference.state_dict(), "optimizer": plain.state_dict()})

    model = make_model(seed=99)
    zero = hvd.ZeroRedundancyOptimizer(groups(model, True), torch.optim.Adam, lr=0.5)
    model.load_state_dict(checkpoint["model"])
    zero.load_state_dict(checkpoint["optimizer"])
    assert zero.param_groups[1]["lr"] == 0.003 and zero.optim.param_groups[0]["lr"] == 0.01

    train(reference, plain, 2, shard=False, first_step=2)
    train(model, zero, 2, shard=True, first_step=2)
    assert_same_params(model, reference)


def test_scheduler_changes_reach_the_shard():
    reference = make_model()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    model = make_model()
    zero = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    for optimizer, net, shard in [(plain, reference, False), (zero, model, True)]:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for step in range(3):
            train(net, optimizer, 1, shard, first_step=step)
            scheduler.step()
    assert_same_params(model, reference)


def test_add_param_group_after_construction():
    reference, model = make_model(), make_model()
    plain = torch.optim.SGD(list(reference.parameters())[:2], lr=0.1)
    plain.add_param_group({"params": list(reference.parameters())[2:], "lr": 0.2})
    zero = hvd.ZeroRedundancyOptimizer(list(model.parameters())[:2], torch.optim.SGD, lr=0.1)
    zero.add_param_group({"params": list(model.parameters())[2:], "lr": 0.2})
    train(reference, plain, 2, shard=False)
    train(model, zero, 2, shard=True)
    assert_same_params(model, reference)


def test_mismatched_checkpoint_is_refused():
    zero = hvd.ZeroRedundancyOptimizer(make_model().parameters(), torch.optim.SGD, lr=0.1)
    other = torch.optim.SGD(make_model(widths=(6, 3)).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="parameter groups do not match"):
        zero.load_state_dict(other.state_dict())
