"""SyncBatchNormalization: Keras batch normalization whose training
statistics are those of the global batch, across every rank.

Only the statistics change: the layer is Keras's own BatchNormalization
with its moments computed from every rank's rows. Two allreduces (Sum) per
call: the per-channel sums and counts give the global mean; the sums of
squared deviations from that mean give the global variance (centred, so
no cancellation where the mean is large). Ranks may hold different batch
sizes, an empty one included. Their gradients flow through the allreduces
(whose gradient is the allreduce of the gradient), so each rank's
backward accounts for every rank's use of its rows.
"""
import keras
import tensorflow as tf

from unison import process_sets
from unison.process_sets import global_process_set
from unison.tensorflow.ops import Sum, _alone, _grouped_allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Keras BatchNormalization whose training statistics (mean and variance) are
    computed over the global batch of every rank in `process_set`, by one grouped allreduce a
    step; at inference it uses its moving averages, as the Keras layer does. Every rank of
    the set must call it in the same order."""

    def __init__(self, *args, process_set=global_process_set, fused=None, **kwargs):
        # `fused` is Horovod's (and Keras 2's) argument; Keras 3 has no fused
        # kernel, and the statistics here are computed by hand anyway.
        super().__init__(*args, **kwargs)
        process_sets.check_member(process_set, "SyncBatchNormalization")
        self._process_set = process_set

    def _moments(self, inputs, mask):
        if _alone(self._process_set):
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        if mask is None:
            weights = tf.ones_like(inputs)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)), inputs.dtype)
        base = "%s.moments" % (getattr(self, "path", None) or self.name)
        local_sum = tf.reduce_sum(inputs * weights, axes)
        local_count = tf.reduce_sum(weights, axes)
        total_sum, total_count = _grouped_allreduce([local_sum, local_count], [base + ".sum", base + ".count"],
                                                    Sum, 1.0, 1.0, self._process_set)
        count = tf.maximum(total_count, 1.0)
        mean = total_sum / count
        centred = (inputs - mean) * weights
        squares = _grouped_allreduce([tf.reduce_sum(centred * centred, axes)], [base + ".squares"],
                                     Sum, 1.0, 1.0, self._process_set)[0]
        return mean, squares / count
