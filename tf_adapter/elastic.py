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
    """tf.Variables (their values) and picklable values, kept together.

    Eagerly, `variables` are read and assigned directly. With `session` (a
    tf.compat.v1.Session), as in Horovod's TF1 elastic jobs, they are that
    session's graph's variables, every global variable when none are named
    (the optimizer's slots included, so a restore brings back its
    momentum too), read and assigned through the session."""

    def __init__(self, variables=None, session=None, **kwargs):
        self.session = session
        if session is None:
            self.variables = list(variables or [])
        else:
            # The ops this state runs are built once, here, into the session's graph.
            with session.graph.as_default():
                self.variables = list(tf.compat.v1.global_variables() if variables is None else variables)
                fed = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape) for v in self.variables]
                self._assign = (tf.group(*[v.assign(f) for v, f in zip(self.variables, fed)]), fed)
                self._broadcast = tf.group(*broadcast_variables(self.variables, root_rank=0))
        self._values = self._read()
        super().__init__(**kwargs)

    def _read(self):
        if self.session is None:
            return [v.numpy() for v in self.variables]
        return self.session.run(self.variables)

    def save(self):
        """Keeps the variables' current values (and the other state's) as the commit to restore to."""
        self._values = self._read()
        super().save()

    def restore(self):
        """Sets the variables (and the other state) back to their last commit, after a failure."""
        if self.session is None:
            for variable, value in zip(self.variables, self._values):
                variable.assign(value)
        else:
            assign, fed = self._assign
            self.session.run(assign, feed_dict=dict(zip(fed, self._values)))
        super().restore()

    def sync(self):
        """Sets every rank's variables (and the other state) to rank 0's, and commits them."""
        if self.variables:
            if self.session is None:
                broadcast_variables(self.variables, root_rank=0)
            else:
                self.session.run(self._broadcast)
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
        """Keeps the model's weights and its optimizer's variables (and the other state) as the commit."""
        self._weights = self.model.get_weights()
        self._optimizer_values = [v.numpy() for v in self._optimizer_variables()]
        super().save()

    def restore(self):
        """Sets the model's weights and its optimizer's variables back to their last commit."""
        self.model.set_weights(self._weights)
        for variable, value in zip(self._optimizer_variables(), self._optimizer_values):
            variable.assign(value)
        super().restore()

    def sync(self):
        """Sets every rank's weights and optimizer variables to rank 0's, and commits them."""
        broadcast_variables(list(self.model.variables) + self._optimizer_variables(), root_rank=0)
        super().sync()
        self.save()
