"""unison.elastic's states and run decorator inside a plain job, from one
rank's point of view: sync() gives every rank rank 0's committed values,
restore() brings back exactly what was committed, a HostsUpdatedInterrupt
re-forms the job (shutdown and init on every rank) and runs the function
again, and a mismatch (a bug in the program) is raised, not retried.
(A dead rank in a plain job: test_elastic_launcher.py.)"""
import numpy as np
import pytest

import unison
import unison.elastic
import unison.numpy as unp

unison.init()
RANK, SIZE = unison.rank(), unison.size()


def test_sync_gives_every_rank_rank_0s_values():
    state = unison.elastic.ObjectState(epoch=RANK, weights=np.full(3, float(RANK)), names=["r%d" % RANK])
    state.sync()
    assert state.epoch == 0 and state.weights.tolist() == [0.0] * 3 and state.names == ["r0"]
    state.epoch = 5 + RANK
    state.restore()  # sync committed rank 0's values
    assert state.epoch == 0


def test_restore_brings_back_the_commit_not_later_changes_in_place():
    state = unison.elastic.ObjectState(batch=0, seen=[1, 2])
    state.batch, state.seen = 7, state.seen + [3]
    state.commit()  # a plain job: saves; no hosts to check
    state.seen.append(99)
    state.batch = 8
    state.restore()
    assert (state.batch, state.seen) == (7, [1, 2, 3])
    state.seen.append(42)
    state.restore()
    assert state.seen == [1, 2, 3]


def test_hosts_updated_re_forms_the_job_and_runs_again():
    state = unison.elastic.ObjectState(attempts=0, epoch=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(unison.size())])

    @unison.elastic.run
    def train(state):
        state.attempts += 1
        if state.attempts == 1:
            state.epoch = 3
            state.commit()
            raise unison.elastic.HostsUpdatedInterrupt(skip_sync=False)
        # The job was shut down and initialised again: collectives work.
        total = unp.allreduce(np.array([RANK + 1], dtype=np.int64), op=unison.Sum, name="after_reset")
        return int(total[0])

    assert train(state) == SIZE * (SIZE + 1) // 2
    assert state.attempts == 2 and state.epoch == 3 and resets == [SIZE]
    assert unison.is_initialized() and unison.size() == SIZE


def test_a_mismatch_is_raised_not_retried():
    state = unison.elastic.ObjectState(calls=0)

    @unison.elastic.run
    def train(state):
        state.calls += 1
        # Every rank submits the name with a different shape: a mismatch.
        unp.allreduce(np.zeros(RANK + 1), name="elastic.mismatch")

    with pytest.raises(unison.MismatchError):
        train(state)
    assert state.calls == 1
