"""shutdown() then init() always gives a working job, the way a test
harness uses it: 20 rounds of init, a random op (some fail on purpose,
some join, one has a peer shut down first), barrier, shutdown, with ranks
arriving and leaving at different moments. Every rank draws the same ops
from the same seed; what each must see is exact."""
import random
import time

import numpy as np
import pytest

import unison
import unison.numpy as unp
from unison import collective

ROUNDS = 20
KINDS = ["allreduce", "allgather", "mismatch", "join", "join_then_allgather", "process_set",
         "peer_shuts_down_first", "outsider"]


def run_round(kind, round_number):
    """Runs one kind of op; returns False when the round must skip its barrier
    (a peer has shut down, so no collective can complete)."""
    me, n = unison.rank(), unison.size()
    tag = "r%d" % round_number
    if kind == "allreduce":
        out = unp.allreduce(np.full(5, me, np.int64), op=unison.Sum, name=tag)
        assert out.tolist() == [n * (n - 1) // 2] * 5
    elif kind == "allgather":
        out = unp.allgather(np.full((me + 1,), me, np.int32), name=tag)
        assert out.tolist() == [r for r in range(n) for _ in range(r + 1)]
    elif kind == "mismatch":
        with pytest.raises(unison.MismatchError, match="ranks disagree on dtype"):
            unp.allreduce(np.ones(3, np.float32 if me == 0 else np.float64), name=tag)
    elif kind == "join":
        # The last rank contributes first, then everyone joins: the
        # allreduce sees zeros from the ranks already joined.
        if me == n - 1:
            out = unp.allreduce(np.full(2, 7.0), op=unison.Sum, name=tag)
            assert out.tolist() == [7.0, 7.0]
        assert collective.join() == n - 1
    elif kind == "join_then_allgather":
        if me == 0:
            with pytest.raises(unison.MismatchError, match="has joined"):
                unp.allgather(np.ones((1,)), name=tag)
        assert collective.join() == 0
    elif kind == "process_set":
        members = [0, n - 1] if n > 2 else [n - 1]  # at 2 ranks, [0, 1] is the global set
        pair = unison.add_process_set(members)
        if pair.included():
            out = unp.allreduce(np.full(1, me, np.int64), op=unison.Sum, name=tag, process_set=pair)
            assert out.tolist() == [sum(members)]
        unison.remove_process_set(pair)
    elif kind == "peer_shuts_down_first":
        if me == n - 1:
            unison.shutdown()  # leaves without taking part
            return False
        with pytest.raises(unison.ShutDownError, match="rank %d has shut down" % (n - 1)):
            unp.allreduce(np.ones(2), name=tag)
        return False
    elif kind == "outsider":
        # Every rank adds every set, in the same order; set `me` lacks this rank.
        sets = [unison.add_process_set([r for r in range(n) if r != skip]) for skip in range(n)]
        with pytest.raises(unison.InvalidArgumentError,
                           match="rank %d is not in process set %d" % (me, sets[me].process_set_id)):
            unp.allreduce(np.ones(1), name=tag, process_set=sets[me])
        for s in sets:
            unison.remove_process_set(s)
    return True


def test_twenty_rounds_of_init_op_barrier_shutdown():
    unp.barrier()
    unison.shutdown()
    kinds = random.Random(2024)  # the same draws on every rank
    stagger = random.Random()    # different on every rank
    try:
        for round_number in range(ROUNDS):
            # every kind at least once, then random ones
            kind = KINDS[round_number] if round_number < len(KINDS) else kinds.choice(KINDS)
            time.sleep(stagger.uniform(0, 0.02))  # ranks arrive at different moments
            unison.init()
            if run_round(kind, round_number):
                unp.barrier()
            else:
                with pytest.raises(unison.UnisonError):
                    unp.barrier()
            time.sleep(stagger.uniform(0, 0.02))  # and leave at different moments
            unison.shutdown()
    finally:
        unison.init()  # the session's other suites expect an initialised job
    assert unp.allreduce(np.ones(1), op=unison.Sum, name="after.rounds")[0] == unison.size()
