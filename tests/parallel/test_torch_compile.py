"""unison's collectives inside torch.compile, through AOTAutograd and
Inductor: program order kept, gradients as in eager code, and training
steps that match their eager run and one process on the whole batch.
(test_torch_compiled_grid.py runs every collective's forms through
Dynamo; test_torch_sync_batch_norm.py compiles SyncBatchNorm models.)"""
import pytest

torch = pytest.importorskip("torch")
import torch._dynamo  # noqa: E402

import unison.torch as hvd  # noqa: E402
from unison.torch import ops as eager_ops  # noqa: E402
from cheap_compiles import make_compiles_cheaper  # noqa: E402

torch.set_num_threads(1)
make_compiles_cheaper()


def exact(got, expected):
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


class _RecordingFrontEnd:
    """The torch front end, noting the name of each collective it starts."""

    def __init__(self, front, names):
        self._front, self._names = front, names

    def __getattr__(self, attribute):
        method = getattr(self._front, attribute)

        def recorded(tensor, *args, **kwargs):
            self._names.append(kwargs.get("name", args[1] if attribute == "broadcast_async" else args[0]))
            return method(tensor, *args, **kwargs)
        return recorded


def test_inductor_runs_the_collectives_in_program_order_with_the_eager_values(monkeypatch):
    # The program's collectives have no data between them, and their
    # results are used in the reverse order: only the operators' ordered
    # effect keeps Inductor from running them in another order, in which
    # ranks that each compiled alike would still pair, but not with a rank
    # running eagerly, or with one whose graph was scheduled otherwise.
    r, n = hvd.rank(), hvd.size()

    def step(x):
        a = hvd.allreduce(x.sin(), op=hvd.Sum, name="order.first")
        b = hvd.allgather(x.cos()[:1], name="order.second")
        c = hvd.broadcast(x.exp(), root_rank=n - 1, name="order.third")
        d = hvd.reducescatter(x.repeat(n), op=hvd.Sum, name="order.fourth")
        return d * 2, c + 1, b.sum(), a

    x = torch.arange(3, dtype=torch.float64) + r
    names = []
    monkeypatch.setattr(eager_ops, "_front", _RecordingFrontEnd(eager_ops._front, names))
    compiled = torch.compile(step, fullgraph=True)   # Inductor
    got = compiled(x)
    assert names == ["order.first", "order.second", "order.third", "order.fourth"], names
    del names[:]
    monkeypatch.undo()
    expected = step(x)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_gradients_through_compiled_collectives_are_the_eager_ones():
    r, n = hvd.rank(), hvd.size()

    def loss(x, w):
        y = x * w
        total = hvd.allreduce(y, op=hvd.Average, name="grad.ar")
        rows = hvd.allgather(y[: r + 1], name="grad.ag")
        root = hvd.broadcast(y, root_rank=0, name="grad.bc")
        spread, _ = hvd.alltoall(y.repeat(n), splits=[3] * n, name="grad.a2a")
        share = hvd.reducescatter(y.repeat(n), op=hvd.Sum, name="grad.rs")
        first, second = hvd.grouped_allreduce([y * 2, y[:2] * 3], op=hvd.Sum, name="grad.gar")
        weights = torch.arange(1.0, 4.0, dtype=torch.float64) * (r + 1)
        return ((total * weights).sum() + (rows ** 2).sum() + (root * weights).sum() + (spread ** 2).sum()
                + (share * weights).sum() + (first * weights).sum() + (second * (r + 2)).sum())

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    for step in range(2):   # the grouped allreduce's backward gets a list of gradients
        x = torch.arange(3, dtype=torch.float64) + r + step
        w = torch.full((3,), 0.5 + r, dtype=torch.float64, requires_grad=True)
        w_eager = w.detach().clone().requires_grad_()
        compiled(x, w).backward()
        loss(x, w_eager).backward()
        exact(w.grad, w_eager.grad)


def _model(batch_norm):
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), batch_norm(4), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 3 * 3, 2)).double()


def _batch(step, rows):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(rows, 2, 5, 5, generator=g, dtype=torch.float64),
            torch.randn(rows, 2, generator=g, dtype=torch.float64))


def _train(model, optimizer, steps, rows_of, metric=None):
    for step in range(steps):
        x, y = _batch(step, sum(rows_of))
        start = sum(rows_of[:hvd.rank()])
        mine = slice(start, start + rows_of[hvd.rank()])
        optimizer.zero_grad()
        loss = model(x[mine], y[mine])
        loss.backward()
        optimizer.step()
        if metric is not None:
            metric.append(loss.detach())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_step_with_sync_batch_norm_and_distributed_optimizer_matches_eager_and_one_process(backend):
    # Ranks hold uneven shards; the loss is each rank's share of the global
    # batch's mean, so the averaged gradients are the one process's, and the
    # loss averaged across ranks inside the compiled graph is a metric.
    n = hvd.size()
    rows_of = [2 + r for r in range(n)]
    total_rows = sum(rows_of)

    def stepper(net):
        def forward(x, y):
            loss = torch.nn.functional.mse_loss(net(x), y, reduction="sum") * n / (total_rows * 2)
            return loss, hvd.allreduce(loss.detach(), name="metric")
        return forward

    reference = _model(torch.nn.BatchNorm2d)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x, y = _batch(step, total_rows)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()

    runs = {}
    for mode in ("eager", "compiled"):
        net = _model(hvd.SyncBatchNorm)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                             named_parameters=net.named_parameters())
        forward = stepper(net)
        if mode == "compiled":
            forward = torch.compile(forward, backend=backend, fullgraph=True)
        metrics = []
        _train(lambda x, y: _loss_and_metric(forward, x, y, metrics), optimizer, 3, rows_of)
        runs[mode] = (net, metrics)
    (eager, eager_metrics), (compiled, compiled_metrics) = runs["eager"], runs["compiled"]
    for p, q in zip(compiled.state_dict().values(), eager.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11)
    for p, q in zip(compiled.state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11)
    for got, expected in zip(compiled_metrics, eager_metrics):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


def _loss_and_metric(forward, x, y, metrics):
    loss, metric = forward(x, y)
    metrics.append(metric)
    return loss


def test_a_started_allreduce_and_the_work_before_its_wait_give_the_eager_values_in_one_graph():
    r, n = hvd.rank(), hvd.size()

    def step(x, w):
        handle = hvd.allreduce_async(x, op=hvd.Sum, name="overlap")
        local = (w @ w).sum()    # runs while the allreduce is in flight
        return hvd.synchronize(handle) + local

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    w = torch.eye(4, dtype=torch.float64)
    exact(compiled(torch.full((4,), float(r + 1), dtype=torch.float64), w),
          torch.full((4,), n * (n + 1) / 2 + 4, dtype=torch.float64))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_one_graph_with_symbolic_sizes_serves_every_size_with_the_eager_values(backend):
    # A step compiled once for any length (dynamic=True), as a model fed
    # batches of varying size is: every collective's fake kernel sees
    # symbolic sizes, no size recompiles, and the one graph gives each
    # size's eager values.
    r, n = hvd.rank(), hvd.size()

    def step(x):
        total = hvd.allreduce(x, op=hvd.Sum, name="sym.ar")
        rows = hvd.allgather(x[: r + 1], name="sym.ag")
        root = hvd.broadcast(x, root_rank=n - 1, name="sym.bc")
        spread = hvd.alltoall(x.repeat(n), name="sym.a2a")
        share = hvd.reducescatter(x.repeat(n), op=hvd.Sum, name="sym.rs")
        first, second = hvd.grouped_allreduce([x * 2, x[:1]], op=hvd.Max, name="sym.gar")
        inplace = hvd.allreduce_(x.clone(), op=hvd.Min, name="sym.ar_")
        return total, rows, root, spread, share, first, second, inplace

    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
    graphs = []
    torch._dynamo.reset()
    for length in (3, 5, 4):
        x = torch.arange(length, dtype=torch.float64) + 10 * r
        got = compiled(x)
        expected = step(x)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            exact(g, e)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[-1], "a size recompiled the step: %s" % graphs
    # What each rank computed, exactly, for the last length (4).
    base = torch.arange(4, dtype=torch.float64)
    exact(got[0], base * n + 10 * sum(range(n)))
    exact(got[1], torch.cat([base[: k + 1] + 10 * k for k in range(n)]))
    exact(got[2], base + 10 * (n - 1))
    exact(got[3], torch.cat([base + 10 * k for k in range(n)]))
    exact(got[4], base * n + 10 * sum(range(n)))
    exact(got[5], base * 2 + 20 * (n - 1))
    exact(got[6], torch.full((1,), 10.0 * (n - 1), dtype=torch.float64))
    exact(got[7], base)
