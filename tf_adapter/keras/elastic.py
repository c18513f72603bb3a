"""unison.keras.elastic (hvd.elastic): elastic training with model.fit.

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]

    @hvd.elastic.run
    def train(state):
        model.fit(..., initial_epoch=state.epoch, callbacks=callbacks)

Put the two Update callbacks before CommitStateCallback: Keras calls
callbacks in list order, and a commit should hold the counts they update.
"""

from unison.elastic import HostsUpdatedInterrupt, State  # noqa: F401
from unison.tensorflow.elastic import ObjectState, TensorFlowKerasState, TensorFlowState, run  # noqa: F401
from unison.tensorflow.keras.callbacks import UnisonCallback

KerasState = TensorFlowKerasState


class CommitStateCallback(UnisonCallback):
    """Commits the state every `batches_per_commit` batches, and at the end
    of every epoch."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_left = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_left = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_left -= 1
        if self.batches_left <= 0:
            self.state.commit()
            self.batches_left = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()
        self.batches_left = self.batches_per_commit


class UpdateBatchStateCallback(UnisonCallback):
    """Keeps state.batch at the number of batches done in this epoch."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(UnisonCallback):
    """Keeps state.epoch at the number of epochs done. fit() counts epochs
    from its initial_epoch, which a resumed fit sets to state.epoch."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1
