"""unison.torch beyond the shared grid (shared_grid.py, test_torch_grid.py):
non-contiguous tensors, the average flag, gradients, sparse handles and
errors, with exact values: every rank computes what every other rank
sent."""
import warnings

import pytest

torch = pytest.importorskip("torch")
import unison.torch as hvd  # noqa: E402

torch.set_num_threads(1)


def rank_values(shape, dtype, rank):
    """Small integers that differ per rank and per element: exact in every dtype."""
    n = 1
    for d in shape:
        n *= d
    return ((torch.arange(n) % 5) + rank + 1).to(dtype).reshape(shape)


def exact(actual, expected):
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual, expected), (actual, expected)


def test_allreduce_average_flag_and_default():
    mine = torch.full((4,), float(hvd.rank()))
    n = hvd.size()
    exact(hvd.allreduce(mine, name="ar.default"), torch.full((4,), (n - 1) / 2))
    exact(hvd.allreduce(mine, average=False, name="ar.flag"), torch.full((4,), float(n * (n - 1) / 2)))


def test_allreduce_async_in_place_and_non_contiguous():
    n = hvd.size()
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + hvd.rank()
    transposed = base.clone().t()  # non-contiguous view
    assert not transposed.is_contiguous()
    handle = hvd.allreduce_async_(transposed, op=hvd.Sum, name="ar.noncontig")
    assert hvd.synchronize(handle) is transposed
    expected = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * n + n * (n - 1) / 2).t()
    exact(transposed, expected)
    x = torch.ones(5) * (hvd.rank() + 1)
    h = hvd.allreduce_async(x, op=hvd.Sum, name="ar.async")
    out = hvd.synchronize(h)
    assert hvd.poll(h)
    exact(out, torch.full((5,), float(n * (n + 1) / 2)))
    exact(x, torch.ones(5) * (hvd.rank() + 1))  # input untouched
    y = torch.ones(5)
    assert hvd.allreduce_(y, op=hvd.Sum, name="ar.inplace") is y
    exact(y, torch.full((5,), float(n)))
    # The blocking form on a non-contiguous tensor reduces a contiguous
    # copy and writes it back.
    again = base.clone().t()
    assert hvd.allreduce_(again, op=hvd.Sum, name="ar.noncontig.blocking") is again
    exact(again, expected)


def test_alltoall_even_returns_output_only():
    r, n = hvd.rank(), hvd.size()
    out = hvd.alltoall(torch.full((n,), r), name="a2a.even")
    exact(out, torch.arange(n))


def test_gradients_of_each_differentiable_op():
    r, n = hvd.rank(), hvd.size()
    # allreduce Sum: d/dx sum_k(x_k) seen from each rank's loss sum -> sum of grads.
    x = torch.full((3,), float(r + 1), requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum, name="g.ar") * (r + 1)).sum().backward()
    exact(x.grad, torch.full((3,), float(n * (n + 1) / 2)))
    # allreduce Average: grads averaged.
    x = torch.ones(3, requires_grad=True)
    (hvd.allreduce(x, name="g.avg") * (r + 1)).sum().backward()
    exact(x.grad, torch.full((3,), (n + 1) / 2))
    # allgather: this rank's rows of the rank-averaged gradient.
    x = torch.ones(r + 1, 2, requires_grad=True)
    gathered = hvd.allgather(x, name="g.ag")
    weights = torch.arange(gathered.shape[0], dtype=torch.float32).reshape(-1, 1) * (r + 1)
    (gathered * weights).sum().backward()
    offset = sum(k + 1 for k in range(r))
    expected_rows = torch.arange(offset, offset + r + 1, dtype=torch.float32).reshape(-1, 1) * ((n + 1) / 2)
    exact(x.grad, expected_rows.expand(-1, 2).contiguous())
    # broadcast: root gets the averaged gradient, others zero.
    x = torch.ones(2, requires_grad=True)
    (hvd.broadcast(x, 1, name="g.bc") * (r + 1)).sum().backward()
    exact(x.grad, torch.full((2,), (n + 1) / 2 if r == 1 else 0.0))
    # alltoall: the gradient goes back where the rows came from.
    x = torch.ones(n, 1, requires_grad=True)
    out = hvd.alltoall(x, name="g.a2a")
    (out * (r + 1)).sum().backward()
    exact(x.grad, torch.arange(1, n + 1, dtype=torch.float32).reshape(n, 1))
    # reducescatter, as Horovod defines it: the gathered output gradients,
    # times the size for Sum, times the scale factors.
    x = torch.ones(n, 1, requires_grad=True)
    out = hvd.reducescatter(x, op=hvd.Sum, name="g.rs")
    (out * (r + 1)).sum().backward()
    exact(x.grad, n * torch.arange(1, n + 1, dtype=torch.float32).reshape(n, 1))
    x = torch.ones(n, 1, requires_grad=True)
    out = hvd.reducescatter(x, op=hvd.Average, name="g.rs.avg", prescale_factor=2.0, postscale_factor=3.0)
    (out * (r + 1)).sum().backward()
    exact(x.grad, 6 * torch.arange(1, n + 1, dtype=torch.float32).reshape(n, 1))
    # grouped allgather and reducescatter are differentiable too.
    xs = [torch.ones(r + 1, 2, requires_grad=True), torch.ones(n, 1, requires_grad=True)]
    gathered = hvd.grouped_allgather([xs[0], xs[0] * 2], name="g.gag")
    (gathered[0] * (r + 1)).sum().backward()
    exact(xs[0].grad, torch.full((r + 1, 2), (n + 1) / 2))
    scattered = hvd.grouped_reducescatter([xs[1]], op=hvd.Sum, name="g.grs")
    (scattered[0] * (r + 1)).sum().backward()
    exact(xs[1].grad, n * torch.arange(1, n + 1, dtype=torch.float32).reshape(n, 1))


def test_backward_through_each_output_of_a_grouped_op_one_after_another():
    """Horovod keeps shapes, not tensors, for a grouped op's backward: each
    output's own backward() works, not only the first."""
    r, n = hvd.rank(), hvd.size()
    x = torch.ones(r + 1, 2, requires_grad=True)
    y = torch.ones(2, 3, requires_grad=True)
    for g, weight in zip(hvd.grouped_allgather([x, y], name="g.each.gag"), [1.0, 2.0]):
        g.backward(torch.full(g.shape, weight * (r + 1)))
    exact(x.grad, torch.full((r + 1, 2), (n + 1) / 2))
    exact(y.grad, torch.full((2, 3), 2.0 * (n + 1) / 2))
    x = torch.ones(3, requires_grad=True)
    y = torch.ones(2, requires_grad=True)
    for g, weight in zip(hvd.grouped_allreduce([x, y], op=hvd.Sum, name="g.each.gar"), [1.0, 2.0]):
        g.backward(torch.full(g.shape, weight * (r + 1)))
    exact(x.grad, torch.full((3,), n * (n + 1) / 2))
    exact(y.grad, torch.full((2,), float(n * (n + 1))))
    x = torch.ones(n, 1, requires_grad=True)
    y = torch.ones(2 * n, requires_grad=True)
    for g, weight in zip(hvd.grouped_reducescatter([x, y], op=hvd.Sum, name="g.each.grs"), [1.0, 2.0]):
        g.backward(torch.full(g.shape, weight * (r + 1)))
    exact(x.grad, n * torch.arange(1, n + 1, dtype=torch.float32).reshape(n, 1))
    exact(y.grad, 2.0 * n * torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(2))


def test_collectives_compiled_into_one_graph_give_exact_values_and_the_eager_gradients():
    r, n = hvd.rank(), hvd.size()

    def step(x):
        total = hvd.allreduce(x * 2, op=hvd.Sum, name="compiled.ar")
        firsts = hvd.allgather(x[:1] + total[:1], name="compiled.ag")
        root = hvd.broadcast(x, root_rank=n - 1, name="compiled.bc")
        return (total.sum() + firsts.sum() + root.sum()) * (r + 1)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)   # no graph break, or this fails
    for i in range(2):   # the second call runs the graph already compiled
        x = torch.full((3,), float(r + i), requires_grad=True)
        with warnings.catch_warnings():
            # Dynamo warned that it could not trace the core's C calls when
            # it traced into unison; it traces only graph_ops' operators.
            warnings.filterwarnings("error", message=".*Dynamo.*")
            loss = compiled(x)
        loss.backward()
        ranks_values = sum(k + i for k in range(n))
        total = 2 * ranks_values
        assert float(loss.detach()) == (3 * total + ranks_values + n * total + 3 * (n - 1 + i)) * (r + 1)
        eager_x = x.detach().clone().requires_grad_()
        eager_loss = step(eager_x)
        eager_loss.backward()
        exact(loss.detach(), eager_loss.detach())
        exact(x.grad, eager_x.grad)


def test_a_call_into_unison_that_is_no_collective_is_a_graph_break_naming_it_under_fullgraph():
    # hvd.rank() asks the core through cffi, which Dynamo cannot trace: it
    # stays a graph break (compiled_code.py), and fullgraph says where.
    compiled = torch.compile(lambda x: x * hvd.rank(), backend="aot_eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="rank"):
        compiled(torch.ones(2))
    exact(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after.full"), torch.full((2,), float(hvd.size())))


def test_conjugate_and_negative_views_are_reduced_by_their_values():
    # torch keeps the sign of a conjugate view's values (z.conj()) and of a
    # negative one (z.conj().imag) in a flag, not in memory; the core reads
    # memory. Even ranks pass views, odd ones plain tensors of the same values.
    r, n = hvd.rank(), hvd.size()

    def values(k):
        return torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (k + 1)

    def as_passed(k, z):   # z.conj()'s values, as a view on even ranks
        return z.conj() if k % 2 == 0 else z.conj().resolve_conj()
    mine = as_passed(r, values(r))
    total = sum(values(k) for k in range(n)).conj()
    exact(hvd.allreduce(mine, op=hvd.Sum, name="conj.sum").resolve_conj(), total)
    exact(hvd.allgather(mine, name="conj.gather").resolve_conj(), torch.cat([values(k).conj() for k in range(n)]))
    exact(hvd.broadcast(mine, 0, name="conj.bcast").resolve_conj(), values(0).conj())
    buffer = as_passed(r, values(r).clone())
    assert hvd.allreduce_(buffer, op=hvd.Sum, name="conj.in.place") is buffer
    exact(buffer.resolve_conj(), total)
    # A negative view under an op whose result is not linear in the signs.
    z = values(r).clone()
    negative = z.conj().imag if r % 2 == 0 else z.conj().imag.resolve_neg()
    hvd.allreduce_(negative, op=hvd.Max, name="neg.max")
    # Rank k's values are [-2 (k + 1), k + 1]: the largest, rank 0's first and rank n-1's second.
    exact(negative.resolve_neg(), torch.tensor([-2.0, float(n)]))


def test_join_and_barrier():
    hvd.barrier()
    assert hvd.join() in range(hvd.size())


# ---- errors, raised on every rank ---------------------------------------------

def test_mismatched_shapes_fail_on_every_rank_and_job_goes_on():
    with pytest.raises(hvd.UnisonError) as info:
        hvd.allreduce(torch.ones(hvd.rank() + 1), name="bad.shape")
    message = str(info.value)
    assert "bad.shape" in message and "rank 0" in message and "rank 1" in message
    exact(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after.bad"), torch.full((2,), float(hvd.size())))


def test_mismatched_dtypes_fail_on_every_rank():
    dtype = torch.float32 if hvd.rank() == 0 else torch.float64
    with pytest.raises(hvd.UnisonError, match="dtype"):
        hvd.allreduce(torch.ones(2, dtype=dtype), name="bad.dtype")


def test_duplicate_name_in_flight():
    # Each rank in turn enqueues a name twice while the others hold back
    # behind a barrier, so the first op cannot have completed yet.
    for checker in range(hvd.size()):
        name = "dup.%d" % checker
        if hvd.rank() == checker:
            h = hvd.allreduce_async(torch.ones(1), name=name)
            with pytest.raises(ValueError, match="already in flight"):
                hvd.allreduce_async(torch.ones(1), name=name)
            hvd.barrier()
        else:
            hvd.barrier()
            h = hvd.allreduce_async(torch.ones(1), name=name)
        exact(hvd.synchronize(h), torch.ones(1))


def test_wrong_types_are_refused_before_negotiation():
    with pytest.raises(ValueError, match="torch.Tensor"):
        hvd.allreduce_async([1, 2, 3], name="not.tensor")
    with pytest.raises(ValueError, match="'float8' has dtype float8_e4m3fn, which unison does not"):
        hvd.allreduce_async(torch.ones(2).to(torch.float8_e4m3fn), name="float8")
    with pytest.raises(ValueError, match="scalar"):
        hvd.allgather(torch.tensor(1.0), name="scalar")
    with pytest.raises(ValueError, match="'nested' is a nested tensor; pass a dense one"):
        hvd.allreduce(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), name="nested")
    with pytest.raises(hvd.UnisonError, match="Sum, Average and Adasum"):
        x = torch.ones(2, requires_grad=True)
        hvd.allreduce(x, op=hvd.Max, name="max.grad").sum().backward()


def test_non_integer_splits_are_a_value_error():
    n = hvd.size()
    x = torch.ones(n, 2)
    for splits in ([1.5] * n, torch.full((n,), 1.0), ["1"] * n):
        with pytest.raises(ValueError, match="splits must be integers"):
            hvd.alltoall(x, splits=splits, name="a2a.bad.splits")
    # Nothing was sent: the same name runs right after.
    out, received = hvd.alltoall(x, splits=torch.ones(n, dtype=torch.int64), name="a2a.bad.splits")
    exact(received, torch.ones(n, dtype=torch.int32))


def test_sparse_allreduce_handle_is_callable_as_horovods():
    r, n = hvd.rank(), hvd.size()
    sparse = torch.sparse_coo_tensor(torch.tensor([[r]]), torch.tensor([[1.0, 2.0]]), (n, 2))
    handle = hvd.sparse_allreduce_async(sparse, "sparse.callable", hvd.Sum)
    result = handle()
    expected = torch.tensor([[1.0, 2.0]] * n)
    exact(result.to_dense(), expected)


def test_horovods_mpi_ops_module_path():
    from unison.torch.mpi_ops import Sum, allreduce_async_, synchronize
    t = torch.tensor([float(hvd.rank())])
    synchronize(allreduce_async_(t, op=Sum, name="mpi_ops.path"))
    assert t.item() == hvd.size() * (hvd.size() - 1) / 2
    assert hvd.mpi_ops.allreduce_async_ is allreduce_async_   # as after `import horovod.torch as hvd`
