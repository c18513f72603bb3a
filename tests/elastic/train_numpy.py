"""An elastic job with no framework: unison.elastic's ObjectState over
numpy. Each step adds the same global quantity however many ranks share
it, so the final value says exactly which steps were committed."""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from faults import fault_at, log, maybe_add_host  # noqa: E402

import unison  # noqa: E402
import unison.elastic  # noqa: E402
import unison.numpy as unp  # noqa: E402

STEPS = int(os.environ.get("ELASTIC_STEPS", "20"))


def main():
    unison.init()
    state = unison.elastic.ObjectState(step=0, total=np.zeros(3))

    @unison.elastic.run
    def train(state):
        log(event="sync", rank=unison.rank(), size=unison.size(), step=state.step)
        while state.step < STEPS:
            maybe_add_host(state.step, unison.rank())
            # Rank r holds the share (r + 1) / sum(1..n) of the step's (step + 1):
            # the Sum is step + 1 on every rank, whatever the size.
            n = unison.size()
            share = (state.step + 1) * (unison.rank() + 1) / (n * (n + 1) / 2)
            fault_at(state.step, unison.rank())
            state.total += unp.allreduce(np.full(3, share), op=unison.Sum, name="share")
            state.step += 1
            time.sleep(0.02)
            state.commit()

    train(state)
    log(event="done", rank=unison.rank(), size=unison.size(), step=state.step, total=state.total.tolist())


if __name__ == "__main__":
    main()
