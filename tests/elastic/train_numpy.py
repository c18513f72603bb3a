"""An elastic job with no framework: unison.elastic's ObjectState over
numpy. Each step adds the same global quantity however many ranks share
it, so the final value says exactly which steps were committed."""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from faults import fault_at, log, maybe_add_host, timed_kill_window  # noqa: E402

import unison  # noqa: E402
import unison.elastic  # noqa: E402
import unison.numpy as unp  # noqa: E402

STEPS = int(os.environ.get("ELASTIC_STEPS", "20"))
# At this step rank 0 takes a branch the others do not (an extra allreduce):
# a bug in the program, which no reset can mend.
BRANCH_AT = int(os.environ.get("ELASTIC_BRANCH_AT", "-1"))


def step_sum(step):
    """This rank's share of the step, summed over the ranks: exactly step + 1.
    A failure is logged (for the fault-injection benchmark's detection time)."""
    # Rank r holds the share (r + 1) / sum(1..n) of (step + 1).
    n = unison.size()
    share = (step + 1) * (unison.rank() + 1) / (n * (n + 1) / 2)
    fault_at(step)
    try:
        if step == BRANCH_AT and unison.rank() == 0:
            unp.allreduce(np.ones(1), name="extra")
        return unp.allreduce(np.full(3, share), op=unison.Sum, name="share")
    except unison.UnisonInternalError as error:
        log(event="detected", step=step, error=str(error))
        raise


def main():
    unison.init()
    if os.environ.get("ELASTIC_PLAIN"):  # no elastic API: a failure ends the job
        total = np.zeros(3)
        for step in range(STEPS):
            total += step_sum(step)
            time.sleep(0.02)
        log(event="done", rank=unison.rank(), size=unison.size(), step=STEPS, total=total.tolist())
        return
    state = unison.elastic.ObjectState(step=0, total=np.zeros(3))

    @unison.elastic.run
    def train(state):
        log(event="sync", rank=unison.rank(), size=unison.size(), step=state.step,
            horovods_names={n: os.environ.get("HOROVOD_" + n) for n in ("RANK", "SIZE", "LOCAL_RANK", "HOSTNAME")},
            local_rank=unison.local_rank())
        while state.step < STEPS:
            timed_kill_window(state.step, STEPS)
            maybe_add_host(state.step, unison.rank())
            state.total += step_sum(state.step)
            state.step += 1
            time.sleep(0.02)
            state.commit()

    train(state)
    log(event="done", rank=unison.rank(), size=unison.size(), step=state.step, total=state.total.tolist())


if __name__ == "__main__":
    main()
