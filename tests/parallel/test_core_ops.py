"""Every collective of unison.numpy x dtype x shape, with exact values."""
import numpy as np
import pytest

import unison
import unison.numpy as unp

ml_dtypes = pytest.importorskip("ml_dtypes")

DTYPES = [np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64, np.float16,
          ml_dtypes.bfloat16, np.float32, np.float64, np.bool_]
NUMERIC = [d for d in DTYPES if d is not np.bool_]
SHAPES = [(0,), (), (17,), (3, 4, 5)]
ROW_SHAPES = [(0, 3), (5,), (3, 4, 5)]  # ops that need a first dimension


def rank_values(shape, dtype, rank):
    """Small integers that differ per rank and per element: exact in every dtype."""
    n = int(np.prod(shape)) if shape else 1
    values = (np.arange(n) % 5) + rank + 1
    if dtype is np.bool_:
        return ((np.arange(n) + rank) % 2 == 0).reshape(shape)
    return values.astype(dtype).reshape(shape)


def every_rank(shape, dtype):
    return [rank_values(shape, dtype, r) for r in range(unison.size())]


def as_float(a):
    return np.asarray(a).astype(np.float64)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", NUMERIC, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ["Sum", "Average", "Min", "Max", "Product"])
def test_allreduce_every_op_dtype_shape(op, dtype, shape):
    mine = rank_values(shape, dtype, unison.rank())
    inputs = [as_float(v) for v in every_rank(shape, dtype)]
    n = unison.size()
    if op == "Sum":
        expected = sum(inputs)
    elif op == "Product":
        expected = np.prod(inputs, axis=0)
    elif op == "Min":
        expected = np.min(inputs, axis=0)
    elif op == "Max":
        expected = np.max(inputs, axis=0)
    else:
        total = sum(inputs)
        expected = np.trunc(total / n) if np.issubdtype(np.dtype(dtype), np.integer) else total / n
    expected = np.asarray(expected).astype(dtype)  # rounds once, as the core does
    result = unp.allreduce(mine, op=getattr(unison, op), name="ar.%s.%s.%s" % (op, np.dtype(dtype).name, shape))
    assert result.dtype == np.dtype(dtype) and result.shape == shape
    np.testing.assert_array_equal(as_float(result), as_float(expected))


@pytest.mark.parametrize("op,expected", [("Sum", np.any), ("Max", np.any), ("Min", np.all), ("Product", np.all)])
def test_allreduce_bool_means_any_or_all(op, expected):
    values = every_rank((9,), np.bool_)
    result = unp.allreduce(values[unison.rank()], op=getattr(unison, op), name="bool." + op)
    np.testing.assert_array_equal(result, expected(values, axis=0))


def test_allreduce_in_place_and_large_multi_round():
    # 3M floats is larger than one shared-memory round, so it goes in rounds.
    x = np.full(3_000_001, unison.rank() + 1, dtype=np.float32)
    x[::7] = 0.5
    out = unp.allreduce_(x, op=unison.Sum, name="inplace.large")
    assert out is x
    n = unison.size()
    expected = np.full(3_000_001, n * (n + 1) / 2, dtype=np.float32)
    expected[::7] = 0.5 * n
    np.testing.assert_array_equal(x, expected)



def test_fused_large_allreduces_in_and_out_of_place_across_rounds():
    # Uneven sizes, some in place and some not, fused into one stream that
    # spans more than one shared-memory round: each rank's reduced chunk
    # lands in several tensors, and boundaries fall mid-chunk.
    n, rank = unison.size(), unison.rank()
    sizes = [1_000_003, 17, 2_500_001, 333_333, 1_200_007]
    arrays = [np.arange(s, dtype=np.float64) % 1000 + rank for s in sizes]
    handles = []
    for i, a in enumerate(arrays):
        if i % 2:
            handles.append(unp.allreduce_async_(a, op=unison.Sum, name="fused.large.%d" % i))
        else:
            handles.append(unp.allreduce_async(a, op=unison.Sum, name="fused.large.%d" % i))
    for s, a, h in zip(sizes, arrays, handles):
        expected = (np.arange(s, dtype=np.float64) % 1000) * n + n * (n - 1) / 2
        np.testing.assert_array_equal(unp.synchronize(h), expected)

@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32])
def test_allreduce_prescale_and_postscale(dtype):
    mine = rank_values((11,), dtype, unison.rank())
    total = sum(as_float(v) for v in every_rank((11,), dtype))
    result = unp.allreduce(mine, op=unison.Sum, prescale_factor=2.0, postscale_factor=0.25,
                           name="scaled.%s" % np.dtype(dtype).name)
    np.testing.assert_array_equal(as_float(result), total * 2.0 * 0.25 if dtype is not np.int32
                                  else np.trunc(total * 2.0 * 0.25))


def test_average_is_the_default_op_as_in_horovod():
    result = unp.allreduce(np.full(4, float(unison.rank())), name="default.op")
    np.testing.assert_array_equal(result, np.full(4, (unison.size() - 1) / 2))


def test_one_name_reused_with_other_dtype_shape_op_and_factors():
    # The front end keeps a filled options struct per distinct op; a name
    # that comes back with anything changed must not run with the old one.
    n, rank = unison.size(), unison.rank()
    total = n * (n - 1) / 2
    for _ in range(2):  # the second pass finds every variant already kept
        variants = [
            (np.float32, (3,), unison.Sum, 1.0, 1.0, np.full(3, total + n)),
            (np.float64, (2, 2), unison.Sum, 1.0, 1.0, np.full((2, 2), total + n)),
            (np.float64, (2, 2), unison.Max, 1.0, 1.0, np.full((2, 2), float(n))),
            (np.float64, (2, 2), unison.Sum, 2.0, 0.5, np.full((2, 2), total + n)),
            (np.float64, (2, 2), unison.Sum, 3.0, 1.0, np.full((2, 2), 3 * (total + n))),
            (np.int32, (5,), unison.Min, 1.0, 1.0, np.full(5, 1)),
        ]
        for dtype, shape, op, pre, post, expected in variants:
            mine = np.full(shape, rank + 1, dtype=dtype)
            result = unp.allreduce(mine, op=op, prescale_factor=pre, postscale_factor=post, name="reused")
            assert result.dtype == np.dtype(dtype) and result.shape == shape
            np.testing.assert_array_equal(result, expected.astype(dtype))


def test_thousand_small_async_allreduces_fused():
    n = unison.size()
    handles = [unp.allreduce_async(np.full(7, i + unison.rank(), dtype=np.float32), op=unison.Sum,
                                   name="many.%d" % i) for i in range(1000)]
    for i, h in enumerate(handles):
        np.testing.assert_array_equal(unp.synchronize(h), np.full(7, n * i + n * (n - 1) / 2, dtype=np.float32))
    # The same names again go through the response cache.
    handles = [unp.allreduce_async(np.full(7, i, dtype=np.float32), op=unison.Sum, name="many.%d" % i)
               for i in range(1000)]
    for i, h in enumerate(handles):
        np.testing.assert_array_equal(unp.synchronize(h), np.full(7, n * i, dtype=np.float32))


def test_ranks_enqueue_names_in_different_orders():
    names = ["order.%d" % i for i in range(20)]
    rng = np.random.default_rng(unison.rank() + 7)
    order = list(rng.permutation(len(names)))
    handles = {}
    for i in order:
        handles[i] = unp.allreduce_async(np.full(3, i * (unison.rank() + 1), dtype=np.int64), op=unison.Sum,
                                         name=names[i])
    n = unison.size()
    for i in range(len(names)):
        np.testing.assert_array_equal(unp.synchronize(handles[i]), np.full(3, i * n * (n + 1) // 2))


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_allgather_ranks_contribute_different_first_dims(dtype, shape):
    def contribution(r):
        rows = shape[0] + r if shape[0] else 0  # empty everywhere stays empty
        return rank_values((rows,) + shape[1:], dtype, r)

    result = unp.allgather(contribution(unison.rank()), name="ag.%s.%s" % (np.dtype(dtype).name, shape))
    expected = np.concatenate([contribution(r) for r in range(unison.size())])
    assert result.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(as_float(result), as_float(expected))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_broadcast_from_every_root(dtype, shape):
    for root in range(unison.size()):
        mine = rank_values(shape, dtype, unison.rank())
        result = unp.broadcast(mine, root, name="bc.%s.%s.%d" % (np.dtype(dtype).name, shape, root))
        np.testing.assert_array_equal(as_float(result), as_float(rank_values(shape, dtype, root)))
        np.testing.assert_array_equal(as_float(mine), as_float(rank_values(shape, dtype, unison.rank())))


def test_broadcast_in_place_large():
    x = np.full(2_500_000, unison.rank(), dtype=np.float64)
    unp.broadcast_(x, 1, name="bc.inplace")
    np.testing.assert_array_equal(x, np.ones(2_500_000))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_alltoall_with_splits(dtype):
    n, me = unison.size(), unison.rank()
    # Rank s sends (s + d) % 3 rows to rank d; each row is tagged s*100 + d.
    def sends(s):
        rows = [np.full((((s + d) % 3), 2), (s * 10 + d) % 127) for d in range(n)]
        return np.concatenate(rows).astype(dtype), [(s + d) % 3 for d in range(n)]
    data, splits = sends(me)
    out, received = unp.alltoall(data, splits=splits, name="a2a.%s" % np.dtype(dtype).name)
    expected = np.concatenate([np.full((((s + me) % 3), 2), (s * 10 + me) % 127) for s in range(n)]).astype(dtype)
    np.testing.assert_array_equal(received, [(s + me) % 3 for s in range(n)])
    np.testing.assert_array_equal(as_float(out), as_float(expected))


def test_alltoall_even_split_returns_only_output():
    n, me = unison.size(), unison.rank()
    out = unp.alltoall(np.arange(n * 2, dtype=np.int32).reshape(n, 2) + 100 * me, name="a2a.even")
    expected = np.stack([np.array([2 * me, 2 * me + 1]) + 100 * s for s in range(n)])
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("rows", [0, 1, 7, 12])
@pytest.mark.parametrize("dtype", NUMERIC, ids=lambda d: np.dtype(d).name)
def test_reducescatter_uneven_rows(dtype, rows):
    n, me = unison.size(), unison.rank()
    shape = (rows, 3)
    total = sum(as_float(v) for v in every_rank(shape, dtype))
    result = unp.reducescatter(rank_values(shape, dtype, me), op=unison.Sum,
                               name="rs.%s.%d" % (np.dtype(dtype).name, rows))
    counts = [rows // n + (1 if r < rows % n else 0) for r in range(n)]
    start = sum(counts[:me])
    np.testing.assert_array_equal(as_float(result), total[start:start + counts[me]].astype(dtype).astype(np.float64))


def test_reducescatter_average_default():
    n = unison.size()
    x = np.full((n * 2, 2), float(unison.rank()))
    np.testing.assert_array_equal(unp.reducescatter(x, name="rs.avg"), np.full((2, 2), (n - 1) / 2))


def test_barrier_and_join():
    unp.barrier()
    last = unp.join()
    assert 0 <= last < unison.size()


def test_joined_rank_contributes_zeros():
    n, me = unison.size(), unison.rank()
    if me == 0:
        last = unp.join()
        assert last != 0
    else:
        result = unp.allreduce(np.full(5, float(me)), op=unison.Sum, name="join.sum")
        np.testing.assert_array_equal(result, np.full(5, float(sum(range(1, n)))))
        last = unp.join()
    # Everyone agrees who joined last, and work goes on normally afterwards.
    assert unp.allreduce(np.array([last]), op=unison.Max, name="join.last")[0] == last
    assert unp.allreduce(np.ones(2), op=unison.Sum, name="after.join")[0] == n


def test_while_a_rank_has_joined_only_allreduce_runs():
    # As Horovod: allgather, broadcast, alltoall and reducescatter fail on
    # every rank that called them, naming the joined rank; allreduce goes on
    # with zeros from it, and the job is in step afterwards.
    n, me = unison.size(), unison.rank()
    if me == 0:
        last = unp.join()
    else:
        attempts = [
            lambda: unp.allgather(np.ones((me, 2)), name="joined.allgather"),
            lambda: unp.broadcast(np.ones(3), root_rank=1, name="joined.broadcast"),
            lambda: unp.broadcast(np.ones(3), root_rank=0, name="joined.broadcast.from.joined"),
            lambda: unp.alltoall(np.ones((n, 2)), name="joined.alltoall"),
            lambda: unp.reducescatter(np.ones((n, 2)), name="joined.reducescatter"),
        ]
        for attempt in attempts:
            with pytest.raises(unison.MismatchError, match="rank 0 has joined; while a rank has joined only allreduce"):
                attempt()
        result = unp.allreduce(np.full(2, float(me)), op=unison.Sum, name="joined.allreduce")
        np.testing.assert_array_equal(result, np.full(2, float(sum(range(1, n)))))
        last = unp.join()
    # The same last rank everywhere, and every collective works again.
    assert unp.allgather(np.array([last]), name="joined.last").tolist() == [last] * n
    assert last != 0
    np.testing.assert_array_equal(unp.broadcast(np.arange(3) + me, root_rank=0, name="joined.after"), np.arange(3))


def test_shutdown_then_init_again():
    unison.shutdown()
    assert not unison.is_initialized()
    unison.init()
    n = unison.size()
    np.testing.assert_array_equal(unp.allreduce(np.ones(3), op=unison.Sum, name="reinit"), np.full(3, n))
