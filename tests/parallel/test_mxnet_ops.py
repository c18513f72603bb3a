"""unison.mxnet beyond the shared grid (shared_grid.py, test_mxnet_grid.py),
from one rank's point of view: every rank computes what every other rank
sent, exactly. Inputs are the
results of pending MXNet ops on purpose, so the engine ordering is tested."""
import pytest

mx = pytest.importorskip("mxnet")
import numpy as np  # noqa: E402

import unison  # noqa: E402
import unison.mxnet as hvd  # noqa: E402


def filled(shape, dtype, rank):
    """A pending engine op producing rank-specific values."""
    base = mx.nd.arange(int(np.prod(shape)), dtype="float64").reshape(shape) % 7
    return (base + rank + 1).astype(dtype)


def expected(shape, dtype, rank):
    return ((np.arange(int(np.prod(shape))).reshape(shape) % 7) + rank + 1).astype(dtype)


@pytest.mark.parametrize("op,fn", [(hvd.Min, np.minimum.reduce), (hvd.Max, np.maximum.reduce),
                                   (hvd.Product, np.multiply.reduce)], ids=["min", "max", "product"])
def test_allreduce_min_max_product(op, fn):
    shape = (2, 5)
    got = hvd.allreduce(filled(shape, "int64", hvd.rank()), op=op).asnumpy()
    np.testing.assert_array_equal(got, fn([expected(shape, "int64", r) for r in range(hvd.size())]))


def test_allreduce_average_and_scale_factors():
    n = hvd.size()
    total = sum(expected((6,), "float64", r) for r in range(n))
    np.testing.assert_allclose(hvd.allreduce(filled((6,), "float64", hvd.rank())).asnumpy(), total / n,
                               rtol=0, atol=1e-12)
    got = hvd.allreduce(filled((6,), "float64", hvd.rank()), op=hvd.Sum, prescale_factor=0.5,
                        postscale_factor=3.0)
    np.testing.assert_allclose(got.asnumpy(), total * 1.5, rtol=0, atol=1e-12)


def test_grouped_allreduce_and_in_place():
    shapes = [(3,), (2, 2), (7,)]
    n = hvd.size()
    got = hvd.grouped_allreduce([filled(s, "float32", hvd.rank()) for s in shapes], op=hvd.Sum)
    for s, g in zip(shapes, got):
        np.testing.assert_array_equal(g.asnumpy(), sum(expected(s, "float32", r) for r in range(n)))
    tensors = [filled(s, "int32", hvd.rank()) for s in shapes]
    assert hvd.grouped_allreduce_(tensors, op=hvd.Max) is tensors
    for s, t in zip(shapes, tensors):
        np.testing.assert_array_equal(t.asnumpy(), expected(s, "int32", n - 1))


def test_many_allreduces_in_flight_in_the_engine():
    # The engine may start independent pushes in any order; names fixed in
    # program order keep the ranks paired.
    tensors = [filled((4,), "float32", hvd.rank()) * (i + 1) for i in range(50)]
    got = hvd.grouped_allreduce(tensors, op=hvd.Sum)
    for i, g in enumerate(got):
        np.testing.assert_array_equal(g.asnumpy(), sum(expected((4,), "float32", r) for r in range(hvd.size()))
                                      * (i + 1))


def test_alltoall_with_and_without_splits():
    n, r = hvd.size(), hvd.rank()
    t = mx.nd.arange(2 * n) + 100 * r
    got = hvd.alltoall(t).asnumpy()
    np.testing.assert_array_equal(got, np.concatenate([np.arange(2 * r, 2 * r + 2) + 100 * q for q in range(n)]))
    splits = [q + 1 for q in range(n)]                   # rank q receives q + 1 rows from each
    t = mx.nd.array(np.arange(sum(splits)) + 100 * r)
    got, received = hvd.alltoall(t, splits=splits)
    start = sum(splits[:r])
    np.testing.assert_array_equal(got.asnumpy(), np.concatenate([np.arange(start, start + r + 1) + 100 * q
                                                                 for q in range(n)]))
    np.testing.assert_array_equal(received.asnumpy(), [r + 1] * n)
    with pytest.raises(ValueError, match="splits must be integers"):
        hvd.alltoall(t, splits=[1.5] * n, name="a2a.float.splits")


def test_grouped_allgather_and_reducescatter():
    n, r = hvd.size(), hvd.rank()
    a = mx.nd.ones((r + 1, 2)) * r
    b = mx.nd.arange(3) + 10 * r
    ga, gb = hvd.grouped_allgather([a, b], name="mx.gag")
    np.testing.assert_array_equal(ga.asnumpy(), np.concatenate([np.full((q + 1, 2), q) for q in range(n)]))
    np.testing.assert_array_equal(gb.asnumpy(), np.concatenate([np.arange(3) + 10 * q for q in range(n)]))
    x = mx.nd.array(np.arange(2 * n * 3).reshape(2 * n, 3) + r, dtype="float32")
    (mine,) = hvd.grouped_reducescatter([x], op=hvd.Sum, name="mx.grs")
    total = sum(np.arange(2 * n * 3).reshape(2 * n, 3) + q for q in range(n))
    np.testing.assert_array_equal(mine.asnumpy(), total[2 * r:2 * r + 2])


def test_fp16_compression_restores_dtype():
    x = mx.nd.ones((4,), dtype="float32") * (hvd.rank() + 1)
    out = hvd.allreduce(x, op=hvd.Sum, name="mx.fp16", compression=hvd.Compression.fp16)
    n = hvd.size()
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out.asnumpy(), np.full(4, n * (n + 1) / 2))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_reducescatter_uneven_rows(dtype):
    n, r = hvd.size(), hvd.rank()
    rows = 2 * n + 1
    total = sum(expected((rows, 2), "float64", q) for q in range(n))
    got = hvd.reducescatter(filled((rows, 2), dtype, r), op=hvd.Sum).asnumpy()
    start = sum(rows // n + (1 if q < rows % n else 0) for q in range(r))
    np.testing.assert_array_equal(got, total[start:start + got.shape[0]].astype(dtype))
    assert got.shape[0] == rows // n + (1 if r < rows % n else 0)


def test_barrier_join_and_objects():
    hvd.barrier()
    assert hvd.join() in range(hvd.size())
    assert hvd.broadcast_object({"rank": hvd.rank(), "x": [1, 2]}, root_rank=1) == {"rank": 1, "x": [1, 2]}
    assert hvd.allgather_object(("r", hvd.rank())) == [("r", q) for q in range(hvd.size())]


def test_mismatched_shape_fails_on_every_rank_and_the_next_op_works():
    with pytest.raises(unison.MismatchError, match=r"'mx\.bad\.shape'.*shape.*rank 0 \[2\].*rank 1 \[3\]"):
        hvd.allreduce(mx.nd.ones((hvd.rank() + 2,)), name="mx.bad.shape")
    np.testing.assert_array_equal(hvd.allreduce(mx.nd.ones(2), op=hvd.Sum).asnumpy(), [hvd.size()] * 2)


def test_mismatched_dtype_fails_on_every_rank():
    dtype = "float32" if hvd.rank() == 0 else "float64"
    with pytest.raises(unison.MismatchError, match="dtype"):
        hvd.allreduce(mx.nd.ones((3,), dtype=dtype), name="mx.bad.dtype")


def test_wrong_types_are_refused_at_the_call():
    with pytest.raises(unison.InvalidArgumentError, match="must be an mxnet NDArray"):
        hvd.allreduce(np.ones(3))
    # bool is one of the shared dtypes: Sum means "any", as in every front end.
    mine = mx.nd.array([hvd.rank() == 0, False, True], dtype="bool")
    np.testing.assert_array_equal(hvd.allreduce(mine, op=hvd.Sum, name="mx.bool").asnumpy(), [True, False, True])
    with pytest.raises(unison.InvalidArgumentError, match="must be an mxnet NDArray"):
        hvd.broadcast_([1, 2], root_rank=0)


def test_horovods_mpi_ops_module_path():
    from unison.mxnet.mpi_ops import Sum, allreduce_, rank, size
    t = mx.nd.array([float(rank())], dtype="float64")
    allreduce_(t, op=Sum, name="mpi_ops.path")
    assert t.asnumpy()[0] == size() * (size() - 1) / 2
    # As after `import horovod.mxnet as hvd`: the module and split_list are attributes.
    assert hvd.mpi_ops.allreduce_ is allreduce_
    assert hvd.split_list([1, 2, 3], 2) == [[1, 2], [3]]


# ---- oneDNN's blocked layouts ------------------------------------------------
# MXNet's PyPI build keeps a convolution's weights in a blocked oneDNN layout
# after a forward outside autograd.record(), and may leave its outputs so.
# Taking such an array's address on MXNet's engine thread used to wait there
# forever for a reorder queued behind the collective itself.

def _convolution(rank):
    """A 3x3 convolution whose weights count up from 1000 * rank: small
    integers, so every sum below is exact in float32."""
    conv = mx.gluon.nn.Conv2D(8, 3, in_channels=2, use_bias=False)
    conv.initialize()
    weight = conv.weight.data()
    weight[:] = mx.nd.arange(weight.size).reshape(weight.shape) % 5 + 1000 * rank
    return conv


def _images(rank):
    return mx.nd.arange(2 * 2 * 6 * 6).reshape((2, 2, 6, 6)) % 3 + rank


def test_broadcast_parameters_after_an_inference_forward_of_a_convolution():
    root = hvd.size() - 1
    conv = _convolution(hvd.rank())
    conv(_images(hvd.rank()))  # still queued: the broadcast waits for it, and for the layout change it queues
    hvd.broadcast_parameters(conv.collect_params(), root_rank=root)
    np.testing.assert_array_equal(conv.weight.data().asnumpy(), _convolution(root).weight.data().asnumpy())


def test_allreduce_of_a_pending_convolution_output_in_inference():
    mine = _convolution(0)(_images(hvd.rank()))
    everyone = sum(_convolution(0)(_images(r)).asnumpy() for r in range(hvd.size()))
    np.testing.assert_array_equal(hvd.allreduce(mine, op=hvd.Sum, name="mx.conv.output").asnumpy(), everyone)


def test_training_after_an_evaluation_pass_keeps_every_rank_equal():
    conv = _convolution(0)
    conv(_images(hvd.rank()))  # evaluation: the weights turn blocked
    trainer = hvd.DistributedTrainer(conv.collect_params(), "sgd", {"learning_rate": 0.001})
    with mx.autograd.record():
        loss = conv(_images(hvd.rank())).sum()
    loss.backward()
    trainer.step(1)
    # The gradient of the sum is the sum of the input windows; the trainer
    # averages it over the ranks.
    reference = _convolution(0)
    grads = []
    for r in range(hvd.size()):
        with mx.autograd.record():
            total = reference(_images(r)).sum()
        total.backward()
        grads.append(reference.weight.grad().asnumpy().astype("float64"))
    start = _convolution(0).weight.data().asnumpy().astype("float64")
    np.testing.assert_allclose(conv.weight.data().asnumpy(), start - 0.001 * sum(grads) / hvd.size(), rtol=1e-6)
    gathered = hvd.allgather(conv.weight.data().expand_dims(0), name="mx.conv.weights").asnumpy()
    for other in gathered:
        np.testing.assert_array_equal(other, gathered[0])


def test_a_blocked_array_on_the_engine_thread_is_an_error_not_a_wait():
    from unison.mxnet import engine
    conv = _convolution(hvd.rank())
    conv(_images(hvd.rank()))
    mx.nd.waitall()
    weight = conv.weight.data()
    with pytest.raises(unison.InvalidArgumentError, match=r"mx\.blocked: MXNet holds this array in a blocked oneDNN"):
        engine.data_pointer(weight, "mx.blocked")
    engine.plain_layout([weight])  # what every public collective does first, on the caller's thread
    assert engine.data_pointer(weight, "mx.blocked") != 0
    np.testing.assert_array_equal(hvd.allreduce(weight, op=hvd.Max, name="mx.blocked").asnumpy(),
                                  _convolution(hvd.size() - 1).weight.data().asnumpy())


# ---- an MXNet operator that fails before the collective ----------------------
# MXNet's CPU build has no float16 FullyConnected: the operator fails when
# the engine runs it, and the engine then skips every operator that depends
# on its output without running it, the collective included.

def _failing_float16_gradients():
    net = mx.gluon.nn.Dense(2, in_units=3)
    net.initialize()
    net.cast("float16")
    with mx.autograd.record():
        loss = net(mx.nd.ones((2, 3), dtype="float16")).sum()
    loss.backward()
    return net


def _drain_mxnets_error():
    # MXNet raises an operator's failure once more, at the next waitall().
    try:
        mx.nd.waitall()
    except mx.base.MXNetError:
        pass


def test_a_gradient_allreduce_that_mxnet_skips_raises_instead_of_waiting():
    net = _failing_float16_gradients()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    with pytest.raises(mx.base.MXNetError, match=r"unison: trainer\.\d did not run: MXNet skipped it because an "
                                                 r"operator it depends on failed"):
        trainer.step(2)
    _drain_mxnets_error()
    np.testing.assert_array_equal(hvd.allreduce(mx.nd.ones(2), op=hvd.Sum, name="mx.after.skip").asnumpy(),
                                  [hvd.size()] * 2)


def test_a_collective_on_a_failed_operators_output_raises_its_error():
    failed = mx.nd.FullyConnected(mx.nd.ones((2, 3), dtype="float16"), mx.nd.ones((4, 3), dtype="float16"),
                                  no_bias=True, num_hidden=4)
    with pytest.raises(mx.base.MXNetError, match="float16 fully connected"):
        hvd.allreduce_(failed, name="mx.failed.input")
    _drain_mxnets_error()
    np.testing.assert_array_equal(hvd.allreduce(mx.nd.ones(2), op=hvd.Sum, name="mx.after.failure").asnumpy(),
                                  [hvd.size()] * 2)


@pytest.mark.parametrize("interrupted", ["before the engine starts it", "while it runs in the core"])
def test_an_interrupted_wait_still_gives_mxnet_the_ops_completion(interrupted, monkeypatch):
    # The caller completes its own op (unison.mxnet.engine); a Ctrl-C that
    # ends its wait hands the op to the completer thread, so MXNet still
    # lets go of the array: reading it waits for the op and gets its result.
    from unison.mxnet import engine, ops
    n = 600
    # The product of a pending matrix multiply (tens of milliseconds): the
    # engine cannot start the allreduce on it before the wait is interrupted.
    x = mx.nd.dot(mx.nd.ones((n, n)) * (hvd.rank() + 1), mx.nd.ones((n, n)))
    op = ops._allreduce_async(x, x, "interrupted.%s" % interrupted, hvd.Sum, 1.0, 1.0, hvd.global_process_set, 0,
                              settle=False)
    started_when_interrupted = []
    if interrupted == "before the engine starts it":
        def interrupt(timeout):
            started_when_interrupted.append(op._core is not None)
            raise KeyboardInterrupt
        op._started.wait = interrupt
    else:
        wait_core, interrupts = engine._wait_core, [KeyboardInterrupt]

        def wait_once_interrupted(handle):   # the caller's wait is interrupted; the completer's is not
            started_when_interrupted.append(op._core is not None)
            if interrupts:
                raise interrupts.pop()
            return wait_core(handle)
        monkeypatch.setattr(engine, "_wait_core", wait_once_interrupted)
    with pytest.raises(KeyboardInterrupt):
        op.wait()
    assert started_when_interrupted[0] == (interrupted != "before the engine starts it")
    total = n * sum(r + 1 for r in range(hvd.size()))
    assert (x.asnumpy() == total).all()
    assert hvd.allreduce(mx.nd.ones((2,)), op=hvd.Sum, name="after.interrupt").asnumpy().tolist() == [hvd.size()] * 2
