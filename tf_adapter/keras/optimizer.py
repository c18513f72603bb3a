"""The Keras 3 DistributedOptimizer: a Keras optimizer whose apply()
(which apply_gradients() and model.fit's train step call) first averages
the gradients across ranks.

Like Horovod's, DistributedOptimizer(opt) returns a new optimizer of a
subclass of opt's class (same name), built from opt's config, so
isinstance checks and model.compile() see the optimizer they expect.

backward_passes_per_step=N accumulates N local gradients in optimizer
variables and reduces and applies them on the N-th call only (summed, or
averaged with average_aggregated_gradients=True), so ranks talk once per N
passes; between, variables and optimizer.iterations stay put.
"""
import sys
import warnings

import keras
import tensorflow as tf

from unison.process_sets import global_process_set
from unison.tensorflow.compression import Compression
from unison.tensorflow.gradient_tape import GradientReducer
from unison.tensorflow.ops import Average, Min, allreduce, xla_refusal


class _DistributedOptimizerMixin:
    """Placed before the wrapped optimizer's class in the new class's bases."""

    def _unison_configure(self, reducer, backward_passes_per_step, average_aggregated_gradients):
        # Plain Python state, set before build() and never tracked by Keras.
        self._unison_reducer = reducer
        self._unison_passes = int(backward_passes_per_step)
        self._unison_average_aggregated = average_aggregated_gradients
        self._unison_accumulators = None

    def register_local_var(self, var):
        """Keeps `var`'s gradient local: never reduced across ranks."""
        self._unison_reducer.register_local(var)

    def build(self, variables):
        # A LossScaleOptimizer builds the optimizer it wraps from its own
        # build(), before it first looks at gradients: the one moment this
        # optimizer can learn that one wraps it (Keras's compile wraps it so,
        # unasked, under a mixed_float16 policy).
        agree_on_skipped_steps(sys._getframe(1).f_locals.get("self"))
        if self.built:
            return
        super().build(variables)
        if self._unison_passes > 1:
            self._unison_accumulators = [self.add_variable_from_reference(v, name="unison_accumulated")
                                         for v in variables]
            self._unison_count = self.add_variable(shape=(), dtype="int64", name="unison_passes")

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            if not self.built:
                self.build(trainable_variables)
        variables = trainable_variables if trainable_variables is not None else list(self._trainable_variables)
        if self._unison_passes == 1:
            return super().apply(self._unison_reducer.reduce(grads, variables), trainable_variables)
        return self._accumulate_then_apply(grads, variables, trainable_variables)

    def _accumulate_then_apply(self, grads, variables, trainable_variables):
        accumulators = [self._unison_accumulators[self._get_variable_index(v)] for v in variables]
        for accumulator, grad in zip(accumulators, grads):
            if grad is not None:
                accumulator.assign_add(tf.convert_to_tensor(grad))
        self._unison_count.assign_add(1)

        def reduce_and_apply():
            scale = 1.0 / self._unison_passes if self._unison_average_aggregated else 1.0
            summed = [None if g is None else a.value * tf.constant(scale, dtype=a.dtype)
                      for a, g in zip(accumulators, grads)]
            super(_DistributedOptimizerMixin, self).apply(self._unison_reducer.reduce(summed, variables),
                                                          trainable_variables)
            for accumulator in accumulators:
                accumulator.assign(tf.zeros_like(accumulator))
            self._unison_count.assign(0)
            return tf.constant(True)

        due = tf.equal(self._unison_count, self._unison_passes)
        if tf.executing_eagerly():
            if bool(due):
                reduce_and_apply()
            return
        tf.cond(due, reduce_and_apply, lambda: tf.constant(False))


def agree_on_skipped_steps(optimizer):
    """A LossScaleOptimizer skips a step whose gradients are not finite, and
    it looks at them before calling apply() on the optimizer it wraps: around
    a DistributedOptimizer it would judge this rank's gradients alone, and a
    rank that skipped would leave the others in the step's allreduce (or
    pair its next step's with theirs). Keras 2's LossScaleOptimizer reduced
    first, through the optimizer's _aggregate_gradients; Keras 3 has no such
    hook. So its check becomes everyone's: a step is skipped on every rank
    when any rank's gradients are not finite, as one process would skip it
    for the summed gradients."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or \
            not isinstance(optimizer.inner_optimizer, _DistributedOptimizerMixin) or \
            getattr(optimizer, "_unison_agrees", False):
        return
    check_locally = optimizer.check_finite
    reducer = optimizer.inner_optimizer._unison_reducer
    if reducer.outside():
        return  # this rank's gradients are its own: so is its check
    process_set = reducer.process_set

    def check_finite(grads):
        finite = tf.cast(check_locally(grads), tf.int32)
        return tf.equal(allreduce(finite, op=Min, name="LossScaleOptimizer.finite", process_set=process_set), 1)
    optimizer.check_finite = check_finite
    optimizer._unison_agrees = True


def keep_collectives_out_of_xla(model):
    """Turns XLA off for `model`'s train step when its optimizer is a
    DistributedOptimizer whose collectives XLA cannot compile here (see
    ops.xla_refusal: on the CPU, allreduce lowers to XLA; on a GPU, or
    without the compiled kernels, it does not). Keras 3's default
    jit_compile='auto' turns XLA on wherever a GPU is visible, and the
    optimizer never sees the model to say so: unison.keras's callbacks and
    load_model call this, and Keras's own answer to a layer XLA cannot
    compile is the same (a warning, then the step without XLA). The
    optimizer reduces only by allreduce: sparse gradients are reduced
    dense under XLA."""
    if not isinstance(getattr(model, "optimizer", None), _DistributedOptimizerMixin) or not model.jit_compile:
        return
    why = xla_refusal("allreduce")
    if not why:
        return
    model.jit_compile = False
    model.train_function = None  # one already made with XLA would fail at its first step
    warnings.warn("unison: model %r trains without XLA (jit_compile=False): its DistributedOptimizer's collectives "
                  "cannot be compiled into the train step, as %s" % (model.name, why), stacklevel=3)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=global_process_set, scale_local_gradients=True):
    """A Keras 3 optimizer like `optimizer` that averages gradients across
    ranks before applying them (see the module's docstring)."""
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizerMixin, base), {"__module__": base.__module__})
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    distributed = cls.from_config(config)
    reducer = GradientReducer("DistributedOptimizer", compression, sparse_as_dense, op, gradient_predivide_factor,
                              num_groups, groups, process_set, scale_local_gradients)
    distributed._unison_configure(reducer, backward_passes_per_step, average_aggregated_gradients)
    return distributed


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                                op=Average, backward_passes_per_step=1, average_aggregated_gradients=False,
                                num_groups=0, groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """A DistributedOptimizer whose `local_layers` (a layer or a list) keep
    their own rank's gradients, as Horovod's."""
    distributed = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                       gradient_predivide_factor, op, backward_passes_per_step,
                                       average_aggregated_gradients, num_groups, groups, process_set,
                                       scale_local_gradients)
    distributed._unison_reducer.register_local_layers(local_layers)
    return distributed


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none):
    """Horovod's load_model: a saved Keras model whose optimizer comes back
    as a DistributedOptimizer holding the saved optimizer's state
    (iterations, momenta, moments), so that training resumes where it
    stopped. `custom_optimizers` are optimizer classes the saved model may
    name, handed to Keras with `custom_objects`.

    Horovod has Keras build the wrapped class directly, through
    custom_objects. Keras 3 resolves its built-in optimizers before it
    consults custom_objects, so here the model loads as saved, and its
    optimizer is then replaced by a DistributedOptimizer of the same class
    and config, built on the same variables, with the saved state copied in."""
    import keras
    objects = {cls.__name__: cls for cls in (custom_optimizers or [])}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    saved = getattr(model, "optimizer", None)
    if saved is None:  # saved uncompiled: nothing to wrap
        return model
    distributed = DistributedOptimizer(saved, compression=compression)
    if saved.built:
        distributed.build(model.trainable_variables)
        if [tuple(v.shape) for v in distributed.variables] != [tuple(v.shape) for v in saved.variables]:
            raise ValueError("unison: load_model(%r): the %s optimizer saved with the model has variables %s; a new "
                             "one built on the model has %s"
                             % (filepath, type(saved).__name__, [(v.path, tuple(v.shape)) for v in saved.variables],
                                [(v.path, tuple(v.shape)) for v in distributed.variables]))
        for mine, theirs in zip(distributed.variables, saved.variables):
            mine.assign(theirs)
    model.optimizer = distributed
    keep_collectives_out_of_xla(model)
    return model
