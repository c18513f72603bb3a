"""hvd.DistributedOptimizer as `unison.tensorflow` offers it: one entry for
both kinds of optimizer a TensorFlow script may hold, as Horovod's.

- A Keras optimizer goes to the Keras DistributedOptimizer
  (unison.tensorflow.keras), which reduces in apply().
- A TF1-style `tf.compat.v1.train.Optimizer` (GradientDescentOptimizer,
  MomentumOptimizer, AdamOptimizer...) is wrapped here: compute_gradients()
  returns the gradients averaged across ranks, and apply_gradients(), the
  slots and the variables are the wrapped optimizer's. minimize() is
  compute_gradients() then apply_gradients(), so it averages too. Works
  eagerly, inside tf.function and in a TF1 graph run by a
  tf.compat.v1.Session.

backward_passes_per_step=N (TF1-style): each compute_gradients() adds the
local gradients to accumulators; the N-th reduces their sum (divided by N
with average_aggregated_gradients) and returns it, the others return the
local gradients as they are. apply_gradients() applies only after a
reduction, and otherwise only advances `global_step` when given one, so
the variables change once every N passes, by the averaged aggregate.
"""
import tensorflow as tf

from unison.process_sets import global_process_set
from unison.tensorflow.compression import Compression
from unison.tensorflow.gradient_tape import GradientReducer
from unison.tensorflow.ops import Average


class _LegacyDistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A tf.compat.v1.train.Optimizer whose gradients are averaged across ranks."""

    def __init__(self, optimizer, reducer, backward_passes_per_step, average_aggregated_gradients, name,
                 use_locking):
        super().__init__(use_locking=use_locking, name=name or "Distributed" + optimizer.get_name())
        self._optimizer = optimizer
        self._unison_reducer = reducer
        self._passes = backward_passes_per_step
        self._average_aggregated = average_aggregated_gradients
        self._accumulators = None   # one per gradient (None where the gradient is None), made at first use
        self._passes_seen = None    # passes accumulated since the last reduction

    def compute_gradients(self, *args, **kwargs):
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self._passes == 1:
            grads = self._unison_reducer.reduce(grads, variables)
        else:
            grads = self._accumulate(grads, variables)
        return list(zip(grads, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        if self._passes == 1:
            return self._optimizer.apply_gradients(grads_and_vars, global_step, name)
        if self._passes_seen is None:
            raise ValueError("unison: with backward_passes_per_step=%d, apply_gradients() applies what "
                             "compute_gradients() accumulated and reduced; call compute_gradients() (or "
                             "minimize()) first" % self._passes)
        grads_and_vars = list(grads_and_vars)

        # Every state change below is a control dependency of what is
        # returned: a TF1 session runs only what a fetch needs (eagerly and
        # in tf.function these dependencies change nothing).
        def apply():
            with tf.control_dependencies([self._optimizer.apply_gradients(grads_and_vars, global_step, name)]):
                return tf.constant(True)

        def skip():
            with tf.control_dependencies([] if global_step is None else [global_step.assign_add(1)]):
                return tf.constant(False)

        # Read after compute_gradients() has counted this pass (and reset the
        # count if it reduced).
        with tf.control_dependencies([g for g, _ in grads_and_vars if g is not None]):
            just_reduced = tf.equal(self._passes_seen.read_value(), 0)
        if tf.executing_eagerly():
            return apply() if bool(just_reduced) else skip()
        return tf.cond(just_reduced, apply, skip)

    def _accumulate(self, grads, variables):
        dense = [None if g is None else self._dense(g, v) for g, v in zip(grads, variables)]
        if self._accumulators is None:
            with tf.init_scope():   # created once, outside any function being traced
                self._accumulators = [None if g is None else tf.Variable(tf.zeros(g.shape, g.dtype), trainable=False)
                                      for g in dense]
                self._passes_seen = tf.Variable(0, dtype=tf.int64, trainable=False)
        added = [accumulator.assign_add(g) for accumulator, g in zip(self._accumulators, dense)
                 if accumulator is not None and g is not None]
        added.append(self._passes_seen.assign_add(1))
        present = [i for i, a in enumerate(self._accumulators) if a is not None]

        def reduce():
            scale = 1.0 / self._passes if self._average_aggregated else 1.0
            summed = [self._accumulators[i].read_value() * tf.cast(scale, dense[i].dtype) for i in present]
            reduced = self._unison_reducer.reduce(summed, [variables[i] for i in present])
            with tf.control_dependencies([r for r in reduced if r is not None]):
                resets = [self._accumulators[i].assign(tf.zeros_like(dense[i])) for i in present]
                resets.append(self._passes_seen.assign(0))
            with tf.control_dependencies(resets):
                return [tf.identity(r) for r in reduced]

        def local():
            return [dense[i] for i in present]

        # As in apply_gradients(), state changes are dependencies of what is
        # returned, for TF1 sessions.
        with tf.control_dependencies(added):
            due = tf.equal(self._passes_seen.read_value(), self._passes)
        if tf.executing_eagerly():
            chosen = reduce() if bool(due) else local()
        else:
            chosen = tf.cond(due, reduce, local)
            chosen = list(chosen) if isinstance(chosen, (list, tuple)) else [chosen]
        out = list(dense)
        for i, g in zip(present, chosen):
            out[i] = g
        return out

    def _dense(self, grad, variable):
        if not isinstance(grad, tf.IndexedSlices):
            return grad
        if self._unison_reducer.sparse_as_dense:
            return tf.convert_to_tensor(grad)
        raise ValueError("unison: the gradient of %s is sparse (IndexedSlices); backward_passes_per_step > 1 "
                         "accumulates dense gradients only: pass sparse_as_dense=True"
                         % getattr(variable, "name", "a variable"))

    # The wrapped optimizer's slots and variables, so that checkpoints and
    # scripts that read them see the optimizer they built.
    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True):
    """An optimizer like `optimizer` whose gradients are averaged across
    ranks: a Keras optimizer (see unison.tensorflow.keras.DistributedOptimizer)
    or a tf.compat.v1.train.Optimizer (see this module's docstring).
    Arguments in Horovod's order; device_dense and device_sparse are
    accepted and ignored, as everywhere in unison."""
    if int(backward_passes_per_step) != backward_passes_per_step or backward_passes_per_step < 1:
        raise ValueError("unison: backward_passes_per_step must be a whole number of at least 1, got %r"
                         % (backward_passes_per_step,))
    if isinstance(optimizer, tf.keras.optimizers.Optimizer):
        from unison.tensorflow.keras.optimizer import DistributedOptimizer as keras_distributed
        return keras_distributed(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                 gradient_predivide_factor, op, backward_passes_per_step,
                                 average_aggregated_gradients, num_groups, groups, process_set,
                                 scale_local_gradients)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        reducer = GradientReducer("DistributedOptimizer", compression, sparse_as_dense, op,
                                  gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
        return _LegacyDistributedOptimizer(optimizer, reducer, int(backward_passes_per_step),
                                           average_aggregated_gradients, name, use_locking)
    raise ValueError("unison: DistributedOptimizer wraps a Keras optimizer or a tf.compat.v1.train.Optimizer; "
                     "got %s" % type(optimizer).__name__)
