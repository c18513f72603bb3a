"""unison.torch with process sets: two halves of the job train two models at
once, each half checked against one process training on that half's whole
batch, while a global metric average runs across both. tests/test_parallel.py
runs this at 2, 3 and 4 ranks."""
import pytest

torch = pytest.importorskip("torch")
import unison  # noqa: E402
import unison.torch as hvd  # noqa: E402

torch.set_num_threads(1)
ROWS = 3




def model_for(half):
    torch.manual_seed(11 + half.process_set_id)  # each half its own model
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()


def half_batch(half, step):
    g = torch.Generator().manual_seed(1000 * half.process_set_id + step)
    n = ROWS * half.size()
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)


def test_two_halves_train_two_models_and_match_one_process(half):
    model = model_for(half)
    # Each half starts from its first rank's weights, whatever the others hold.
    if half.rank() != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=half.ranks[0], process_set=half)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                         named_parameters=model.named_parameters(), process_set=half)
    hvd.broadcast_optimizer_state(optimizer, root_rank=half.ranks[0], process_set=half)
    reference = model_for(half)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.5)
    me = half.rank()
    for step in range(4):
        x, y = half_batch(half, step)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[me * ROWS:(me + 1) * ROWS]), y[me * ROWS:(me + 1) * ROWS])
        loss.backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        reference_optimizer.step()
        # The global metric: every rank's loss, averaged over the whole job.
        mean = hvd.allreduce(torch.tensor([float(hvd.rank())]), name="ps.metric")
        assert mean.item() == pytest.approx(sum(range(hvd.size())) / hvd.size())
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_collectives_and_their_gradients_in_a_set(half):
    me = hvd.rank()
    x = torch.full((2, 3), float(me), dtype=torch.float64, requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum, name="ps.t.ar", process_set=half)
    assert torch.equal(y.detach(), torch.full((2, 3), float(sum(half.ranks)), dtype=torch.float64))
    y.sum().backward()  # the gradient of a Sum allreduce is the Sum allreduce of the gradient
    assert torch.equal(x.grad, torch.full((2, 3), float(half.size()), dtype=torch.float64))

    gathered = hvd.allgather(torch.full((me + 1,), me, dtype=torch.int32), name="ps.t.ag", process_set=half)
    assert gathered.tolist() == [r for r in half.ranks for _ in range(r + 1)]
    b = hvd.broadcast(torch.tensor([me, me]), root_rank=half.ranks[-1], name="ps.t.bc", process_set=half)
    assert b.tolist() == [half.ranks[-1]] * 2
    received, splits = hvd.alltoall(torch.arange(half.size()) + 10 * me, splits=[1] * half.size(),
                                    name="ps.t.a2a", process_set=half)
    assert received.tolist() == [10 * r + half.rank() for r in half.ranks] and splits.tolist() == [1] * half.size()
    part = hvd.reducescatter(torch.ones(half.size() * 2, dtype=torch.float32), op=hvd.Sum, name="ps.t.rs",
                             process_set=half)
    assert part.tolist() == [float(half.size())] * 2
    outs = hvd.grouped_allreduce([torch.tensor([1.0]), torch.tensor([float(me)])], op=hvd.Sum, name="ps.t.g",
                                 process_set=half)
    assert [o.item() for o in outs] == [half.size(), sum(half.ranks)]
    assert hvd.broadcast_object({"from": me}, root_rank=half.ranks[0], process_set=half) == {"from": half.ranks[0]}
    assert hvd.allgather_object(me, process_set=half) == half.ranks
    hvd.barrier(process_set=half)


def test_sync_batch_norm_uses_the_set_statistics(half):
    g = torch.Generator().manual_seed(5 + half.process_set_id)
    whole = torch.randn(ROWS * half.size(), 3, generator=g, dtype=torch.float64) * 2 + half.process_set_id
    reference = torch.nn.BatchNorm1d(3).double()
    synced = hvd.SyncBatchNorm(3, process_set=half).double()
    expected = reference(whole)
    me = half.rank()
    out = synced(whole[me * ROWS:(me + 1) * ROWS])
    torch.testing.assert_close(out, expected[me * ROWS:(me + 1) * ROWS], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(synced.running_mean, reference.running_mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(synced.running_var, reference.running_var, rtol=1e-10, atol=1e-12)


def test_an_optimizer_of_a_set_steps_locally_on_the_ranks_outside_it(half):
    """As in Horovod, a script builds one DistributedOptimizer of a set on
    every rank and steps it everywhere: the set's ranks average over it and
    match one process on the set's whole batch; a rank outside it is a
    plain optimizer on its own shard, and broadcast_optimizer_state leaves
    its state alone."""
    sets = sorted((s for s in unison.process_sets._registered.values() if s.ranks is not None),
                  key=lambda s: s.process_set_id)
    for chosen in sets:
        model, reference = model_for(chosen), model_for(chosen)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                             named_parameters=model.named_parameters(), process_set=chosen)
        hvd.broadcast_optimizer_state(optimizer, root_rank=chosen.ranks[0], process_set=chosen)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.5)
        me = chosen.rank()
        for step in range(3):
            x, y = half_batch(chosen, step)
            if me < 0:   # outside: its own rows, stepped alone, as the reference is
                x, y = x[hvd.rank() % 2::2], y[hvd.rank() % 2::2]
                shard = slice(None)
            else:
                shard = slice(me * ROWS, (me + 1) * ROWS)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
            optimizer.step()
            reference_optimizer.zero_grad()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            reference_optimizer.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_a_sync_batch_norm_outside_its_set_is_refused(half):
    for other in [s for s in unison.process_sets._registered.values() if s.ranks is not None and not s.included()]:
        with pytest.raises(ValueError, match="rank %d is not in process set %d" % (hvd.rank(), other.process_set_id)):
            hvd.SyncBatchNorm(3, process_set=other)
