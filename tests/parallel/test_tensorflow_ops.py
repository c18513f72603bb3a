"""unison.tensorflow beyond the shared grid (shared_grid.py,
test_tensorflow_grid.py), from one rank's point of view: every rank
computes what every other rank sent, exactly, eagerly, inside
tf.function and in TF1 graphs run by a Session; the gradients Horovod
defines; errors on every rank."""
import os
import threading

import pytest

tf = pytest.importorskip("tensorflow")
import numpy as np  # noqa: E402

import unison  # noqa: E402
from unison import adapter_extension  # noqa: E402
import unison.tensorflow as hvd  # noqa: E402
from unison.tensorflow import ops as tf_ops  # noqa: E402

hvd.init()
N, RANK = hvd.size(), hvd.rank()

MODES = ["eager", "function", "tf1-session"]
# Allreduce alone also lowers to XLA (tf_adapter/kernels_xla.cc).
ALLREDUCE_MODES = MODES + ["xla"]


def run(mode, fn, *args):
    """fn(*args) eagerly, traced into a tf.function and run, or built into a
    TF1 graph, the arguments fed to its placeholders, and run by a
    tf.compat.v1.Session."""
    if mode == "eager":
        return fn(*args)
    if mode == "function":
        return tf.function(fn)(*args)
    if mode == "xla":
        return tf.function(fn, jit_compile=True)(*args)
    with tf.Graph().as_default() as graph:
        fed = [tf.compat.v1.placeholder(a.dtype, a.shape) for a in args]
        out = fn(*fed)
        # Some of these graphs have ten collective nodes that can run at
        # once (test_gradients), each holding an inter-op thread while it
        # waits: a session needs a thread for each (docs/tensorflow.md, "TF1 scripts").
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=12, use_per_session_threads=True)
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            return session.run(out, dict(zip(fed, [a.numpy() for a in args])))


def values(shape, rank, dtype="float64"):
    base = (np.arange(int(np.prod(shape))).reshape(shape) % 5) + rank + 1
    return base.astype(tf.as_dtype(dtype).as_numpy_dtype)


def as_float(t):
    return np.asarray(tf.cast(t, tf.float64))


@pytest.mark.parametrize("mode", ALLREDUCE_MODES)
def test_allreduce_bool_and_scaling(mode):
    flags = tf.constant([RANK == 0, True, False])
    np.testing.assert_array_equal(run(mode, lambda x: hvd.allreduce(x, op=hvd.Max), flags), [True, True, False])
    np.testing.assert_array_equal(run(mode, lambda x: hvd.allreduce(x, op=hvd.Min), flags), [N == 1, True, False])
    x = tf.constant(values((4,), RANK))
    out = run(mode, lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0), x)
    np.testing.assert_allclose(out, 1.5 * sum(values((4,), r) for r in range(N)), rtol=1e-12)


@pytest.mark.parametrize("mode", ALLREDUCE_MODES)
def test_grouped_allreduce_and_fp16_compression(mode):
    tensors = [tf.constant(values((3,), RANK)), tf.constant(values((2, 2), RANK, "float32")),
               tf.constant(values((4,), RANK, "int32"))]
    out = run(mode, lambda a, b, c: hvd.grouped_allreduce([a, b, c], op=hvd.Sum), *tensors)
    for o, t in zip(out, tensors):
        want = sum(values(t.shape, r) for r in range(N))
        np.testing.assert_array_equal(as_float(o), want)
        assert o.dtype == t.dtype
    x = tf.constant(values((6,), RANK, "float32"))
    out = run(mode, lambda t: hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16), x)
    assert out.dtype == tf.float32
    np.testing.assert_array_equal(out, sum(values((6,), r) for r in range(N)))


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_and_variables(mode):
    for root in range(N):
        for dtype in ["int8", "uint16", "uint32", "uint64", "int64", "bfloat16", "float64", "bool"]:
            mine = tf.constant(values((2, 3), RANK).astype(tf.as_dtype(dtype).as_numpy_dtype))
            out = run(mode, lambda x: hvd.broadcast(x, root), mine)
            np.testing.assert_array_equal(np.asarray(out), values((2, 3), root).astype(
                tf.as_dtype(dtype).as_numpy_dtype))
    def make_variables():
        return [tf.Variable(values((3,), RANK)), tf.Variable(np.int64(RANK)),
                tf.Variable(np.array([RANK, 7], dtype=np.uint32))]   # Keras keeps seed state in uint32
    if mode == "tf1-session":
        with tf.Graph().as_default() as graph:
            variables = make_variables()
            assign = hvd.broadcast_variables(variables, root_rank=N - 1)
            with tf.compat.v1.Session(graph=graph) as session:
                session.run([v.initializer for v in variables])
                session.run(assign)
                got = session.run(variables)
    else:
        variables = make_variables()
        run(mode, lambda: hvd.broadcast_variables(variables, root_rank=N - 1) and None)
        got = [v.numpy() for v in variables]
    np.testing.assert_array_equal(got[0], values((3,), N - 1))
    assert got[1] == N - 1
    np.testing.assert_array_equal(got[2], [N - 1, 7])


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_with_and_without_splits(mode):
    # Rank r sends r + 1 + i rows of value 10 r + i to rank i.
    splits = [RANK + 1 + i for i in range(N)]
    rows = np.concatenate([np.full(s, 10 * RANK + i) for i, s in enumerate(splits)]).astype(np.float32)
    mine = tf.constant(np.stack([rows, -rows], axis=1))
    out, received = run(mode, lambda x, s: hvd.alltoall(x, splits=s), mine, tf.constant(splits, tf.int32))
    want = np.concatenate([np.full(r + 1 + RANK, 10 * r + RANK) for r in range(N)])
    np.testing.assert_array_equal(out[:, 0], want)
    np.testing.assert_array_equal(out[:, 1], -want)
    np.testing.assert_array_equal(received, [r + 1 + RANK for r in range(N)])
    even = run(mode, lambda x: hvd.alltoall(x), tf.constant(np.repeat(np.arange(N) + 100 * RANK, 2)))
    np.testing.assert_array_equal(even, np.repeat(np.arange(N) * 100 + RANK, 2))


@pytest.mark.parametrize("mode", MODES)
def test_reducescatter_sum_average_grouped(mode):
    rows = 2 * N + 1   # does not divide: the first rank takes one more row
    mine_rows = rows // N + (1 if RANK < rows % N else 0)
    start = RANK * (rows // N) + min(RANK, rows % N)
    full = [values((rows, 2), r) for r in range(N)]
    out = run(mode, lambda x: hvd.reducescatter(x, op=hvd.Sum), tf.constant(full[RANK]))
    np.testing.assert_array_equal(out, sum(full)[start:start + mine_rows])
    out = run(mode, lambda x: hvd.reducescatter(x), tf.constant(full[RANK]))
    np.testing.assert_allclose(out, sum(full)[start:start + mine_rows] / N, rtol=1e-12)
    outs = run(mode, lambda a, b: hvd.grouped_reducescatter([a, b], op=hvd.Sum),
               tf.constant(full[RANK]), tf.constant(full[RANK][:, :1].astype(np.int32)))
    np.testing.assert_array_equal(outs[1], sum(full)[start:start + mine_rows, :1])


def test_indexed_slices_are_gathered():
    slices = tf.IndexedSlices(tf.constant([[float(RANK + 1)] * 2]), tf.constant([RANK % 2]),
                              dense_shape=tf.constant([2, 2]))
    out = hvd.allreduce(slices, op=hvd.Sum)
    assert isinstance(out, tf.IndexedSlices)
    np.testing.assert_array_equal(out.indices, [r % 2 for r in range(N)])
    dense = tf.convert_to_tensor(hvd.allreduce(slices))    # Average
    want = np.zeros((2, 2))
    for r in range(N):
        want[r % 2] += (r + 1) / N
    np.testing.assert_allclose(dense, want, rtol=1e-6)


def test_indexed_slices_follow_horovods_rules():
    ints = tf.IndexedSlices(tf.constant([[7 * (RANK + 1)] * 2], dtype=tf.int32), tf.constant([0]),
                            dense_shape=tf.constant([2, 2]))
    averaged = hvd.allreduce(ints, op=hvd.Average)
    assert averaged.values.dtype == tf.int32
    np.testing.assert_array_equal(averaged.values, [[(7 * (r + 1)) // N] * 2 for r in range(N)])
    for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        with pytest.raises(NotImplementedError, match="Sum or Average only"):
            hvd.allreduce(ints, op=op)
    with pytest.raises(NotImplementedError, match="prescale or postscale"):
        hvd.allreduce(ints, op=hvd.Sum, prescale_factor=2.0)


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_without_splits_needs_a_divisible_first_dimension(mode):
    with pytest.raises(tf.errors.InvalidArgumentError, match="does not divide evenly"):
        run(mode, lambda x: hvd.alltoall(x, name="a2a.indivisible"), tf.ones((N + 1, 2)))
    with pytest.raises(ValueError, match="does not divide evenly"):   # and unison's own error, still
        hvd.alltoall(tf.ones((N + 1, 2)), name="a2a.indivisible")


@pytest.mark.parametrize("mode", MODES)
def test_queries_as_ops(mode):
    got = run(mode, lambda: tf.stack([hvd.rank_op(), hvd.local_rank_op(), hvd.size_op(), hvd.local_size_op(),
                                      hvd.process_set_included_op()]))
    np.testing.assert_array_equal(got, [RANK, hvd.local_rank(), N, hvd.local_size(), 1])


def test_broadcast_global_variables_says_what_works_outside_tf1_graphs():
    with pytest.raises(RuntimeError, match="only in a TF1 graph.*broadcast_variables"):
        hvd.broadcast_global_variables(0)
    with pytest.raises(RuntimeError, match="only in a TF1 graph"):
        tf.function(lambda: hvd.broadcast_global_variables(0))()


# ---- TF1 graphs run by a tf.compat.v1.Session ---------------------------------

def test_broadcast_global_variables_in_a_session_sets_them_alone():
    """Horovod's TF1 idiom. The broadcast is built after a collective that
    needs a fed placeholder, and fetched alone: it must not run that one."""
    with tf.Graph().as_default() as graph:
        fed = tf.compat.v1.placeholder(tf.float64, [2])
        total = hvd.allreduce(fed, op=hvd.Sum)
        weights = tf.compat.v1.get_variable("w", initializer=tf.constant(values((2, 3), RANK)))
        count = tf.compat.v1.get_variable("count", initializer=tf.constant(RANK, tf.int64))
        mine = tf.compat.v1.get_variable("mine", initializer=tf.constant([float(RANK)]),
                                         collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
        broadcast = hvd.broadcast_global_variables(N - 1)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run([tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer()])
            session.run(broadcast)
            np.testing.assert_array_equal(session.run(weights), values((2, 3), N - 1))
            assert session.run(count) == N - 1
            np.testing.assert_array_equal(session.run(mine), [RANK])   # a local variable is this rank's
            np.testing.assert_array_equal(session.run(total, {fed: [RANK, 1.0]}), [N * (N - 1) / 2, N])


def test_join_and_barrier_in_a_session():
    """In a TF1 graph they are ops the session runs (built and returned,
    not run while the graph is built)."""
    with tf.Graph().as_default() as graph:
        barrier, last = hvd.barrier(), hvd.join()
        with tf.compat.v1.Session(graph=graph) as session:
            for _ in range(2):
                session.run(barrier)
                assert session.run(last) in range(N)


def test_session_collectives_pair_by_place_in_the_graph_not_by_order():
    """A session runs a graph's collectives in whatever order TensorFlow
    picks, which may differ between ranks; here each rank fetches N unnamed
    allreduces of one shape from N threads started in a rotated order. Each
    must still meet the same node on every rank, and later fetches of the
    same nodes pair again. (A collective node holds one of the session's
    inter-op threads while it waits, so the session gets a pool of its own
    with one for each; by default, sessions share the first one's.)"""
    with tf.Graph().as_default() as graph:
        nodes = [hvd.allreduce(tf.constant([100.0 * i + RANK]), op=hvd.Sum) for i in range(N)]
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=N, use_per_session_threads=True)
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            for _ in range(3):
                got = {}
                order = [(i + RANK) % N for i in range(N)]
                threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, session.run(nodes[i])))
                           for i in order]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(60)
                assert got == {i: [100.0 * i * N + N * (N - 1) / 2] for i in range(N)}, got


def test_sync_batch_normalization_accepts_fused():
    layer = hvd.SyncBatchNormalization(fused=True)
    assert layer(tf.ones((2, 3))).shape == (2, 3)


def test_join_and_barrier():
    hvd.barrier()
    assert int(hvd.join()) in range(N)
    hvd.barrier()


def test_objects():
    assert hvd.broadcast_object({"rank": RANK, "list": [1, 2]}, root_rank=N - 1) == {"rank": N - 1, "list": [1, 2]}
    assert hvd.allgather_object(("r", RANK)) == [("r", r) for r in range(N)]


# ---- gradients, as Horovod defines them ------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_gradients(mode):
    w = values((RANK + 2, 2), RANK + 7)

    def grads(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            summed = hvd.allreduce(x[:2] * w[:2], op=hvd.Sum, name="g.sum")
            averaged = hvd.allreduce(x[:2] * w[:2], op=hvd.Average, name="g.avg")
            gathered = hvd.allgather(x, name="g.gather")
            broadcast = hvd.broadcast(x[:2], 0, name="g.bcast")
            reduced = hvd.reducescatter(x[:2], op=hvd.Sum, name="g.rs")
            losses = [tf.reduce_sum(summed * (RANK + 1)), tf.reduce_sum(averaged * (RANK + 1)),
                      tf.reduce_sum(gathered * tf.range(tf.shape(gathered)[0], dtype=gathered.dtype)[:, None]),
                      tf.reduce_sum(broadcast * (RANK + 1)), tf.reduce_sum(reduced * (RANK + 1))]
        out = [tape.gradient(loss, x) for loss in losses]
        del tape
        return out
    g_sum, g_avg, g_gather, g_bcast, g_rs = run(mode, grads, tf.constant(values((RANK + 2, 2), RANK)))
    total = sum(r + 1 for r in range(N))
    # allreduce: the same allreduce of the upstream gradient, times w.
    first_two = np.zeros((RANK + 2, 2))
    first_two[:2] = w[:2]
    np.testing.assert_allclose(g_sum, total * first_two, rtol=1e-12)
    np.testing.assert_allclose(g_avg, total / N * first_two, rtol=1e-12)
    # allgather: this rank's rows of the averaged upstream gradient (row index).
    start = sum(r + 2 for r in range(RANK))
    rows = np.arange(start, start + RANK + 2, dtype=np.float64)[:, None] * np.ones((1, 2))
    np.testing.assert_allclose(g_gather, rows, rtol=1e-12)
    # broadcast: the averaged gradient on the root, zero elsewhere.
    want = np.zeros((RANK + 2, 2))
    if RANK == 0:
        want[:2] = total / N
    np.testing.assert_allclose(g_bcast, want, rtol=1e-12)
    # reducescatter (Sum): the allgathered upstream gradient times size.
    want = np.zeros((RANK + 2, 2))
    owners = [r for r in range(N) for _ in range(2 // N + (1 if r < 2 % N else 0))]
    want[:2] = np.array([(o + 1) * N for o in owners], dtype=np.float64)[:, None]
    np.testing.assert_allclose(g_rs, want, rtol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_gradient(mode):
    splits = [1 + i for i in range(N)]

    def grad(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out, received = hvd.alltoall(x, splits=splits, name="g.a2a")
            loss = tf.reduce_sum(out * (tf.range(tf.shape(out)[0], dtype=out.dtype) + 1))
        return tape.gradient(loss, x)
    g = run(mode, grad, tf.constant(np.arange(sum(splits), dtype=np.float64) + 100 * RANK))
    # Every rank sends 1 + i rows to rank i, so this rank's rows sit at
    # offset RANK * (1 + i) of rank i's output, where row k weighs k + 1;
    # the gradient sends those weights back to where the rows came from.
    want = []
    for i in range(N):
        want += [RANK * (1 + i) + k + 1 for k in range(1 + i)]
    np.testing.assert_allclose(g, want, rtol=1e-12)


# ---- errors --------------------------------------------------------------------

@pytest.mark.parametrize("mode", ALLREDUCE_MODES)
def test_mismatched_shape_fails_on_every_rank_and_recovers(mode):
    x = tf.ones([RANK + 1])
    if mode == "eager":
        with pytest.raises(unison.MismatchError, match=r"'bad\.shape'.*shape.*rank 0 \[1\].*rank 1 \[2\]"):
            hvd.allreduce(x, name="bad.shape")
    elif mode == "tf1-session":
        # Unnamed: the error names the node by its place in the graph, and
        # the graph by its place among those the process built (after
        # another here, so never the first).
        with tf.Graph().as_default():
            hvd.allreduce(tf.ones([1]))
        with tf.Graph().as_default() as graph:
            fed = tf.compat.v1.placeholder(tf.float32, [None])
            bad, good = hvd.allreduce(fed), hvd.allreduce(fed, op=hvd.Sum)
            with tf.compat.v1.Session(graph=graph) as session:
                with pytest.raises(tf.errors.OpError,
                                   match=r"MismatchError.*'allreduce\.graph\d+\.node0\.0'.*rank 0 \[1\].*rank 1 \[2\]"):
                    session.run(bad, {fed: np.ones(RANK + 1)})
                np.testing.assert_array_equal(session.run(good, {fed: np.ones(2)}), [N, N])
    elif mode == "xla":
        # Horovod's class from inside the XLA program, unnamed tensors too
        # (named by their place in the function, tf_ops._xla_names).
        with pytest.raises(tf.errors.FailedPreconditionError,
                           match=r"MismatchError: unison: allreduce 'bad\.shape\.x'.*rank 0 \[1\].*rank 1 \[2\]"):
            tf.function(lambda t: hvd.allreduce(t, name="bad.shape.x"), jit_compile=True)(x)
        with pytest.raises(tf.errors.FailedPreconditionError,
                           match=r"MismatchError: unison: allreduce 'allreduce\.xla[01]\.0'.*rank 0 \[1\].*rank 1 \[2\]"):
            tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum) + hvd.allreduce(t, op=hvd.Max), jit_compile=True)(x)
    else:
        with pytest.raises(tf.errors.OpError, match=r"MismatchError.*'bad\.shape\.f'.*rank 0 \[1\].*rank 1 \[2\]"):
            tf.function(lambda t: hvd.allreduce(t, name="bad.shape.f"))(x)
    np.testing.assert_array_equal(hvd.allreduce(tf.ones([2]), op=hvd.Sum), [N, N])


@pytest.mark.parametrize("nodes", ["compiled", "py_function"])
def test_error_types_are_horovods(monkeypatch, nodes):
    """Eagerly: disagreement is tf.errors.FailedPreconditionError, a bad
    argument tf.errors.InvalidArgumentError, each still unison's class.
    Inside tf.function a bad argument is still InvalidArgumentError; a
    disagreement is FailedPreconditionError through the compiled kernels,
    and an OpError through the py_function nodes they fall back to
    (TensorFlow turns every other Python exception of a py_function node
    into UnknownError); either way its message names unison's class."""
    if nodes == "py_function":
        monkeypatch.setattr(tf_ops, "_kernels", None)
    with pytest.raises(tf.errors.FailedPreconditionError, match=r"MismatchError: unison: allreduce 'fp\.eager'"):
        hvd.allreduce(tf.ones([RANK + 1]), name="fp.eager")
    with pytest.raises(unison.MismatchError):
        hvd.allreduce(tf.ones([RANK + 1]), name="fp.eager.unison")
    bad_splits = [1] * N
    bad_splits[0] = 2  # adds up to one more row than the tensor has
    with pytest.raises(tf.errors.InvalidArgumentError, match="add up to"):
        hvd.alltoall(tf.ones([N]), splits=bad_splits, name="ia.eager")
    with pytest.raises(unison.InvalidArgumentError, match="add up to"):
        hvd.alltoall(tf.ones([N]), splits=bad_splits, name="ia.eager.unison")
    with pytest.raises(tf.errors.InvalidArgumentError, match="add up to"):
        tf.function(lambda t: hvd.alltoall(t, splits=bad_splits, name="ia.graph"))(tf.ones([N]))
    graph_mismatch = tf.errors.FailedPreconditionError if nodes == "compiled" else tf.errors.OpError
    with pytest.raises(graph_mismatch, match=r"MismatchError: unison: allreduce 'fp\.graph'"):
        tf.function(lambda t: hvd.allreduce(t, name="fp.graph"))(tf.ones([RANK + 1]))
    with pytest.raises(graph_mismatch, match=r"MismatchError: unison: allgather 'fp\.graph\.gather'"):
        tf.function(lambda t: hvd.allgather(t, name="fp.graph.gather"))(tf.ones([2, RANK + 1]))
    np.testing.assert_array_equal(hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="after.errors"), [N, N])
    np.testing.assert_array_equal(tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))(tf.ones([2])), [N, N])


def test_graphs_run_through_the_compiled_kernels():
    """CI's TensorFlow builds the kernels: unless chosen away, every graph
    collective is one of their ops, and no py_function node is left."""
    if os.environ.get("UNISON_TF_KERNELS") == "0":
        assert tf_ops._kernels is None
        return
    assert tf_ops._kernels is not None, adapter_extension.ACTIVE

    @tf.function
    def step(x):
        return (hvd.allreduce(x), hvd.allgather(x), hvd.broadcast(x, 0), hvd.alltoall(x),
                hvd.reducescatter(x), hvd.join())
    x = tf.ones([N * 2])
    graph = step.get_concrete_function(x).graph
    kinds = sorted(op.type for op in graph.get_operations() if op.type.startswith("Unison") or "PyFunc" in op.type)
    assert kinds == ["UnisonAllgather", "UnisonAllreduce", "UnisonAlltoall", "UnisonBroadcast", "UnisonJoin",
                     "UnisonReducescatter"]
    reduced, gathered, received, exchanged, scattered, last = step(x)
    np.testing.assert_array_equal(reduced, np.ones(N * 2))
    assert gathered.shape == (N * N * 2,) and exchanged.shape == (N * 2,) and scattered.shape == (2,)
    assert int(last) in range(N)


def test_a_tf1_session_runs_more_independent_collectives_than_it_has_threads():
    """Twelve collectives that no control edge orders, fetched at once by a
    session with two inter-op threads, built in another order on every
    other rank: through the compiled kernels no node holds a thread while
    it waits, so TensorFlow may start them in any order and they pair by
    name. (A py_function node held a thread each: this deadlocked.)"""
    if tf_ops._kernels is None:
        pytest.fail("needs the compiled kernels: %s" % adapter_extension.ACTIVE)
    order = list(range(12)) if RANK % 2 == 0 else list(reversed(range(12)))
    with tf.Graph().as_default() as graph:
        built = {}
        for i in order:
            built[i] = hvd.allreduce(tf.constant([float(i), float(RANK)]), op=hvd.Sum, name="independent.%d" % i)
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=2, use_per_session_threads=True)
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            values = session.run([built[i] for i in range(12)])
    everyone = float(sum(range(N)))
    for i, value in enumerate(values):
        assert value.tolist() == [float(i * N), everyone]


def test_xla_programs_with_several_allreduces_pair_them_by_place_and_run_step_after_step():
    """One function XLA compiles, with unnamed, named and grouped
    allreduces, one in a tf.cond branch, run three steps: the program may
    start its custom calls in any order, and the unnamed ones pair by
    their place in the function. Its HLO holds one custom call a node."""
    def step(x):
        a = hvd.allreduce(x, op=hvd.Sum)
        b, c = hvd.grouped_allreduce([x * 2, tf.cast(x, tf.int64)], op=hvd.Max)
        d = hvd.allreduce(x + 1, op=hvd.Min, name="xla.named")
        e = tf.cond(tf.reduce_sum(x) > -1, lambda: hvd.allreduce(x * 3, op=hvd.Sum), lambda: x)
        return a, b, c, d, e
    compiled = tf.function(step, jit_compile=True)
    for s in range(3):
        x = tf.constant(values((2, 3), RANK + s))
        a, b, c, d, e = compiled(x)
        each = [values((2, 3), r + s) for r in range(N)]
        np.testing.assert_array_equal(a, sum(each))
        np.testing.assert_array_equal(b, 2 * np.max(each, axis=0))
        assert c.dtype == tf.int64
        np.testing.assert_array_equal(c, np.max(each, axis=0))
        np.testing.assert_array_equal(d, np.min(each, axis=0) + 1)
        np.testing.assert_array_equal(e, 3 * sum(each))
    hlo = compiled.experimental_get_compiler_ir(x)(stage="hlo")
    assert hlo.count('custom_call_target="unison_allreduce"') == 4, hlo


def test_allreduce_gradients_under_xla():
    w = values((3,), RANK + 7)

    def grads(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            summed = hvd.allreduce(x * w, op=hvd.Sum, name="xg.sum")
            averaged = hvd.grouped_allreduce([x * w], op=hvd.Average, name="xg.avg")[0]
            losses = [tf.reduce_sum(summed * (RANK + 1)), tf.reduce_sum(averaged * (RANK + 1))]
        out = [tape.gradient(loss, x) for loss in losses]
        del tape
        return out
    g_sum, g_avg = run("xla", grads, tf.constant(values((3,), RANK)))
    total = sum(r + 1 for r in range(N))
    np.testing.assert_allclose(g_sum, total * w, rtol=1e-12)
    np.testing.assert_allclose(g_avg, total / N * w, rtol=1e-12)


def test_indexed_slices_are_reduced_dense_under_xla():
    # XLA holds tensors dense and has no allgather: a sparse gradient is
    # reduced as sparse_as_dense reduces it.
    def reduce(values_, indices):
        slices = tf.IndexedSlices(values_, indices, dense_shape=tf.constant([2, 2], tf.int64))
        return hvd.allreduce(slices, op=hvd.Sum, name="xla.slices")
    out = run("xla", reduce, tf.constant([[float(RANK + 1)] * 2]), tf.constant([RANK % 2], tf.int64))
    assert not isinstance(out, tf.IndexedSlices)
    want = np.zeros((2, 2))
    for r in range(N):
        want[r % 2] += r + 1
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("kind,call", [
    ("allgather of 'xla.allgather'", lambda t: hvd.allgather(t, name="xla.allgather")),
    ("broadcast of 'xla.broadcast'", lambda t: hvd.broadcast(t, 0, name="xla.broadcast")),
    ("alltoall of 'xla.alltoall'", lambda t: hvd.alltoall(t, name="xla.alltoall")),
    ("reducescatter of 'xla.reducescatter'", lambda t: hvd.reducescatter(t, name="xla.reducescatter")),
    ("barrier", lambda t: (hvd.barrier(), t)[1])])
def test_a_collective_without_an_xla_lowering_is_refused_while_tracing_naming_it_and_the_fix(kind, call):
    # Without this check the error came only when the step first ran, from
    # TensorFlow: "No registered 'UnisonAllgather' OpKernel for XLA_CPU_JIT
    # devices".
    with pytest.raises(unison.UnsupportedError,
                       match=r"%s is traced inside a function compiled with XLA \(jit_compile=True\), and only "
                             r"allreduce and grouped allreduce are lowered to XLA.*jit_compile=False" % kind):
        tf.function(call, jit_compile=True)(tf.ones([N * 2]))
    # Nothing was enqueued on any rank: the same op without XLA runs.
    np.testing.assert_array_equal(tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name="xla.after"),
                                              jit_compile=False)(tf.ones([2])), [N, N])


def test_allreduce_under_xla_with_the_py_function_nodes_is_refused_saying_why(monkeypatch):
    monkeypatch.setattr(tf_ops, "_kernels", None)
    with pytest.raises(unison.UnsupportedError,
                       match=r"allreduce of 'xla\.fallback' is traced inside a function compiled with XLA "
                             r"\(jit_compile=True\), and allreduce lowers to XLA through unison's compiled kernels, "
                             r"which are not in use here"):
        tf.function(lambda t: hvd.allreduce(t, name="xla.fallback"), jit_compile=True, autograph=False)(tf.ones([2]))


def test_the_xla_lowering_is_in_use_here_and_only_for_allreduce():
    assert tf_ops.xla_refusal() == ""
    assert tf_ops.xla_refusal("allgather").startswith("only allreduce and grouped allreduce are lowered to XLA")
    assert adapter_extension.ACTIVE["TensorFlow under XLA"].startswith("compiled ("), adapter_extension.ACTIVE


def test_mismatched_dtype_and_root_fail_on_every_rank():
    with pytest.raises(unison.MismatchError, match=r"'bad\.dtype'.*dtype"):
        hvd.allreduce(tf.ones([2], dtype=tf.float32 if RANK == 0 else tf.float64), name="bad.dtype")
    with pytest.raises(unison.MismatchError, match=r"'bad\.root'.*root"):
        hvd.broadcast(tf.ones([2]), root_rank=RANK, name="bad.root")


def test_unsupported_dtype_is_refused_here():
    with pytest.raises(unison.InvalidArgumentError, match=r"'f8' has dtype float8_e4m3fn, which unison does not"):
        hvd.allreduce(tf.cast(tf.ones([2]), tf.dtypes.experimental.float8_e4m3fn), name="f8")
    with pytest.raises(unison.InvalidArgumentError, match="at least one dimension"):
        hvd.allgather(tf.constant(1.0), name="scalar")
    ragged, sparse = tf.ragged.constant([[1.0], [2.0, 3.0]]), tf.sparse.from_dense(tf.eye(2))
    for collective in (hvd.allreduce, hvd.allgather, lambda t, name: hvd.broadcast(t, 0, name=name),
                       hvd.alltoall, lambda t, name: hvd.grouped_allreduce([t], name=name)):
        with pytest.raises(unison.InvalidArgumentError, match="'ragged' is a tf.RaggedTensor; pass a dense"):
            collective(ragged, name="ragged")
        with pytest.raises(unison.InvalidArgumentError, match="'sparse' is a tf.SparseTensor; pass a dense"):
            collective(sparse, name="sparse")


def test_autograph_runs_unisons_python_as_written(monkeypatch):
    """A tf.function converts the Python it reaches from user code, unless
    AutoGraph lists its library as one to leave alone; unison's is listed
    (ops._keep_autograph_out). Otherwise each collective node's Python runs
    as AutoGraph's generated code every step, and tracing takes ten times
    as long (docs/design-notes.md). A TensorFlow that moves AutoGraph's list
    fails here, not silently slower. (The py_function nodes are the
    fallback where the compiled kernels are not built; they are forced here.)"""
    monkeypatch.setattr(tf_ops, "_kernels", None)
    nodes = []
    real = tf.py_function

    def capture(func, inp, Tout, name=None):
        nodes.append(func)
        return real(func, inp, Tout, name=name)

    monkeypatch.setattr(tf, "py_function", capture)

    @tf.function
    def step(x):
        total = hvd.allreduce(x, op=hvd.Sum, name="autograph.check")
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(x * x)
        grad, = hvd.DistributedGradientTape(tape).gradient(y, [x])
        return total, grad

    total, grad = step(tf.ones(3, tf.float64))
    assert total.numpy().tolist() == [float(N)] * 3
    assert grad.numpy().tolist() == [2.0] * 3
    assert len(nodes) == 2
    generated = [f.__code__.co_filename for f in nodes if "__autograph_generated" in f.__code__.co_filename]
    assert generated == []


def test_horovods_mpi_ops_module_path():
    from unison.tensorflow.mpi_ops import Sum, allreduce, rank_op
    total = allreduce(tf.cast(rank_op(), tf.float64), op=Sum, name="mpi_ops.path")
    assert float(total) == N * (N - 1) / 2
    # As after `import horovod.tensorflow as hvd`: the module is an attribute,
    # and so is gpu_available (no: this front end moves host tensors only).
    assert hvd.mpi_ops.allreduce is allreduce
    assert hvd.gpu_available("tensorflow") is False
    assert hvd.split_list([1, 2, 3], 2) == [[1, 2], [3]]


def test_broadcast_object_fn():
    broadcast = hvd.broadcast_object_fn(root_rank=N - 1, name="object.fn")
    assert broadcast({"from": RANK, "rows": [RANK] * 3}) == {"from": N - 1, "rows": [N - 1] * 3}
