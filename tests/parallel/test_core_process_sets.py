"""Process sets on unison.numpy, at any size (tests/test_parallel.py runs this
suite at 2, 3 and 4 ranks; tests/test_mpi.py on every MPI layout).

The sets: `low` and `high` split the ranks in halves, `even` and `odd` by
parity, so at 4 ranks {0,1},{2,3} and {0,2},{1,3}: every rank is in two
sets besides the global one, and under --simulate-hosts 2 the halves live
within a host while the parity sets cross hosts."""
import numpy as np
import pytest

import unison
import unison.numpy as unp
from shared_grid import assert_same
from unison import process_sets


def test_removing_a_set_fails_what_waits_in_it_and_later_ops():
    """Runs before the module's sets exist, so that {0, 1} is new."""
    me = unison.rank()
    if unison.size() < 3:
        pytest.skip("at 2 ranks the only set of two is the global one, which cannot be removed")
    pair = unison.add_process_set([0, 1])
    waiting = None
    if me == 0:  # rank 1 never submits it
        waiting = unp.allreduce_async(np.ones(2), name="ps.orphan", process_set=pair)
    unison.remove_process_set(pair)
    if waiting is not None:
        with pytest.raises(unison.ShutDownError, match="was removed"):
            unp.synchronize(waiting)
    if me in (0, 1):
        with pytest.raises(unison.InvalidArgumentError, match="not registered"):
            unp.allreduce(np.ones(2), name="ps.removed", process_set=pair)
    assert unp.allreduce(np.ones(1), op=unison.Sum, name="ps.after.remove")[0] == unison.size()


@pytest.fixture(scope="module")
def sets():
    n = unison.size()
    ranks = list(range(n))
    named = {"low": ranks[:n // 2], "high": ranks[n // 2:], "even": ranks[0::2], "odd": ranks[1::2]}
    added = {}
    for key in ["low", "high", "even", "odd"]:
        if named[key] in [s.ranks for s in added.values()]:
            continue  # at 2 ranks, low == even and high == odd
        added[key] = unison.add_process_set(named[key])
    yield added
    for s in added.values():
        if s.process_set_id is not None:  # the re-init test forgets them
            unison.remove_process_set(s)


def my_sets(sets):
    return [s for s in sets.values() if s.included()]


def test_queries_answer_for_the_set(sets):
    me = unison.rank()
    ids = [s.process_set_id for s in sets.values()]
    assert len(set(ids)) == len(ids) and 0 not in ids
    for s in sets.values():
        assert s.size() == len(s.ranks)
        assert s.included() == (me in s.ranks)
        assert s.rank() == (s.ranks.index(me) if me in s.ranks else -1)
        assert process_sets.find(s.process_set_id) is s
    assert unison.global_process_set.size() == unison.size()
    assert unison.global_process_set.rank() == me


def test_allreduce_sums_and_averages_the_members_only(sets):
    for s in my_sets(sets):
        total = unp.allreduce(np.full(7, unison.rank() + 1, np.int64), op=unison.Sum, name="ps.sum",
                              process_set=s)
        assert_same(total, np.full(7, sum(r + 1 for r in s.ranks)))
        mean = unp.allreduce(np.full((2, 3), float(unison.rank()), np.float64), name="ps.avg", process_set=s)
        assert_same(mean, np.full((2, 3), np.mean(s.ranks)))
        scaled = unp.allreduce(np.full(3, 2.0, np.float32), op=unison.Sum, prescale_factor=0.5,
                               postscale_factor=3.0, name="ps.scaled", process_set=s)
        assert_same(scaled, np.full(3, 3.0 * len(s.ranks), np.float32))


def test_in_place_async_and_grouped_in_a_set(sets):
    for s in my_sets(sets):
        a = np.full(5, float(unison.rank()), np.float32)
        unp.synchronize(unp.allreduce_async_(a, op=unison.Sum, name="ps.inplace", process_set=s))
        assert_same(a, np.full(5, float(sum(s.ranks)), np.float32))
        outs = unp.grouped_allreduce([np.full(2, unison.rank(), np.int32), np.full((), unison.rank(), np.int32)],
                                     op=unison.Max, name="ps.grouped", process_set=s)
        assert [o.tolist() for o in outs] == [[max(s.ranks)] * 2, max(s.ranks)]


def test_allgather_broadcast_alltoall_reducescatter_in_a_set(sets):
    me = unison.rank()
    for s in my_sets(sets):
        k = len(s.ranks)
        gathered = unp.allgather(np.full((me + 1, 2), me, np.int16), name="ps.gather", process_set=s)
        assert_same(gathered, np.concatenate([np.full((r + 1, 2), r, np.int16) for r in s.ranks]))
        root = s.ranks[-1]  # roots are global ranks, as in Horovod
        b = unp.broadcast(np.full(4, me, np.float64), root_rank=root, name="ps.bcast", process_set=s)
        assert_same(b, np.full(4, root, np.float64))
        # Member i sends j+1 rows of value 10*me+j to member j.
        splits = [j + 1 for j in range(k)]
        send = np.concatenate([np.full(j + 1, 10 * me + j, np.int32) for j in range(k)])
        received, received_splits = unp.alltoall(send, splits=splits, name="ps.a2a", process_set=s)
        mine = s.ranks.index(me)
        assert list(received_splits) == [mine + 1] * k
        assert_same(received, np.concatenate([np.full(mine + 1, 10 * r + mine, np.int32)
                                              for r in s.ranks]))
        rows = 2 * k + 1
        part = unp.reducescatter(np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) * (me + 1),
                                 op=unison.Sum, name="ps.rs", process_set=s)
        whole = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) * sum(r + 1 for r in s.ranks)
        start = sum(rows // k + (1 if i < rows % k else 0) for i in range(mine))
        assert_same(part, whole[start:start + rows // k + (1 if mine < rows % k else 0)])
        unp.barrier(process_set=s)


def test_sets_loop_independently_while_the_global_set_runs(sets):
    """Halves loop at their own pace: each enqueues many steps before it
    waits, while global allreduces interleave; every value is exact."""
    me = unison.rank()
    half = sets["low"] if sets["low"].included() else sets["high"]
    steps = 40
    handles = []
    for step in range(steps):
        handles.append(unp.allreduce_async(np.full(16, me * step, np.int64), op=unison.Sum,
                                           name="ps.loop.%d" % step, process_set=half))
        if step % 10 == 9:
            g = unp.allreduce(np.full(3, me, np.int64), op=unison.Sum, name="ps.global.%d" % step)
            assert_same(g, np.full(3, sum(range(unison.size()))))
    for step, h in enumerate(handles):
        assert_same(unp.synchronize(h), np.full(16, sum(half.ranks) * step))


def test_overlapping_sets_in_opposite_orders_do_not_deadlock(sets):
    """A rank in two sets starts their ops in one order, its neighbour in the
    other; negotiation, not call order, decides what runs."""
    me = unison.rank()
    mine = my_sets(sets)
    if me % 2:
        mine = mine[::-1]
    handles = [(s, unp.allreduce_async(np.full(3, me, np.int32), op=unison.Sum, name="ps.cross.%d" % s.process_set_id,
                                       process_set=s)) for s in mine]
    for s, h in handles:
        assert_same(unp.synchronize(h), np.full(3, sum(s.ranks)))


def test_a_rank_outside_the_set_is_refused(sets):
    for s in sets.values():
        if s.included():
            continue
        with pytest.raises(unison.InvalidArgumentError, match="rank %d is not in process set %d" %
                           (unison.rank(), s.process_set_id)):
            unp.allreduce(np.ones(2), name="ps.outsider", process_set=s)
    # and the job goes on
    assert unp.allreduce(np.ones(1), op=unison.Sum, name="ps.after.outsider")[0] == unison.size()


def test_unknown_and_unregistered_sets_are_refused():
    with pytest.raises(unison.InvalidArgumentError, match="process set 999 does not exist"):
        unp.allreduce(np.ones(2), name="ps.unknown", process_set=unison.ProcessSet([0], process_set_id=999))
    with pytest.raises(unison.InvalidArgumentError, match="not registered"):
        unp.allreduce(np.ones(2), name="ps.unregistered", process_set=unison.ProcessSet([0]))


def test_the_global_set_cannot_be_removed_and_duplicates_are_refused(sets):
    with pytest.raises(unison.InvalidArgumentError, match="global process set cannot be removed"):
        unison.remove_process_set(unison.global_process_set)
    existing = next(iter(sets.values()))
    with pytest.raises(unison.InvalidArgumentError, match="already has ranks"):
        unison.add_process_set(list(existing.ranks))
    with pytest.raises(unison.InvalidArgumentError, match="already has ranks"):
        unison.add_process_set(list(range(unison.size())))
    with pytest.raises(unison.InvalidArgumentError, match="within 0..%d" % (unison.size() - 1)):
        unison.add_process_set([unison.size()])


def test_broadcast_root_outside_the_set_is_refused(sets):
    for s in my_sets(sets):
        outsider = next((r for r in range(unison.size()) if r not in s.ranks), None)
        if outsider is None:
            continue
        with pytest.raises(unison.InvalidArgumentError, match="root rank %d is not in process set" % outsider):
            unp.broadcast(np.ones(2), root_rank=outsider, name="ps.badroot", process_set=s)


def test_mismatches_are_found_within_a_set_and_name_global_ranks(sets):
    for s in my_sets(sets):
        if len(s.ranks) < 2:
            continue
        dtype = np.float32 if s.rank() == 0 else np.float64
        with pytest.raises(unison.MismatchError) as error:
            unp.allreduce(np.ones(3, dtype), name="ps.mismatch", process_set=s)
        message = str(error.value)
        assert "process set %d" % s.process_set_id in message
        assert "rank %d float32" % s.ranks[0] in message and "rank %d float64" % s.ranks[1] in message
        # the set still works afterwards
        ok = unp.allreduce(np.ones(1), op=unison.Sum, name="ps.after.mismatch", process_set=s)
        assert ok[0] == len(s.ranks)


def test_allgather_object_within_a_set_names_the_failing_member_by_its_rank(sets):
    """Within a set, the failures are named by global rank, as the set's
    members are."""
    from unison import objects

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("not picklable, on purpose")

    me = unison.rank()
    for key in sorted(sets):
        s = sets[key]
        if not s.included():
            continue
        last = s.ranks[-1]
        name = "ps.obj.%s" % key
        if me == last:
            with pytest.raises(TypeError, match="on purpose"):
                objects.allgather_object(Unpicklable(), name=name, process_set=s)
        else:
            with pytest.raises(unison.InvalidArgumentError, match=r"the object of rank %d could not be serialised.*"
                               r"\(rank %d: TypeError: not picklable, on purpose\)$" % (last, last)):
                objects.allgather_object(me, name=name, process_set=s)
        assert objects.allgather_object(me, name=name, process_set=s) == s.ranks


def test_join_runs_on_the_global_set_only(sets):
    s = my_sets(sets)[0]
    with pytest.raises(unison.InvalidArgumentError, match="global process set only"):
        unison.collective.join(process_set=s)


def test_a_set_of_one_rank(sets):
    me = unison.rank()
    solo = [unison.add_process_set([r]) for r in range(unison.size()) if [r] not in [s.ranks for s in sets.values()]]
    try:
        for s in solo:
            if s.included():
                out = unp.allreduce(np.full(3, me, np.float32), op=unison.Sum, name="ps.solo", process_set=s)
                assert_same(out, np.full(3, me, np.float32))
    finally:
        for s in solo:
            unison.remove_process_set(s)


def test_unnamed_ops_in_a_set_leave_the_numbering_of_the_others_in_step(sets):
    """Unnamed ops are numbered per process set: ops in a set only its
    members run must not shift the names of later unnamed ops elsewhere,
    or the global set's next unnamed op would pair with nothing."""
    me, n = unison.rank(), unison.size()
    low = sets["low"]
    for round_ in range(3):
        if low.included():
            out = unp.allreduce(np.full(2, me + round_, np.int64), op=unison.Sum, process_set=low)
            assert_same(out, np.full(2, sum(r + round_ for r in low.ranks), np.int64))
        out = unp.allreduce(np.full(2, me, np.int64), op=unison.Sum)
        assert_same(out, np.full(2, n * (n - 1) // 2, np.int64))
        rows = unp.allgather(np.full((1, 2), me, np.int64))
        assert_same(rows[:, 0], np.arange(n))


def test_static_sets_through_init_then_reinit():
    """init(process_sets=[...]) registers the sets in list order (ids 1, 2);
    shutdown forgets them, and a plain init() starts clean."""
    n = unison.size()
    low, high = unison.ProcessSet(range(n // 2)), unison.ProcessSet(range(n // 2, n))
    unp.barrier()
    unison.shutdown()
    unison.init(process_sets=[low, high])
    try:
        assert (low.process_set_id, high.process_set_id) == (1, 2)
        mine = low if low.included() else high
        total = unp.allreduce(np.full(2, unison.rank(), np.int64), op=unison.Sum, name="ps.static", process_set=mine)
        assert_same(total, np.full(2, sum(mine.ranks)))
    finally:
        unp.barrier()
        unison.shutdown()
        unison.init()
    assert low.process_set_id is None
    assert unp.allreduce(np.ones(1), op=unison.Sum, name="ps.after.reinit")[0] == n
