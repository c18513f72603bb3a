"""Averaging gradients across ranks: DistributedGradientTape, and the
reduction that the Keras DistributedOptimizer shares with it."""
import tensorflow as tf

from unison.arguments import gradient_scaling, split_into_groups
from unison.exceptions import InvalidArgumentError
from unison.process_sets import global_process_set
from unison.compression import check_compressor
from unison.tensorflow.compression import Compression
from unison.tensorflow.ops import (Average, Sum, _alone, _grouped_allreduce, _grouped_allreduce_with_stand_ins,
                                   allreduce)


class GradientReducer:
    """Horovod's gradient averaging: op=Average over ranks (or Sum; Adasum
    is not offered), with gradient_predivide_factor f splitting the division
    into 1/f before the sum and f/size after it. Dense gradients go in one
    grouped node per group (num_groups of them, or `groups` as lists of
    variables; one for all by default, so the core fuses them all);
    IndexedSlices are allgathered unless sparse_as_dense.

    Variables registered as local (register_local) keep their own rank's
    gradient, divided by the set's size when scale_local_gradients (as
    Horovod: the loss of a data-parallel step is an average, so a local
    gradient then has the scale a reduced one has).

    A gradient this rank does not have (None: its batch never reached the
    variable) is, eagerly, sent as zeros marked as a stand-in: the others'
    gradients are averaged with it, as one process on the whole batch
    would average them, and it stays None where no rank had one. Horovod
    leaves it out, and the ranks that have it wait for it until the stall
    check. Inside a tf.function a None is fixed when the function is traced
    and a graph cannot return one by value, so there it stays None, unsent,
    as in Horovod: every rank must trace the same variables as used. An
    embedding whose gradient some ranks lack needs sparse_as_dense, since
    the stand-in is dense."""

    def __init__(self, prefix, compression=Compression.none, sparse_as_dense=False, op=Average,
                 gradient_predivide_factor=1.0, num_groups=0, groups=None, process_set=global_process_set,
                 scale_local_gradients=True):
        if op not in (Average, Sum):
            raise InvalidArgumentError("unison: gradients are reduced with Average or Sum, got op %r" % op)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise InvalidArgumentError("unison: gradient_predivide_factor needs op=Average")
        if isinstance(groups, int):
            num_groups, groups = groups, None
        check_compressor(compression, prefix)
        self.prefix = prefix
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.predivide = gradient_predivide_factor
        self.num_groups = num_groups
        self.groups = groups
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local = {}  # id -> variable; holding it keeps the id from being reused

    def register_local(self, variable):
        self._local[id(variable)] = variable

    def register_local_layers(self, layers):
        if layers is None:
            return
        for layer in layers if isinstance(layers, (list, tuple)) else [layers]:
            for variable in layer.trainable_weights:
                self.register_local(variable)

    def _local_gradient(self, grad):
        size = self.process_set.size()
        if not self.scale_local_gradients or size == 1 or self.outside():
            return grad
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values / tf.cast(size, grad.values.dtype), grad.indices, grad.dense_shape)
        return grad / tf.cast(size, grad.dtype)

    def _scaling(self):
        """(op, prescale, postscale) for the core."""
        return (self.op,) + gradient_scaling(self.op, self.predivide)

    def _partition(self, dense, variables):
        """Lists of indices into `dense`, one list per grouped node."""
        if self.groups is not None:
            position = {id(v): i for i, v in enumerate(variables)}
            listed = [[position[id(v)] for v in group if id(v) in position] for group in self.groups]
            taken = {i for group in listed for i in group}
            # Gradients no group names travel together, so they still fuse.
            groups = [[i for i in group if i in dense] for group in listed]
            groups.append([i for i in dense if i not in taken])
            return [g for g in groups if g]
        if self.num_groups > 0:
            return split_into_groups(dense, self.num_groups)
        return [dense] if dense else []

    def outside(self):
        """Whether this rank is outside the reducer's process set: there it
        keeps its own gradients, a plain optimizer's, as in Horovod (a
        script builds one optimizer or tape on every rank and steps it
        everywhere)."""
        return not self.process_set.included()

    def reduce(self, grads, variables):
        """The averaged gradients, in order; None stays None."""
        if _alone(self.process_set) or self.outside():
            return list(grads)
        grads = list(grads)
        # Named by position alone. Keras names layers from a per-process
        # counter, so a rank that built one more model first (say, rank 0
        # loading a checkpoint while the others build afresh) has other
        # variable paths for the same weights; names that differ would
        # never match across ranks.
        names = ["%s.%d" % (self.prefix, i) for i in range(len(variables))]
        op, prescale, postscale = self._scaling()
        out = list(grads)
        dense = []
        stand_ins = set()
        eager = tf.executing_eagerly()
        for i, g in enumerate(grads):
            if g is None:
                v = variables[i]
                dtype = tf.as_dtype(v.dtype)  # a Keras 3 variable's dtype is a string
                if eager and id(v) not in self._local and (dtype.is_floating or dtype.is_complex):
                    grads[i] = tf.zeros_like(v)
                    stand_ins.add(i)
                    dense.append(i)
                continue
            if id(variables[i]) in self._local:
                out[i] = self._local_gradient(g)
                continue
            if isinstance(g, tf.IndexedSlices):
                if self.sparse_as_dense:
                    grads[i] = tf.convert_to_tensor(g)
                    dense.append(i)
                else:
                    out[i] = allreduce(g, op=op, prescale_factor=prescale, postscale_factor=postscale,
                                       name=names[i], process_set=self.process_set)
            else:
                dense.append(i)
        for group in self._partition(dense, variables):
            wires, ctxs = zip(*[self.compression.compress(tf.convert_to_tensor(grads[i])) for i in group])
            if any(i in stand_ins for i in group):
                reduced = _grouped_allreduce_with_stand_ins(list(wires), [names[i] for i in group],
                                                            [i in stand_ins for i in group], op, prescale,
                                                            postscale, self.process_set)
            else:
                reduced = _grouped_allreduce(list(wires), [names[i] for i in group], op, prescale, postscale,
                                             self.process_set)
            for i, r, c in zip(group, reduced, ctxs):
                out[i] = None if r is None else self.compression.decompress(r, c)
        return out


class _DistributedGradientTape(tf.GradientTape):
    """A tf.GradientTape (the wrapped tape's own state, shared) whose
    gradient() returns gradients averaged across ranks."""

    def register_local_source(self, source):
        """Keeps `source`'s gradient local: never reduced across ranks."""
        self._unison_reducer.register_local(source)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads) if tf.nest.is_nested(sources) else [grads]
        reduced = self._unison_reducer.reduce(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(sources, reduced) if tf.nest.is_nested(sources) else reduced[0]


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Wraps a tf.GradientTape (recorded already, or to be entered) so that
    gradient() averages the gradients across ranks. register_local_source(v)
    exempts a variable (see GradientReducer)."""
    tape = _DistributedGradientTape.__new__(_DistributedGradientTape)
    tape.__dict__.update(gradtape.__dict__)
    tape._unison_reducer = GradientReducer("DistributedGradientTape", compression, sparse_as_dense, op,
                                           gradient_predivide_factor, num_groups, groups, process_set,
                                           scale_local_gradients)
    return tape


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """A DistributedGradientTape whose `local_layers` (a layer or a list)
    keep their own rank's gradients: model parallelism inside data
    parallelism, as Horovod's."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    tape._unison_reducer.register_local_layers(local_layers)
    return tape
