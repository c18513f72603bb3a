"""unison.torch in one process without the launcher (rank 0 of 1), and
misuse outside a job."""
import pytest

torch = pytest.importorskip("torch")
import unison.torch as hvd  # noqa: E402


@pytest.fixture
def solo():
    hvd.init()
    yield
    hvd.shutdown()


def test_size_one_collectives_are_identities(solo):
    assert (hvd.rank(), hvd.size()) == (0, 1)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(hvd.allreduce(x), x)
    assert torch.equal(hvd.allgather(x), x)
    assert torch.equal(hvd.broadcast(x, 0), x)
    assert torch.equal(hvd.alltoall(x), x)
    assert torch.equal(hvd.reducescatter(x, op=hvd.Sum), x)
    assert hvd.join() == 0


def test_distributed_optimizer_at_size_one_is_the_plain_optimizer(solo):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    twin = torch.nn.Linear(3, 1)
    twin.load_state_dict(model.state_dict())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    for net, opt in ((model, optimizer), (twin, plain)):
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_use_before_init_is_a_clear_error():
    with pytest.raises(hvd.UnisonError, match="init"):
        hvd.allreduce(torch.ones(1))
    with pytest.raises(hvd.UnisonError, match="on meta; this build moves CPU tensors only"):
        hvd.init()
        try:
            hvd.allreduce(torch.ones(1, device="meta"))
        finally:
            hvd.shutdown()


def test_num_groups_split_as_every_framework_splits():
    # 7 parameters in 5 groups: Horovod's split, the first groups one longer.
    from unison.arguments import split_into_groups
    from unison.torch.optimizer import _assign_groups
    params = [torch.zeros(1) for _ in range(7)]
    assignment = _assign_groups(5, params)
    sizes = [sum(1 for p in params if assignment[p] == g) for g in range(5)]
    assert sizes == [len(g) for g in split_into_groups(params, 5)] == [2, 2, 1, 1, 1]
