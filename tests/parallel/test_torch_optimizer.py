"""DistributedOptimizer and the broadcast helpers.

The numerical claim: N ranks, each training on its shard of the batch,
end with the same parameters as one process training on the whole batch.
Every rank computes that single-process reference itself and compares."""
import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import unison  # noqa: E402
import unison.torch as hvd  # noqa: E402

torch.set_num_threads(1)
STEPS = 4
ROWS_PER_RANK = 4


def make_model(dtype=torch.float64, seed=7):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def batch(step, dtype=torch.float64):
    g = torch.Generator().manual_seed(100 + step)
    n = ROWS_PER_RANK * hvd.size()
    return torch.randn(n, 6, generator=g).to(dtype), torch.randn(n, 3, generator=g).to(dtype)


def my_rows(tensor):
    r = hvd.rank()
    return tensor[r * ROWS_PER_RANK:(r + 1) * ROWS_PER_RANK]


def reference(make_optimizer, dtype=torch.float64, steps=STEPS, clip=None):
    model = make_model(dtype)
    optimizer = make_optimizer(model.parameters())
    for step in range(steps):
        x, y = batch(step, dtype)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def distributed(make_optimizer, dtype=torch.float64, steps=STEPS, passes=1, before_step=None, **options):
    model = make_model(dtype)
    optimizer = hvd.DistributedOptimizer(make_optimizer(model.parameters()),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=passes, **options)
    for step in range(steps):
        if before_step is not None:
            before_step(step, optimizer)
        passes = optimizer.backward_passes_per_step
        x, y = batch(step, dtype)
        x, y = my_rows(x), my_rows(y)
        optimizer.zero_grad()
        for part in range(passes):
            rows = slice(part * ROWS_PER_RANK // passes, (part + 1) * ROWS_PER_RANK // passes)
            (torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / passes).backward()
        optimizer.step()
    return model, optimizer


def assert_same(model, expected, atol=1e-12):
    for p, q in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=atol)


SGD = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
ADAM = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731


@pytest.mark.parametrize("make_optimizer", [SGD, ADAM], ids=["sgd-momentum", "adam"])
def test_matches_single_process(make_optimizer):
    model, optimizer = distributed(make_optimizer)
    assert isinstance(optimizer, type(make_optimizer([torch.zeros(1, requires_grad=True)])))
    assert_same(model, reference(make_optimizer))


@pytest.mark.parametrize("make_optimizer", [SGD, ADAM], ids=["sgd-momentum", "adam"])
def test_backward_passes_per_step_2(make_optimizer):
    model, _ = distributed(make_optimizer, passes=2)
    assert_same(model, reference(make_optimizer))


def test_set_backward_passes_per_step_changes_the_count_from_the_next_step():
    # Horovod's method, for elastic jobs that keep their global batch: two
    # passes a step, then one from the third step.
    def from_the_third_step(step, optimizer):
        if step == 2:
            optimizer.set_backward_passes_per_step(1)
    model, optimizer = distributed(SGD, passes=2, before_step=from_the_third_step)
    assert optimizer.backward_passes_per_step == 1
    assert_same(model, reference(SGD), atol=1e-12)
    with pytest.raises(ValueError, match="at least 1, got 0"):
        optimizer.set_backward_passes_per_step(0)


def test_horovods_public_attributes_say_how_gradients_are_reduced_and_op_is_read_at_each_allreduce():
    model, optimizer = distributed(SGD, steps=1, sparse_as_dense=True)
    assert (optimizer.op, optimizer.gradient_predivide_factor, optimizer.sparse_as_dense, optimizer.process_set,
            optimizer.backward_passes_per_step) == (hvd.Average, 1.0, True, hvd.global_process_set, 1)
    x, y = batch(1)

    def reduced_gradients():
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y)).backward()
        optimizer.synchronize()
        return [p.grad.clone() for p in model.parameters()]
    averaged = reduced_gradients()
    optimizer.op = hvd.Sum  # as in Horovod: the next allreduces sum
    for summed, average in zip(reduced_gradients(), averaged):
        torch.testing.assert_close(summed, average * hvd.size(), rtol=0, atol=1e-12)


def test_fp16_compression_is_close():
    model, _ = distributed(SGD, dtype=torch.float32, compression=hvd.Compression.fp16)
    assert_same(model, reference(SGD, dtype=torch.float32), atol=2e-3)


def test_gradient_predivide_factor():
    model, _ = distributed(SGD, gradient_predivide_factor=float(hvd.size()))
    assert_same(model, reference(SGD))


def test_groups_by_count():
    model, _ = distributed(SGD, groups=2)
    assert_same(model, reference(SGD))


def test_num_groups_is_horovods_older_spelling_of_groups():
    model, optimizer = distributed(SGD, num_groups=2)
    assert_same(model, reference(SGD))
    assert sorted(set(optimizer._group_of.values())) == [0, 1]


def test_a_compression_that_is_not_a_compressor_is_refused():
    model = make_model()
    with pytest.raises(TypeError, match=r"DistributedOptimizer: compression must be a compressor.*float 2\.0"):
        hvd.DistributedOptimizer(SGD(model.parameters()), model.named_parameters(), 2.0)


def test_groups_by_explicit_lists():
    # Parameters are matched by identity, so the lists name the wrapped
    # model's own parameters; the fourth is left to go alone.
    model = make_model()
    params = list(model.parameters())
    optimizer = hvd.DistributedOptimizer(SGD(model.parameters()), named_parameters=model.named_parameters(),
                                         groups=[[params[0], params[2]], [params[1]]])
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y)).backward()
        optimizer.step()
    assert_same(model, reference(SGD))


def test_synchronize_then_clip_inside_skip_synchronize():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(SGD(model.parameters()), named_parameters=model.named_parameters())
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y)).backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        with optimizer.skip_synchronize():
            optimizer.step()
    assert_same(model, reference(SGD, clip=0.5))


def test_a_gradient_changed_while_its_allreduce_is_in_flight_fails_the_step_naming_it():
    # clip_grad_norm_ straight after backward changes the gradients while
    # their allreduces read and write them in place: the clipping was lost
    # or mixed into the average, differently on each rank. Every rank
    # fails the step, naming the parameters and the fix, and goes on.
    model = make_model()
    optimizer = hvd.DistributedOptimizer(SGD(model.parameters()), named_parameters=model.named_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    with pytest.raises(unison.InvalidArgumentError,
                       match=r"gradients of 4 parameter\(s\) \('0\.weight', '0\.bias', '2\.weight', '2\.bias'\) were "
                             r"changed while their allreduce was in flight.*optimizer\.synchronize\(\) first.*"
                             r"skip_synchronize"):
        optimizer.step()
    assert_same(model, before, atol=0)   # no step was taken
    # Only the parameters changed are named; the optimizer is ready again.
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y)).backward()
    model[2].bias.grad.mul_(2)
    with pytest.raises(unison.InvalidArgumentError, match=r"gradients of 1 parameter\(s\) \('2\.bias'\)"):
        optimizer.step()
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y)).backward()
    optimizer.step()
    reference_model = make_model()
    reference_model.load_state_dict({k: v for k, v in zip(reference_model.state_dict(), before)})
    reference_optimizer = SGD(reference_model.parameters())
    torch.nn.functional.mse_loss(reference_model(x), y).backward()
    reference_optimizer.step()
    assert_same(model, [p.detach() for p in reference_model.parameters()])


def test_grad_scaler_without_synchronize_is_refused_and_with_horovods_recipe_matches_one_process():
    # scaler.step(optimizer) unscales the gradients in flight (a fused
    # kernel that no version counter sees) and looks for inf in this rank's
    # own: every rank's step() is refused, and no parameter moves.
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = hvd.DistributedOptimizer(SGD(model.parameters()), named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = batch(0)
    scaler.scale(torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y))).backward()
    with pytest.raises(unison.InvalidArgumentError, match=r"scaler\.step\(optimizer\) unscaled the gradients while "
                                                          r"their allreduces were in flight.*skip_synchronize"):
        scaler.step(optimizer)
    assert_same(model, before, atol=0)
    # A pass short of backward_passes_per_step has nothing in flight: the
    # scaler unscales this rank's own gradients, which step() then reduces.
    accumulating = hvd.DistributedOptimizer(SGD(make_model().parameters()), backward_passes_per_step=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for p in accumulating.param_groups[0]["params"]:
        scaler.scale((p * 1.0).sum()).backward()
    scaler.step(accumulating)
    scaler.update()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y))).backward()
        optimizer.synchronize()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        with optimizer.skip_synchronize():
            scaler.step(optimizer)
        scaler.update()
    # 1024 and its inverse are powers of two: the scaling is exact.
    assert_same(model, reference(SGD, clip=0.5))


def test_a_non_contiguous_gradient_is_not_taken_for_one_changed_in_flight():
    # A channels_last convolution's gradient is not contiguous: its
    # allreduce runs on a contiguous copy written back when it completes.
    torch.manual_seed(3)
    model = torch.nn.Conv2d(3, 4, 3).to(torch.float64).to(memory_format=torch.channels_last)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(5)
    x = torch.randn(hvd.size() * 2, 3, 6, 6, generator=g, dtype=torch.float64)
    initial = [p.detach().clone() for p in model.parameters()]
    mine = x[hvd.rank() * 2:(hvd.rank() + 1) * 2].contiguous(memory_format=torch.channels_last)
    model(mine).square().mean().backward()
    assert not model.weight.grad.is_contiguous()
    optimizer.step()
    reference_model = torch.nn.Conv2d(3, 4, 3).to(torch.float64)
    with torch.no_grad():
        for p, q in zip(reference_model.parameters(), initial):
            p.copy_(q)
    reference_model(x).square().mean().backward()
    torch.optim.SGD(reference_model.parameters(), lr=0.1).step()
    assert_same(model, [p.detach() for p in reference_model.parameters()])


def test_step_after_synchronize_warns():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(SGD(model.parameters()), named_parameters=model.named_parameters())
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y)).backward()
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    assert any("skip_synchronize" in str(w.message) for w in caught)


def test_zero_grad_between_backward_and_step_raises():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(SGD(model.parameters()), named_parameters=model.named_parameters())
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y)).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        optimizer.zero_grad()
    optimizer.step()
    optimizer.zero_grad()


def _train_gan(pattern, distributed, steps=3):
    """A GAN's loop: the generator's loss flows back through the
    discriminator, so its backward reaches the discriminator's parameters
    too. `pattern` is how the loop keeps those out of the generator's step."""
    torch.manual_seed(3)
    G = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).double()
    D = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)).double()
    opt_g, opt_d = SGD(G.parameters()), SGD(D.parameters())
    if distributed:
        opt_g = hvd.DistributedOptimizer(opt_g, named_parameters=G.named_parameters(prefix="G"))
        opt_d = hvd.DistributedOptimizer(opt_d, named_parameters=D.named_parameters(prefix="D"))
    for step in range(steps):
        noise, real = batch(step)
        if distributed:
            noise, real = my_rows(noise), my_rows(real)
        fake = G(noise)
        if pattern == "synchronize" and distributed:
            opt_d.synchronize()   # averages (and so finishes) what the last generator pass sent
        opt_d.zero_grad()
        (D(fake.detach()).mean() - D(real).mean()).backward()
        opt_d.step()
        D.requires_grad_(pattern != "frozen")
        opt_g.zero_grad()
        (-D(fake).mean()).backward()
        opt_g.step()
        D.requires_grad_(True)
    return [p.detach().clone() for p in list(G.parameters()) + list(D.parameters())]


@pytest.mark.parametrize("pattern", ["frozen", "synchronize"])
def test_gan_generator_pass_through_discriminator_matches_one_process(pattern):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nor a warning about a second allreduce
        got = _train_gan(pattern, distributed=True)
    for mine, one_process in zip(got, _train_gan(pattern, distributed=False)):
        torch.testing.assert_close(mine, one_process, rtol=0, atol=1e-12)


def test_gan_generator_pass_left_in_flight_names_the_parameters():
    with pytest.raises(AssertionError, match=r"allreduces in flight \(of D\.0\.bias, D\.0\.weight, D\.2\.bias "
                                             r"and 1 more\).*requires_grad=False"):
        _train_gan("as written", distributed=True)


def test_too_many_backward_passes_raises():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(SGD(model.parameters()), named_parameters=model.named_parameters())
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y)).backward()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y)).backward()
    # The refused backward had already added to the first gradient it
    # reached, whose allreduce was in flight: step() says so, and takes none.
    with pytest.raises(unison.InvalidArgumentError, match=r"gradients of 1 parameter\(s\) \('2\.(weight|bias)'\) were "
                                                          r"changed while their allreduce was in flight"):
        optimizer.step()
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y)).backward()
    optimizer.step()
    assert_same(model, reference(SGD, steps=1))


def test_load_state_dict_resets_pending_state():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(SGD(model.parameters()), named_parameters=model.named_parameters())
    saved = optimizer.state_dict()
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y)).backward()
    optimizer.load_state_dict(saved)
    optimizer.zero_grad()  # nothing pending any more
    torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y)).backward()
    optimizer.step()


def test_parameter_unused_on_one_rank_does_not_hang():
    model = make_model()
    extra = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    named = list(model.named_parameters()) + [("extra", extra)]
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1), named_parameters=named)
    x, y = batch(0)
    loss = torch.nn.functional.mse_loss(model(my_rows(x)), my_rows(y))
    if hvd.rank() == 0:
        loss = loss + extra.sum()
    loss.backward()
    optimizer.step()
    # Rank 0's gradient of ones, averaged with zeros from the others.
    expected = 1.0 - 0.1 / hvd.size()
    torch.testing.assert_close(extra.detach(), torch.full((2,), expected, dtype=torch.float64))


ADAM_DECAY = lambda params: torch.optim.Adam(params, lr=0.01, weight_decay=0.1)  # noqa: E731


def fine_tune(make_optimizer, wrap=None, rows=my_rows, add_backbone_at=None, steps=6):
    """The fine-tuning recipe: the first layer (the backbone) starts frozen
    and is unfrozen at step 2, the last layer is frozen from step 4. With
    add_backbone_at, the optimizer starts with the head only and the
    backbone's parameters join it in a new param group at that step.
    wrap(optimizer, model) makes the distributed one; None trains one
    process on the whole batch."""
    model = make_model()
    backbone, head = list(model[0].parameters()), list(model[2].parameters())
    for p in backbone:
        p.requires_grad_(False)
    optimizer = make_optimizer(head if add_backbone_at is not None else model.parameters())
    if wrap is not None:
        optimizer = wrap(optimizer, model)
    for step in range(steps):
        for p in backbone:
            p.requires_grad_(step >= 2)
        for p in head:
            p.requires_grad_(step < 4)
        if step == add_backbone_at:
            optimizer.add_param_group({"params": backbone, "lr": 0.05})
        x, y = batch(step)
        if wrap is not None:
            x, y = rows(x), rows(y)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model


def wrapped(**options):
    return lambda optimizer, model: hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), **options)


@pytest.mark.parametrize("options", [{}, {"groups": 1}, {"num_groups": 2}],
                         ids=["alone", "one-group", "two-groups"])
@pytest.mark.parametrize("make_optimizer", [SGD, ADAM_DECAY], ids=["sgd-momentum", "adam-weight-decay"])
def test_parameters_frozen_and_unfrozen_during_training_match_one_process(make_optimizer, options):
    # A parameter frozen when the optimizer was wrapped and unfrozen later
    # is averaged from then on; one frozen later is left alone (an optimizer
    # with momentum or weight decay would move it on a zero gradient).
    expected = [p.detach() for p in fine_tune(make_optimizer).parameters()]
    assert_same(fine_tune(make_optimizer, wrapped(**options)), expected, atol=1e-12)


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_a_param_group_added_after_wrapping_is_averaged_and_matches_one_process(named):
    expected = [p.detach() for p in fine_tune(SGD, add_backbone_at=2).parameters()]
    wrap = wrapped() if named else (lambda optimizer, model: hvd.DistributedOptimizer(optimizer))
    assert_same(fine_tune(SGD, wrap, add_backbone_at=2), expected, atol=1e-12)


@pytest.mark.parametrize("add_backbone_at", [None, 2], ids=["unfrozen", "added"])
def test_adasum_combines_parameters_unfrozen_or_added_after_wrapping(add_backbone_at):
    model = fine_tune(SGD, wrapped(op=hvd.Adasum), add_backbone_at=add_backbone_at)
    # Each rank trained on its own rows: only the combined deltas make the
    # ranks hold the same parameters.
    for name, p in model.named_parameters():
        gathered = hvd.allgather(p.detach().unsqueeze(0), name="adasum.check." + name)
        for other in range(hvd.size()):
            torch.testing.assert_close(gathered[other], p.detach(), rtol=0, atol=0,
                                       msg="%s differs on rank %d" % (name, other))


def test_named_parameters_checks():
    model = make_model()
    with pytest.raises(ValueError, match="tuples"):
        hvd.DistributedOptimizer(SGD(model.parameters()), named_parameters=list(model.parameters()))
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(SGD(model.parameters()), named_parameters=[(named[0][0], p) for _, p in named])
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(SGD(model.parameters()), named_parameters=named[:1])
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(SGD(model.parameters()), op=hvd.Sum, gradient_predivide_factor=2.0)


def test_adasum_of_identical_updates_is_that_update():
    # Every rank trains on the same whole batch: their updates are equal,
    # and Adasum of equal updates is the update itself.
    model = make_model()
    optimizer = hvd.DistributedOptimizer(SGD(model.parameters()), named_parameters=model.named_parameters(),
                                         op=hvd.Adasum)
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    assert_same(model, reference(SGD), atol=1e-10)


def test_sparse_gradients_allreduced():
    r, n = hvd.rank(), hvd.size()
    rows = n + 2   # a row per rank, and rows no rank touches
    for sparse_as_dense in (False, True):
        embedding = torch.nn.Embedding(rows, 2, sparse=True).to(torch.float64)
        torch.nn.init.zeros_(embedding.weight)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=1.0),
                                             named_parameters=embedding.named_parameters(),
                                             sparse_as_dense=sparse_as_dense)
        embedding(torch.tensor([r, r])).sum().backward()
        optimizer.step()
        expected = torch.zeros(rows, 2, dtype=torch.float64)
        expected[:n] = -2.0 / n
        torch.testing.assert_close(embedding.weight.detach(), expected)


# ---- broadcast helpers -------------------------------------------------------------

OPTIMIZERS = {
    "SGD": lambda ps, r: torch.optim.SGD(ps, lr=0.1 + r, momentum=0.5, nesterov=True),
    "Adam": lambda ps, r: torch.optim.Adam(ps, lr=0.01 * (r + 1), betas=(0.8 + 0.01 * r, 0.99)),
    "AdamW": lambda ps, r: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1 * (r + 1)),
    "RMSprop": lambda ps, r: torch.optim.RMSprop(ps, lr=0.01, momentum=0.1 * r, centered=True),
    "Adagrad": lambda ps, r: torch.optim.Adagrad(ps, lr=0.01 * (r + 1), lr_decay=0.001),
    "LBFGS": lambda ps, r: torch.optim.LBFGS(ps, lr=0.5 + r, history_size=3 + r),
}


def plain(value):
    """A state value in a comparable form."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.detach().reshape(-1).tolist())
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_broadcast_optimizer_state_round_trip(name):
    r = hvd.rank()
    model = make_model(seed=20 + r)  # every rank starts elsewhere
    optimizer = OPTIMIZERS[name](model.parameters(), r)
    if r == 0:  # root has stepped (state initialised); the others have not
        x, y = batch(0)

        def closure():
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        optimizer.step(closure)
        optimizer.step(closure)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # As Horovod: where the state had to be created (by a step on zero
    # gradients), parameters that had no gradient are left with zeros, not
    # None. Adagrad creates its state in its constructor; LBFGS goes whole.
    if name not in ("Adagrad", "LBFGS"):
        for p in model.parameters():
            assert p.grad is not None
            if r != 0:
                assert torch.equal(p.grad, torch.zeros_like(p))
    mine = plain(optimizer.state_dict())
    roots = hvd.broadcast_object(mine, root_rank=0, name="state.check." + name)
    assert mine == roots
    params = plain([p for p in model.parameters()])
    assert params == hvd.broadcast_object(params, root_rank=0, name="params.check." + name)


def test_broadcast_parameters_from_named_parameters_and_list():
    r = hvd.rank()
    model = make_model(seed=50 + r)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=hvd.size() - 1)
    expected = make_model(seed=50 + hvd.size() - 1)
    assert_same(model, [p.detach() for p in expected.parameters()], atol=0)
    tensors = [torch.full((3,), float(r)), torch.full((2, 2), float(r))]
    hvd.broadcast_parameters(tensors, root_rank=1)
    assert all(torch.equal(t, torch.ones_like(t)) for t in tensors)


def test_broadcast_and_allgather_object():
    r, n = hvd.rank(), hvd.size()
    obj = {"rank": r, "nested": [r, (r, "x" * r)], "tensor": torch.full((2,), r)}
    got = hvd.broadcast_object(obj, root_rank=n - 1)
    assert got["rank"] == n - 1 and got["nested"] == [n - 1, (n - 1, "x" * (n - 1))]
    assert torch.equal(got["tensor"], torch.full((2,), n - 1))
    gathered = hvd.allgather_object({"rank": r, "pad": "y" * (100 * r)})
    assert gathered == [{"rank": k, "pad": "y" * (100 * k)} for k in range(n)]


def test_objects_with_lambdas_and_tensors_go_by_value():
    """torch.save through cloudpickle (a dependency of unison[torch]), as
    Horovod sends every object: a schedule written as a lambda arrives
    working, beside the tensors torch.save keeps compact."""
    r, n = hvd.rank(), hvd.size()
    mine = {"schedule": lambda epoch: 0.1 * (r + 1) * epoch, "weights": torch.full((3,), float(r))}
    got = hvd.broadcast_object(mine, root_rank=n - 1, name="lambdas")
    assert got["schedule"](2) == 0.1 * n * 2 and torch.equal(got["weights"], torch.full((3,), float(n - 1)))
    gathered = hvd.allgather_object(mine, name="lambdas.all")
    assert [(g["schedule"](2), g["weights"].tolist()) for g in gathered] == [
        (0.1 * (k + 1) * 2, [float(k)] * 3) for k in range(n)]


@pytest.mark.parametrize("add_backbone_at", [None, 2], ids=["unfrozen", "added"])
def test_zero_redundancy_optimizer_fine_tunes_as_one_process(add_backbone_at):
    expected = [p.detach() for p in fine_tune(SGD, add_backbone_at=add_backbone_at).parameters()]
    zero = lambda params: hvd.ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1, momentum=0.9)  # noqa: E731
    assert_same(fine_tune(zero, lambda optimizer, model: optimizer, add_backbone_at=add_backbone_at), expected,
                atol=1e-12)


def test_complex_parameters_match_one_process():
    # A spectral layer's weights are complex; their gradients are averaged
    # part by part, which is the average of the complex numbers.
    def make():
        torch.manual_seed(5)
        return torch.nn.Parameter(torch.randn(6, 3, dtype=torch.complex128))

    def loss(weight, x, y):
        return ((x.to(torch.complex128) @ weight).abs() - y).pow(2).mean()

    reference = make()
    reference_optimizer = torch.optim.Adam([reference], lr=0.01)
    weight = make()
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam([weight], lr=0.01), named_parameters=[("spectral", weight)])
    for step in range(STEPS):
        x, y = batch(step)
        reference_optimizer.zero_grad()
        loss(reference, x, y).backward()
        reference_optimizer.step()
        optimizer.zero_grad()
        loss(weight, my_rows(x), my_rows(y)).backward()
        optimizer.step()
    torch.testing.assert_close(weight.detach(), reference.detach(), rtol=0, atol=1e-12)


LBFGS = lambda params: torch.optim.LBFGS(params, lr=0.5, max_iter=5, line_search_fn="strong_wolfe")  # noqa: E731


def train_with_closure(make_optimizer, distributed):
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    if distributed:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    losses = []
    for step in range(3):
        x, y = batch(step)
        if distributed:
            x, y = my_rows(x), my_rows(y)

        def closure():
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        losses.append(float(optimizer.step(closure).detach()))
    return model, losses


@pytest.mark.parametrize("make_optimizer", [SGD, LBFGS], ids=["sgd", "lbfgs"])
def test_a_step_with_a_closure_averages_each_evaluation_and_matches_one_process(make_optimizer):
    # The optimizer reads the gradients (and LBFGS the loss, for its line
    # search and stopping tests) as soon as the closure returns: both are
    # averaged by then, so every rank decides alike, as one process would.
    reference, reference_losses = train_with_closure(make_optimizer, False)
    model, losses = train_with_closure(make_optimizer, True)
    assert_same(model, [p.detach() for p in reference.parameters()], atol=1e-10)
    assert losses == pytest.approx(reference_losses, abs=1e-10)
    assert hvd.allgather_object(losses) == [losses] * hvd.size()


def test_a_closure_that_makes_the_last_of_accumulated_passes_matches_one_process():
    # Lightning's accumulate_grad_batches: backward alone on the first
    # micro-batches, then step(closure) whose closure makes the last pass,
    # which starts the step's allreduces: one per parameter per step (step()
    # once averaged the partial sums before the closure too, then again).
    passes = 3
    reference, model = make_model(), make_model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters(), backward_passes_per_step=passes)
    started = []
    start_one = optimizer._allreduce_grad_async
    optimizer._allreduce_grad_async = lambda p: (started.append(p), start_one(p))[1]
    for step in range(2):
        reference_optimizer.zero_grad()
        optimizer.zero_grad()
        for k in range(passes):
            x, y = batch(step * passes + k)
            (torch.nn.functional.mse_loss(reference(x), y) / passes).backward()

            def closure(x=my_rows(x), y=my_rows(y)):
                loss = torch.nn.functional.mse_loss(model(x), y) / passes
                loss.backward()
                return loss
            if k < passes - 1:
                closure()
            else:
                optimizer.step(closure)
        reference_optimizer.step()
    assert_same(model, [p.detach() for p in reference.parameters()], atol=1e-10)
    assert len(started) == 2 * len(list(model.parameters()))


class WithUnusedLayers(torch.nn.Module):
    """A model with a layer no step uses (as a BERT pooler under token
    classification) and one that only some rows use, some steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 3)
        self.pooler = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 3)

    def forward(self, x, extra_rows):
        h = torch.tanh(self.a(x))
        out = self.b(h)
        if extra_rows.any():
            out = out + self.extra(h) * extra_rows.unsqueeze(1)
        return out


# Which ranks' rows use `extra` at each step: rank 0's only, none, all, none.
EXTRA_BY_STEP = [lambda r: r == 0, lambda r: False, lambda r: True, lambda r: False]


@pytest.mark.parametrize("options", [{}, {"groups": 2}, "zero"], ids=["alone", "groups", "zero"])
def test_parameters_no_rank_used_are_left_without_a_gradient_as_in_one_process(options):
    # Horovod averaged zeros for them, and AdamW's weight decay (and its
    # moments, once it had any) then moved parameters one process leaves
    # alone; a parameter only some ranks used is averaged with zeros.
    n = hvd.size()

    def train(distributed):
        model = WithUnusedLayers().double()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        if distributed and options == "zero":
            optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01, weight_decay=0.1)
        elif distributed:
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), **options)
        grads_after = []
        for step, uses_extra in enumerate(EXTRA_BY_STEP):
            x, y = batch(step)
            rows = torch.tensor([uses_extra(i // ROWS_PER_RANK) for i in range(n * ROWS_PER_RANK)],
                                dtype=torch.float64)
            if distributed:
                x, y, rows = my_rows(x), my_rows(y), my_rows(rows)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x, rows), y).backward()
            optimizer.step()
            grads_after.append((model.pooler.weight.grad is None, model.extra.weight.grad is None))
        return model, grads_after

    reference, reference_grads = train(False)
    model, grads = train(True)
    assert_same(model, [p.detach() for p in reference.parameters()], atol=1e-12)
    assert reference_grads == [(True, False), (True, True), (True, False), (True, True)]
    if options != "zero":   # (ZeRO leaves averaged gradients on their owners only)
        assert grads == reference_grads


# ---- random recipes ------------------------------------------------------------------
#
# The tests above each try one feature. Training scripts combine them: a
# recipe here draws, from its seed (the same on every rank), a network with
# a branch that only some rows take (so in a step some ranks use it and
# others do not, or none does) and that may join the optimizer in a param
# group of its own later, layers frozen and unfrozen from step to step, an
# optimizer with its settings, gradient accumulation, groups, a predivide
# factor and Horovod's clipping recipe, or ZeroRedundancyOptimizer, and
# zero_grad's set_to_none. N ranks on their shards must end where one
# process does on the whole batch. (This found ZeRO's deadlock of
# test_torch_zero.py's test_a_parameter_only_rank_0_uses_...)

# UNISON_TEST_RECIPES=200 draws more when looking for trouble.
RECIPE_SEEDS = list(range(int(os.environ.get("UNISON_TEST_RECIPES", "24"))))
RECIPE_ROWS = 6   # per rank; divides into 1, 2 or 3 backward passes


class RecipeNet(torch.nn.Module):
    def __init__(self, rng):
        super().__init__()
        widths = [5] + [int(w) for w in rng.integers(2, 7, size=int(rng.integers(1, 4)))] + [3]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.branch = torch.nn.Linear(widths[-2], 3)
        self.threshold = float(rng.choice([0.5, 1.5, 9.0]))   # 9: no row ever takes the branch

    def forward(self, x):
        h = x
        for layer in self.layers[:-1]:
            h = torch.tanh(layer(h))
        out = self.layers[-1](h)
        taken = x[:, 0] > self.threshold
        if bool(taken.any()):
            out = out + self.branch(h) * taken.unsqueeze(1).to(out.dtype)
        return out


def recipe(seed):
    rng = np.random.default_rng(seed)
    kind = ["sgd", "adam", "adamw", "rmsprop", "adagrad"][rng.integers(5)]
    settings = {"sgd": dict(lr=0.1, momentum=float(rng.choice([0.0, 0.9])), weight_decay=float(rng.choice([0, 0.01]))),
                "adam": dict(lr=0.01, weight_decay=float(rng.choice([0, 0.01]))),
                "adamw": dict(lr=0.01, weight_decay=0.1), "rmsprop": dict(lr=0.01, momentum=0.5),
                "adagrad": dict(lr=0.1)}[kind]
    classes = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
               "rmsprop": torch.optim.RMSprop, "adagrad": torch.optim.Adagrad}
    zero = bool(rng.random() < 0.25)
    steps = int(rng.integers(3, 6))
    freezing = bool(rng.random() < 0.5)
    r = dict(seed=seed, optimizer=classes[kind], settings=settings, zero=zero, steps=steps,
             passes=1 if zero else int(rng.choice([1, 2, 3])),
             options={} if zero else dict(groups=[None, 1, 2][rng.integers(3)],
                                          gradient_predivide_factor=float(rng.choice([1.0, 2.0]))),
             # Frozen this step, per layer: few.
             frozen=[[freezing and rng.random() < 0.3 for _ in range(4)] for _ in range(steps)],
             # A parameter frozen with grads kept (not None) would be moved by
             # momentum in one process; DistributedOptimizer leaves it alone.
             set_to_none=True if freezing else bool(rng.random() < 0.5),
             # Horovod's clipping recipe (synchronize, clip, skip_synchronize);
             # ZeRO has no averaged gradients to clip by their norm.
             clip=not zero and bool(rng.random() < 0.3),
             # The branch joins the optimizer in a param group of its own at this step.
             joins=int(rng.choice([0, 0, 1, 2])))
    return r, RecipeNet(rng)


def train_recipe(seed, distributed):
    torch.manual_seed(seed)   # the layers' initial weights
    r, model = recipe(seed)
    model = model.double()
    branch = list(model.branch.parameters())
    initial = [p for p in model.parameters() if r["joins"] == 0 or all(p is not q for q in branch)]
    if distributed and r["zero"]:
        optimizer = hvd.ZeroRedundancyOptimizer(initial, r["optimizer"], **r["settings"])
    else:
        optimizer = r["optimizer"](initial, **r["settings"])
        if distributed:
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                 backward_passes_per_step=r["passes"], **r["options"])
    n = hvd.size()
    for step in range(r["steps"]):
        frozen = list(r["frozen"][step][:len(model.layers)])
        if all(frozen):
            frozen[-1] = False   # never every layer: there would be nothing to train
        for layer, still in zip(model.layers, frozen):
            layer.requires_grad_(not still)
        g = torch.Generator().manual_seed(1000 * seed + step)
        x = torch.randn(n * RECIPE_ROWS, 5, generator=g, dtype=torch.float64)
        y = torch.randn(n * RECIPE_ROWS, 3, generator=g, dtype=torch.float64)
        passes = 1
        if distributed:
            mine = slice(hvd.rank() * RECIPE_ROWS, (hvd.rank() + 1) * RECIPE_ROWS)
            x, y, passes = x[mine], y[mine], r["passes"]
        if r["joins"] and step == r["joins"]:
            optimizer.add_param_group({"params": branch})
        optimizer.zero_grad(set_to_none=r["set_to_none"])
        if step < r["joins"]:
            for p in branch:
                p.grad = None   # outside the optimizer: its gradient would pile up
        part = x.shape[0] // passes
        for p in range(passes):
            rows = slice(p * part, (p + 1) * part)
            (torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / passes).backward()
        trained = [p for group in optimizer.param_groups for p in group["params"]]
        if r["clip"] and distributed:
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(trained, 0.5)
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            if r["clip"]:
                torch.nn.utils.clip_grad_norm_(trained, 0.5)
            optimizer.step()
    return model


@pytest.mark.parametrize("seed", RECIPE_SEEDS)
def test_random_recipes_match_one_process(seed):
    expected = [p.detach() for p in train_recipe(seed, distributed=False).parameters()]
    model = train_recipe(seed, distributed=True)
    r, _ = recipe(seed)
    for (name, p), q in zip(model.named_parameters(), expected):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=1e-10,
                                   msg=lambda m: "recipe %d %s, %s: %s" % (seed, {k: v for k, v in r.items()
                                                                               if k != "frozen"}, name, m))
