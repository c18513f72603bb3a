"""An elastic Keras job (model.fit, KerasState and the elastic callbacks):
the fixed global batches of reference.py, each rank fitting its share of
every step's batch, committed after every batch."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from faults import fault_at, log, log_end_of_keras_job, maybe_add_host, wait_for_growth  # noqa: E402
from reference import BATCH, STEPS, batch_of, make_keras_model  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import unison.keras as hvd  # noqa: E402

STEPS_PER_FIT = 4


class Faults(keras.callbacks.Callback):
    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_begin(self, batch, logs=None):
        fault_at(self.state.step)  # the global step this batch is
        maybe_add_host(self.state.step, hvd.rank())
        wait_for_growth(self.state.step, hvd.size(), self.state.commit)


def main():
    hvd.init()
    model = make_keras_model(hvd.DistributedOptimizer)
    state = hvd.elastic.KerasState(model, step=0, batch=0)

    @hvd.elastic.run
    def train(state):
        log(event="sync", rank=hvd.rank(), size=hvd.size(), step=state.step)
        while state.step < STEPS:
            # The next few global batches, this rank's share of each, as one fit().
            steps = range(state.step, min(STEPS, state.step + STEPS_PER_FIT))
            shares = [[a[hvd.rank()::hvd.size()] for a in batch_of(s)] for s in steps]
            x, y = np.concatenate([s[0] for s in shares]), np.concatenate([s[1] for s in shares])
            first = state.step
            model.fit(x, y, batch_size=BATCH // hvd.size(), epochs=1, shuffle=False, verbose=0,
                      callbacks=[Faults(state), hvd.elastic.UpdateBatchStateCallback(state),
                                 keras.callbacks.LambdaCallback(
                                     on_train_batch_end=lambda b, logs=None: setattr(state, "step", first + b + 1)),
                                 hvd.elastic.CommitStateCallback(state)])

    train(state)
    log_end_of_keras_job(model, state.step, hvd.rank(), hvd.size())


if __name__ == "__main__":
    main()
