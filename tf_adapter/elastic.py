"""unison.tensorflow.elastic (hvd.elastic): elastic training for TensorFlow
and Keras.

    state = hvd.elastic.TensorFlowKerasState(model, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(..., callbacks=[hvd.elastic.CommitStateCallback(state), ...])

See unison.elastic for what happens when a rank dies or hosts change.
"""
import functools

import tensorflow as tf

from unison import basics, elastic, exceptions
from unison.elastic import HostsUpdatedInterrupt, State  # noqa: F401
from unison.tensorflow.functions import broadcast_object, broadcast_variables

# The unison errors a collective inside a tf.function can end with. TensorFlow
# hands them back as its own OpError, naming ours in the message.
_FAILURES = [exceptions.MismatchError, exceptions.RankFailedError, exceptions.ShutDownError,
             exceptions.DeadlockError, exceptions.StalledError, exceptions.UnisonInternalError]


def _as_unison_error(error):
    for failure in _FAILURES:
        if failure.__name__ + ":" in error.message:
            return failure(error.message)
    return None


def run(func):
    """hvd.elastic.run: as unison.elastic.run, and a failed collective inside
    a tf.function (model.fit's steps) counts as the unison error it was."""

    @functools.wraps(func)
    def translated(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as error:
            failure = _as_unison_error(error)
            if failure is None:
                raise
            raise failure from error

    return elastic.run(translated)


class ObjectState(elastic.ObjectState):
    """Picklable values kept as attributes."""

    def __init__(self, bcast_object=broadcast_object, get_rank=basics.rank, **kwargs):
        super().__init__(bcast_object, get_rank, **kwargs)


class TensorFlowState(ObjectState):
    """tf.Variables (their values) and picklable values, kept together."""

    def __init__(self, variables=None, session=None, **kwargs):
        if session is not None:
            raise ValueError("unison: TensorFlowState(session=...) is TensorFlow 1's; TensorFlow 2 runs eagerly")
        self.variables = list(variables or [])
        self._values = [v.numpy() for v in self.variables]
        super().__init__(**kwargs)

    def save(self):
        self._values = [v.numpy() for v in self.variables]
        super().save()

    def restore(self):
        for variable, value in zip(self.variables, self._values):
            variable.assign(value)
        super().restore()

    def sync(self):
        if self.variables:
            broadcast_variables(self.variables, root_rank=0)
        super().sync()
        self.save()  # a newcomer's commit is what it just received


class TensorFlowKerasState(ObjectState):
    """A Keras model, its optimizer (the model's own unless given) and
    picklable values, kept together."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._weights, self._optimizer_values = model.get_weights(), []
        super().__init__(**kwargs)
        self.save()

    def _optimizer_variables(self):
        if self.optimizer is None:
            return []
        if not self.optimizer.built and self.model.trainable_variables:
            # Built now, so that every rank has the same variables to
            # broadcast whether or not it has taken a step.
            self.optimizer.build(self.model.trainable_variables)
        return list(self.optimizer.variables)

    def save(self):
        self._weights = self.model.get_weights()
        self._optimizer_values = [v.numpy() for v in self._optimizer_variables()]
        super().save()

    def restore(self):
        self.model.set_weights(self._weights)
        for variable, value in zip(self._optimizer_variables(), self._optimizer_values):
            variable.assign(value)
        super().restore()

    def sync(self):
        broadcast_variables(list(self.model.variables) + self._optimizer_variables(), root_rank=0)
        super().sync()
        self.save()
