"""shutdown() then init() always gives a working job, the way a test
harness uses it: 20 rounds of init, a random op (some fail on purpose,
some join, one has a peer shut down first), barrier, shutdown, with ranks
arriving and leaving at different moments. Every rank draws the same ops
from the same seed; what each must see is exact."""
import atexit
import ctypes
import json
import os
import random
import re
import subprocess
import sys
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


def test_a_forked_child_answers_queries_but_acts_for_the_rank_in_nothing():
    """A process forked from a rank after init() (a DataLoader's worker)
    keeps rank() and size(), but every op, wait and process set it tries
    fails at once: it has none of the rank's threads, and acting for the rank
    would corrupt the job. Its exit, Python's atexit and C's statics
    included, must not tell the peers that the rank left: afterwards the
    rank's own op, in flight across the fork, completes with every rank's
    values."""
    me, n = unison.rank(), unison.size()
    across_fork = unp.allreduce_async(np.full(3, me + 1, np.int64), op=unison.Sum, name="fork.across")
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: report what it saw, then exit as a script would
        os.close(read_end)
        seen = {"queries": [unison.rank(), unison.size(), unison.local_rank(), unison.is_initialized()]}
        unison.init()  # harmless, as a second init() always is
        for what, attempt in [("allreduce", lambda: unp.allreduce(np.ones(2), name="fork.child")),
                              ("synchronize", lambda: unp.synchronize(across_fork)),
                              ("barrier", unp.barrier),
                              ("add_process_set", lambda: unison.add_process_set([0]))]:
            try:
                attempt()
                seen[what] = "returned"
            except unison.UnisonError as e:
                seen[what] = "%s: %s" % (type(e).__name__, e)
        os.write(write_end, json.dumps(seen).encode())
        os.close(write_end)
        atexit._run_exitfuncs()      # unison.shutdown() among them
        ctypes.CDLL(None).exit(0)    # C's exit: the statics' destructors run
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        seen = json.loads(pipe.read() or "{}")
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert seen.pop("queries") == [me, n, unison.local_rank(), True]
    refusal = ("UnsupportedError: unison: this process (pid %d) was forked from rank %d (pid %d) after init(); "
               "only the rank's own process takes part in its collectives" % (child, me, os.getpid()))
    assert sorted(seen) == ["add_process_set", "allreduce", "barrier", "synchronize"]
    for what, outcome in seen.items():
        assert outcome.startswith(refusal), (what, outcome)
    assert unp.synchronize(across_fork).tolist() == [n * (n + 1) // 2] * 3
    assert unp.allreduce(np.full(2, me, np.int64), op=unison.Sum, name="fork.after").tolist() == [n * (n - 1) // 2] * 2
    unp.barrier()


def test_init_in_a_process_that_inherited_a_rank_fails_at_once():
    """A process the rank starts inherits its identity (UNISON_RANK...): a
    worker of multiprocessing's spawn method re-runs the script's top level,
    init() included. In a job of several it must fail at once, naming the
    rank, not join the job as the rank's second copy and leave every rank
    waiting for the start timeout. (This suite runs at 2 and 3 ranks; a
    job of one shares nothing, and there a child starts a job of its own:
    tests/test_solo.py.)"""
    me, n = unison.rank(), unison.size()
    script = "import unison; unison.init(); print(unison.rank(), unison.size())"
    child = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True, text=True,
                           timeout=60)
    assert child.returncode != 0
    assert re.search(r"UnsupportedError: unison: init\(\) in process \d+, which inherited its environment "
                     r"from rank %d \(process %d\) of a running job" % (me, os.getpid()), child.stderr), child.stderr
    if "UNISON_RANK" in os.environ:  # the launcher's own variables (and horovodrun's names for them):
        # without them the child is a job of one
        alone = {k: v for k, v in os.environ.items() if not k.startswith(("UNISON_", "HOROVOD_"))}
        child = subprocess.run([sys.executable, "-c", script], env=alone, capture_output=True, text=True, timeout=60)
        assert (child.returncode, child.stdout.split()) == (0, ["0", "1"]), child.stderr
    assert unp.allreduce(np.full(1, me, np.int64), op=unison.Sum, name="inherited.after").tolist() == [n * (n - 1) // 2]


def test_init_takes_horovods_comm_when_it_is_the_whole_job_and_refuses_any_other():
    n, me = unison.size(), unison.rank()
    unp.barrier()
    unison.shutdown()
    try:
        # Horovod's list form: every rank, in order.
        unison.init(comm=list(range(n)))
        assert unp.allreduce(np.full(2, me + 1, np.int64), op=unison.Sum, name="comm.whole").tolist() == [
            n * (n + 1) // 2] * 2
        unp.barrier()
        unison.shutdown()
        job = "this job is ranks 0 to %d, the ones its launcher started, in that order" % (n - 1)
        for comm, named in (([0], "names ranks [0], but " + job),
                            (list(range(n))[::-1], "names ranks %s, but %s" % (list(range(n))[::-1], job)),
                            ("rank 0", "give an mpi4py communicator or a list of ranks")):
            with pytest.raises(unison.UnsupportedError, match=re.escape(named)):
                unison.init(comm=comm)
            assert not unison.is_initialized()  # refused: stopped, as before the call
        # The same comm again, once running, changes nothing.
        unison.init()
        unison.init(comm=list(range(n)))
        with pytest.raises(unison.UnsupportedError, match=re.escape("names ranks [0]")):
            unison.init(comm=[0])
        assert unison.is_initialized()  # a job this call did not start goes on
    finally:
        unison.init()
    assert unp.allreduce(np.ones(1), op=unison.Sum, name="after.comm")[0] == n
