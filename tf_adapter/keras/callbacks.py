"""Horovod's Keras callbacks, for Keras 3.

Put MetricAverageCallback before callbacks that read metrics (checkpoints,
ReduceLROnPlateau, early stopping), so that they see the averaged values.
"""
import keras
import numpy as np

from unison import basics
import unison.numpy as unp
from unison.process_sets import global_process_set
from unison.tensorflow.functions import broadcast_variables
from unison.tensorflow.keras.optimizer import keep_collectives_out_of_xla


class UnisonCallback(keras.callbacks.Callback):
    """Every unison.keras callback: model.fit hands it the model before it
    traces the train step, the one moment to keep a DistributedOptimizer's
    collectives out of XLA (see keep_collectives_out_of_xla)."""

    def set_model(self, model):
        super().set_model(model)
        keep_collectives_out_of_xla(model)


class BroadcastGlobalVariablesCallback(UnisonCallback):
    """Sets every rank's model and optimizer variables to root_rank's before
    the first training step, so all ranks start from the same state (and
    match a one-process run started from root_rank's weights)."""

    def __init__(self, root_rank=0, device="", local_variables=None, process_set=global_process_set):
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        # As Horovod: variables each rank keeps for itself are not broadcast.
        self.local_variables = [] if local_variables is None else list(local_variables)
        self.broadcast_done = False

    def _broadcast(self):
        if self.broadcast_done or not self.model.variables:  # not built yet: nothing to set
            return
        local = {id(v) for v in self.local_variables}
        variables = [v for v in self.model.variables if id(v) not in local]
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built and self.model.trainable_variables:
                optimizer.build(self.model.trainable_variables)
            variables += [v for v in optimizer.variables if id(v) not in local]
        broadcast_variables(variables, self.root_rank, process_set=self.process_set)
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        # Keras builds the model and its optimizer before this when the
        # input shape is known; otherwise the first batch does it.
        if self.model.built:
            self._broadcast()

    def on_train_batch_begin(self, batch, logs=None):
        self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        # A model whose input shape Keras learns from the first batch (a
        # Sequential without an Input) has no variables until that batch
        # has run: its ranks took one step from their own initial weights,
        # and take root_rank's from here, as Horovod's callback does for
        # every model.
        self._broadcast()


class MetricAverageCallback(UnisonCallback):
    """Replaces each epoch's metrics in `logs` by their average over ranks."""

    def __init__(self, device="", process_set=global_process_set):
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or self.process_set.size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float, np.number)) or
                      (hasattr(v, "shape") and np.ndim(v) == 0))
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = unp.allreduce(values, op=basics.Average, name="MetricAverageCallback",
                                 process_set=self.process_set)
        for key, value in zip(keys, averaged.tolist()):
            logs[key] = value


def _set_learning_rate(optimizer, value):
    try:
        optimizer.learning_rate = value
    except TypeError as e:
        raise TypeError("unison: this callback sets the learning rate, which an optimizer created with a "
                        "LearningRateSchedule does not allow; create it with a float learning_rate") from e


def _momentum_slots(optimizer):
    """The optimizer's velocity variables (Keras SGD with momentum), or []."""
    return list(getattr(optimizer, "momentums", None) or [])


class LearningRateScheduleCallback(UnisonCallback):
    """learning rate = initial_lr * multiplier(epoch) for start_epoch <=
    epoch < end_epoch (multiplier a number or a function of the epoch).
    staircase=True changes it at epoch boundaries; otherwise every batch,
    with a fractional epoch (steps_per_epoch read from fit() when None).

    momentum_correction: when the rate changes from old to new, SGD's
    accumulated velocity was built with the old rate; it is scaled by
    new/old so the next step moves as if the new rate had always held
    (Goyal et al., "Accurate, Large Minibatch SGD", 2017). Keras 3 keeps
    momentum as a constant inside the compiled step, so the correction is
    applied to the velocity variables directly, which is the same update.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None, verbose=0):
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0

    def _in_range(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch):
        self._set_rate(float(self.initial_lr * self.multiplier(epoch)))

    def _set_rate(self, new):
        optimizer = self.model.optimizer
        old = float(np.asarray(optimizer.learning_rate))
        if new == old:
            return
        _set_learning_rate(optimizer, new)
        if self.momentum_correction and old > 0:
            for velocity in _momentum_slots(optimizer):
                velocity.assign(velocity * (new / old))

    def on_train_begin(self, logs=None):
        if self.initial_lr is None:
            self.initial_lr = float(np.asarray(self.model.optimizer.learning_rate))
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ValueError("unison: a non-staircase schedule needs steps_per_epoch; fit() did not know it")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._adjust(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self.staircase:
            epoch = self.current_epoch + float(batch) / self.steps_per_epoch
            if self._in_range(epoch):
                self._adjust(epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(np.asarray(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from initial_lr / size() to initial_lr over
    warmup_epochs, batch by batch (Goyal et al.'s gradual warmup): large
    global batches then train stably from the start."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        size = basics.size()

        def multiplier(epoch):
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch,
                         verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.warmup_epochs - 1:
            # The last batch ran at a fraction short of the full rate.
            self._set_rate(float(self.initial_lr))
            if self.verbose and basics.rank() == 0:
                print("\nEpoch %d: finished gradual learning rate warmup to %g." % (epoch + 1, self.initial_lr))
        super().on_epoch_end(epoch, logs)


class BestModelCheckpoint(UnisonCallback, keras.callbacks.ModelCheckpoint):
    """Keeps the best model seen so far (save_best_only), written by rank 0
    only; the other ranks track nothing and write nothing. Horovod's
    arguments first, in Horovod's order (its estimator supplied the path);
    `filepath` after them."""

    def __init__(self, monitor="val_loss", verbose=0, mode="auto", save_freq="epoch", filepath="best.keras",
                 save_weights_only=False):
        super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)

    def _save_model(self, *args, **kwargs):
        if basics.rank() == 0:
            super()._save_model(*args, **kwargs)
