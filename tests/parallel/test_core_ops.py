"""unison.numpy beyond the shared grid (shared_grid.py, test_core_grid.py):
large and fused tensors across shared-memory rounds, names reused with
other options, a thousand small ops, ranks enqueueing in different orders,
join, shutdown then init, and waiting callers that drive the engine
themselves (engine_driver.cc), with exact values."""
import os
import threading
import time

import numpy as np
import pytest

import unison
import unison.numpy as unp
from shared_grid import assert_same


def test_mpi_queries_say_whether_mpi_carries_the_job():
    # Horovod's mpi_enabled() and mpi_threads_supported(): true in a job an
    # MPI launcher started (test_mpi.py's layouts), where the core asks for
    # MPI_THREAD_MULTIPLE; false under unisonrun's shared memory and TCP.
    import os
    started_by_mpi = unison.size() > 1 and any(
        name in os.environ for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))
    assert unison.mpi_enabled() is started_by_mpi
    assert unison.mpi_threads_supported() is started_by_mpi


def test_allreduce_in_place_and_large_multi_round():
    # 3M floats is larger than one shared-memory round, so it goes in rounds.
    x = np.full(3_000_001, unison.rank() + 1, dtype=np.float32)
    x[::7] = 0.5
    out = unp.allreduce_(x, op=unison.Sum, name="inplace.large")
    assert out is x
    n = unison.size()
    expected = np.full(3_000_001, n * (n + 1) / 2, dtype=np.float32)
    expected[::7] = 0.5 * n
    assert_same(x, expected)


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
        assert_same(unp.synchronize(h), expected)

@pytest.mark.parametrize("dtype", [np.int32, np.float16, np.float32, np.float64])
def test_large_allreduces_with_every_op_and_scaling(dtype):
    # Past the sizes the grid uses, so that every backend's large path (the
    # TCP ring, shared-memory rounds) scales, averages and combines.
    n, rank = unison.size(), unison.rank()
    count = 100_003
    x = np.full(count, rank + 1, dtype=dtype)
    sums = unp.grouped_allreduce([x, x[:70_001].copy()], op=unison.Sum, name="large.sum.%s" % x.dtype)
    for out in sums:
        assert_same(out, np.full(out.shape, n * (n + 1) // 2, dtype=dtype))
    expected_average = n * (n + 1) // 2 // n if np.issubdtype(dtype, np.integer) else (n + 1) / 2
    assert_same(unp.allreduce(x, op=unison.Average, name="large.avg.%s" % x.dtype),
                np.full(count, expected_average, dtype=dtype))
    for op, expected in ((unison.Min, 1), (unison.Max, n), (unison.Product, np.prod(np.arange(1, n + 1)))):
        assert_same(unp.allreduce(x, op=op, name="large.%s.%s" % (op, x.dtype)),
                    np.full(count, expected, dtype=dtype))
    if not np.issubdtype(dtype, np.integer):
        scaled = unp.allreduce(x, op=unison.Average, prescale_factor=3.0, postscale_factor=0.5,
                               name="large.scaled.%s" % x.dtype)
        assert_same(scaled, np.full(count, 1.5 * (n + 1) / 2, dtype=dtype))


def test_average_is_the_default_op_as_in_horovod():
    result = unp.allreduce(np.full(4, float(unison.rank())), name="default.op")
    assert_same(result, np.full(4, (unison.size() - 1) / 2))


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
            assert_same(result, expected.astype(dtype))


def test_in_place_ops_beyond_those_a_thread_keeps_prepared(monkeypatch):
    # A thread keeps the filled options of at most collective._KEPT distinct
    # in-place ops; the ones past that are built per call and still run.
    from unison import collective
    monkeypatch.setattr(collective, "_KEPT", len(collective._scratch.in_place) + 2)
    n, rank = unison.size(), unison.rank()
    for repeat in range(2):
        arrays = [np.full(5, rank + i, dtype=np.int64) for i in range(6)]
        handles = [unp.allreduce_async_(a, op=unison.Sum, name="beyond.kept.%d" % i) for i, a in enumerate(arrays)]
        for i, (a, h) in enumerate(zip(arrays, handles)):
            assert unp.synchronize(h) is a
            assert_same(a, np.full(5, n * i + n * (n - 1) // 2))
        x = np.full(3, float(rank), dtype=np.float32)
        assert unp.allreduce_(x, op=unison.Max, name="beyond.kept.blocking") is x
        assert_same(x, np.full(3, n - 1.0, dtype=np.float32))


def test_interrupted_blocking_allreduce_leaves_its_array_to_the_running_op():
    # Ctrl-C (here a signal whose handler raises) while a blocking in-place
    # allreduce_ waits for a late peer: the op still runs, so a handle stays
    # in flight holding the array, and the result lands in live memory.
    import os
    import signal
    from unison import handles

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted()

    n, rank = unison.size(), unison.rank()
    x = np.full(8, rank + 1.0)
    if rank == 0:
        previous = signal.signal(signal.SIGUSR1, interrupt)
        timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        try:
            with pytest.raises(Interrupted):
                unp.allreduce_(x, op=unison.Sum, name="interrupted.in_place")
        finally:
            timer.cancel()
            signal.signal(signal.SIGUSR1, previous)
        left = [h for h in handles._in_flight.values() if h.name == "interrupted.in_place"]
        assert len(left) == 1
        unp.allreduce(np.zeros(1), name="interrupted.go")
        unp.synchronize(left[0])
    else:
        unp.allreduce(np.zeros(1), name="interrupted.go")
        unp.allreduce_(x, op=unison.Sum, name="interrupted.in_place")
    assert_same(x, np.full(8, n * (n + 1) / 2))


def test_thousand_small_async_allreduces_fused():
    n = unison.size()
    handles = [unp.allreduce_async(np.full(7, i + unison.rank(), dtype=np.float32), op=unison.Sum,
                                   name="many.%d" % i) for i in range(1000)]
    for i, h in enumerate(handles):
        assert_same(unp.synchronize(h), np.full(7, n * i + n * (n - 1) / 2, dtype=np.float32))
    # The same names again go through the response cache.
    handles = [unp.allreduce_async(np.full(7, i, dtype=np.float32), op=unison.Sum, name="many.%d" % i)
               for i in range(1000)]
    for i, h in enumerate(handles):
        assert_same(unp.synchronize(h), np.full(7, n * i, dtype=np.float32))


def test_bursts_past_the_queue_kept_capacity():
    # Grouped, the 5000 reach the engine's queue at once and one cycle takes
    # them all: more than the 4096 entries the queue keeps between cycles
    # (Engine::take_new_requests), so its buffer is let go, then regrown by
    # the second burst.
    n = unison.size()
    for burst in range(2):
        arrays = [np.full(3, i + burst + unison.rank(), dtype=np.int32) for i in range(5000)]
        results = unp.synchronize(unp.grouped_allreduce_async(arrays, op=unison.Sum, name="burst%d" % burst))
        for i, x in enumerate(results):
            assert_same(x, np.full(3, n * (i + burst) + n * (n - 1) // 2, dtype=np.int32))


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
        assert_same(unp.synchronize(handles[i]), np.full(3, i * n * (n + 1) // 2))


def test_broadcast_in_place_large():
    x = np.full(2_500_000, unison.rank(), dtype=np.float64)
    unp.broadcast_(x, 1, name="bc.inplace")
    assert_same(x, np.ones(2_500_000))

# Buffers placed a chosen number of bytes past a page boundary: the data
# planes copy with their own loop where memcpy would crawl, when the
# destination lies 1 to 63 bytes past the source modulo 4 KiB
# (native/copy.h). The shared slots start on page boundaries, so a buffer
# `offset` bytes into a page puts the copies out of the slots at that distance.
def at_page_offset(offset, count, dtype):
    itemsize = np.dtype(dtype).itemsize
    raw = np.zeros(count * itemsize + 2 * 4096, dtype=np.uint8)
    start = (-raw.ctypes.data) % 4096 + offset
    buffer = raw[start:start + count * itemsize].view(dtype)
    assert buffer.ctypes.data % 4096 == offset
    return buffer


def test_broadcast_into_buffers_at_every_short_distance_from_a_page():
    # Bytes, so every distance from 0 to 64 is one; an odd length leaves a
    # tail after the loop's 64-byte steps.
    count = 100_003
    root = unison.size() - 1
    sent = (np.arange(count) * 7 % 251).astype(np.uint8)
    for offset in range(65):
        x = at_page_offset(offset, count, np.uint8)
        if unison.rank() == root:
            x[:] = sent
        unp.broadcast_(x, root, name="bc.offset.%d" % offset)
        assert_same(x, sent, err_msg="offset %d" % offset)


@pytest.mark.parametrize("offset", [0, 4, 16, 28, 60, 2052])
def test_allreduce_and_allgather_of_buffers_off_a_page_boundary(offset):
    # Large (each rank reduces a chunk, across shared-memory rounds) and fused
    # with a tensor of odd length in front, which shifts the next one's
    # place in the stream off the page grid.
    n, rank = unison.size(), unison.rank()
    count = 700_001
    x = at_page_offset(offset, count, np.float32)
    x[:] = np.arange(count) % 1000 + rank
    assert unp.allreduce_(x, op=unison.Sum, name="off.large.%d" % offset) is x
    assert_same(x, (np.arange(count) % 1000) * n + n * (n - 1) / 2)
    odd = np.full(3, rank + 1, dtype=np.float32)
    y = at_page_offset(offset, 50_001, np.float32)
    y[:] = np.arange(50_001) % 500 * (rank + 1)
    handles = [unp.allreduce_async_(odd, op=unison.Sum, name="off.odd.%d" % offset),
               unp.allreduce_async_(y, op=unison.Sum, name="off.fused.%d" % offset)]
    for h in handles:
        unp.synchronize(h)
    assert_same(odd, np.full(3, n * (n + 1) / 2))
    assert_same(y, np.arange(50_001) % 500 * (n * (n + 1) / 2))
    # Ranks send different row counts, so each rank's rows land in the
    # output at offsets that are not whole pages apart.
    rows = at_page_offset(offset, (rank + 1) * 1001, np.float32).reshape(rank + 1, 1001)
    rows[:] = rank * 10_000 + np.arange(1001)
    gathered = unp.allgather(rows, name="off.gather.%d" % offset)
    expected = np.concatenate([np.tile(r * 10_000 + np.arange(1001, dtype=np.float32), (r + 1, 1))
                               for r in range(n)])
    assert_same(gathered, expected)



def test_reducescatter_average_default():
    n = unison.size()
    x = np.full((n * 2, 2), float(unison.rank()))
    assert_same(unp.reducescatter(x, name="rs.avg"), np.full((2, 2), (n - 1) / 2))


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
        assert_same(result, np.full(5, float(sum(range(1, n)))))
        last = unp.join()
    # Everyone agrees who joined last, and work goes on normally afterwards.
    assert unp.allreduce(np.array([last]), op=unison.Max, name="join.last")[0] == last
    assert unp.allreduce(np.ones(2), op=unison.Sum, name="after.join")[0] == n


def test_placeholder_contributions_say_when_no_rank_had_the_tensor():
    # DistributedOptimizer's zeros for a gradient this rank did not compute
    # (unison.h's placeholder): where every rank's is one, the allreduce
    # reports it (None) instead of a tensor of zeros; where some rank had
    # the tensor, the placeholders count as zeros. Repeated under one name,
    # so that a negotiated (and cached) real response meets placeholders.
    from unison.numpy import front_end
    n, me = unison.size(), unison.rank()
    for step, holders in enumerate([set(range(n)), {0}, set(), set(range(n)), set(), {n - 1}]):
        x = np.full(5, float(me + 1)) if me in holders else np.zeros(5)
        if me in holders:
            out = unp.synchronize(unp.allreduce_async_(x, name="placeholder.grad", op=unp.Sum))
        else:
            out = unp.synchronize(front_end.allreduce_placeholder_async_(x, "placeholder.grad", unp.Sum))
        if holders:
            assert out is x, step
            assert_same(out, np.full(5, float(sum(r + 1 for r in holders))))
        else:
            assert out is None, step
    from unison import collective
    from unison._native import lib
    buffer = np.zeros(1)
    pointer = front_end.tensors.pointer(buffer)
    with pytest.raises(unison.InvalidArgumentError, match="broadcast 'placeholder.bc': only an allreduce or a reducescatter takes a"):
        collective.enqueue(lib.UNISON_BROADCAST, "placeholder.bc", lib.UNISON_FLOAT64, (1,), pointer, pointer,
                           placeholder=True)


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
        assert_same(result, np.full(2, float(sum(range(1, n)))))
        last = unp.join()
    # The same last rank everywhere, and every collective works again.
    assert unp.allgather(np.array([last]), name="joined.last").tolist() == [last] * n
    assert last != 0
    assert_same(unp.broadcast(np.arange(3) + me, root_rank=0, name="joined.after"), np.arange(3))


def test_sync_ops_on_one_thread_beside_async_ops_on_another():
    # One thread runs a streak of synchronous ops (its waits drive the
    # engine) while another enqueues batches of async ops and waits for them
    # later: every op of both completes, with every rank's values.
    n, rank = unison.size(), unison.rank()
    failures = []

    def sync_streak():
        try:
            for i in range(300):
                out = unp.allreduce(np.full(3, rank + i, np.int64), op=unison.Sum, name="drive.sync.%d" % i)
                assert out.tolist() == [n * (n - 1) // 2 + n * i] * 3, (i, out)
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(e)

    worker = threading.Thread(target=sync_streak)
    worker.start()
    for batch in range(30):
        arrays = [np.full(1000, rank * 10 + k, np.float64) for k in range(10)]
        handles = [unp.allreduce_async_(a, op=unison.Sum, name="drive.async.%d.%d" % (batch, k))
                   for k, a in enumerate(arrays)]
        for k, h in enumerate(handles):
            assert_same(unp.synchronize(h), np.full(1000, 10 * n * (n - 1) / 2 + n * k))
    worker.join()
    assert not failures, failures


def test_blocking_ops_from_several_threads_reaching_them_in_other_orders():
    # Three threads a rank, each a loop of blocking ops; each rank starts
    # its threads in another order, so a rank's waiting callers often wait
    # for ops another thread of theirs has already finished, or that a
    # peer's thread has yet to enqueue. The ops of a thread that another
    # thread's wait is driving still end promptly (engine_driver.cc), and
    # every op has every rank's values.
    n, rank = unison.size(), unison.rank()
    failures = []

    def loop(thread):
        try:
            for i in range(150):
                name = "threads.%d.%d" % (thread, i)
                if i % 3 == 0:
                    out = unp.broadcast(np.full(4, 10 * thread + i + rank), root_rank=i % n, name=name)
                    assert out.tolist() == [10 * thread + i + i % n] * 4, (name, out)
                else:
                    out = unp.allreduce(np.full(i % 7 + 1, rank + thread, np.int64), op=unison.Sum, name=name)
                    assert out.tolist() == [n * (n - 1) // 2 + n * thread] * (i % 7 + 1), (name, out)
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(e)

    order = [(t + rank) % 3 for t in range(3)]
    threads = [threading.Thread(target=loop, args=(t,)) for t in order]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert not failures, failures


def test_async_op_after_a_sync_streak_completes_with_no_wait():
    # After a streak of waited ops the engine's thread expects the next op
    # to be waited for too; this one is only polled, so the thread must
    # take it over by itself.
    n, rank = unison.size(), unison.rank()
    for i in range(50):
        unp.allreduce(np.ones(2), op=unison.Sum, name="streak.%d" % i)
    x = np.full(4, rank + 1.0)
    handle = unp.allreduce_async_(x, op=unison.Sum, name="streak.unwaited")
    while not unp.poll(handle):
        time.sleep(0.001)
    assert_same(unp.synchronize(handle), np.full(4, n * (n + 1) / 2))


def test_ops_polled_to_completion_without_a_wait():
    # Each op is only polled until done (Horovod's overlap idiom): the
    # engine's thread takes it when polled (Engine::claim_for_poll), and
    # every rank gets every rank's values; a done op stays done when polled again.
    # Between polls the rank gives up its core, as a step's compute would:
    # bare spinning at 5 ranks on 2 cores kept the peers it waited for off
    # the cores (2.4-2.6 s a rank, against 0.06 s at 2 ranks).
    n, rank = unison.size(), unison.rank()
    for i in range(60):
        x = np.full(1 + i * 37, rank + i, np.float64)
        handle = unp.allreduce_async_(x, op=unison.Sum, name="polled.%d" % (i % 7))
        while not unp.poll(handle):
            os.sched_yield()
        assert unp.poll(handle)
        assert_same(unp.synchronize(handle), np.full(1 + i * 37, n * (n - 1) / 2 + n * i))


def test_waiting_caller_outlasts_a_late_peer():
    # Rank r arrives r * 0.3 s late: rank 0's caller drives the engine
    # through several of its 0.2 s wait slices before the op can run.
    n, rank = unison.size(), unison.rank()
    time.sleep(0.3 * rank)
    out = unp.allreduce(np.full(5, float(rank)), op=unison.Max, name="late.peer")
    assert_same(out, np.full(5, n - 1.0))


def test_shutdown_while_another_thread_waits():
    # A thread waits (driving the engine) on an op no other rank starts;
    # shutdown() on the main thread ends it with ShutDownError, not a hang.
    outcome = []

    def wait_alone():
        try:
            unp.allreduce(np.ones(1), name="only.rank.%d" % unison.rank())
            outcome.append("completed")
        except unison.ShutDownError as e:
            outcome.append(e)

    unp.barrier()
    waiter = threading.Thread(target=wait_alone)
    waiter.start()
    time.sleep(0.3)
    unp.barrier()
    unison.shutdown()
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], unison.ShutDownError), outcome
    unison.init()
    unp.barrier()


def test_shutdown_then_init_again():
    unison.shutdown()
    assert not unison.is_initialized()
    unison.init()
    n = unison.size()
    assert_same(unp.allreduce(np.ones(3), op=unison.Sum, name="reinit"), np.full(3, n))
