"""Batch normalization with statistics computed over the whole global batch (Keras 3 layer).

In training, each rank sums its batch's per-channel weights and values; one allreduce gives
the global mean, a second the global sum of squared deviations from it (two passes: no
E[x^2] - E[x]^2 cancellation). Both allreduces are differentiable, so gradients flow through
the global statistics. Weight and bias gradients stay local, like every other gradient:
``DistributedOptimizer`` averages them.
"""

import keras
import tensorflow as tf

from ..common.process_sets import global_process_set
from .collectives import Sum, member_count
from .differentiable import allreduce


@keras.saving.register_keras_serializable(package="spark_hvd")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose training statistics are those of every
    rank's batch together (the arguments are BatchNormalization's).

    Moving statistics are updated from the global statistics, so they stay identical on every
    rank. Inference uses the moving statistics, as usual. ``fused`` is accepted for Horovod
    compatibility and must be False; ``process_set`` picks the ranks normalized together.
    """

    def __init__(self, fused=False, process_set=global_process_set, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if kwargs.get("synchronized"):
            raise ValueError("synchronized=True is tf.distribute's synchronization; "
                             "SyncBatchNormalization already synchronizes over spark_hvd")
        super().__init__(**kwargs)
        self._process_set = process_set

    @tf.autograph.experimental.do_not_convert
    def _moments(self, inputs, mask):
        if member_count(self._process_set) == 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        if mask is None:
            weights = tf.ones_like(inputs)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)),
                              inputs.dtype)
        local = tf.concat([tf.reshape(tf.reduce_sum(weights, axes), [-1]),
                           tf.reshape(tf.reduce_sum(weights * inputs, axes), [-1])], 0)
        total = allreduce(local, op=Sum, process_set=self._process_set)
        count, sums = tf.split(total, 2)
        count = tf.maximum(count, 1.0)
        stat_shape = tf.shape(tf.reduce_sum(inputs, axes))
        mean = tf.reshape(sums / count, stat_shape)
        centered = inputs - tf.reshape(mean, _kept_shape(inputs, axes))
        sq = tf.reshape(tf.reduce_sum(weights * tf.square(centered), axes), [-1])
        variance = allreduce(sq, op=Sum, process_set=self._process_set) / count
        return mean, tf.reshape(variance, tf.shape(mean))


def _kept_shape(inputs, axes):
    """The shape of ``inputs`` reduced over ``axes`` with keepdims (for broadcasting)."""
    rank = inputs.shape.rank
    dims = tf.unstack(tf.shape(inputs))
    return tf.stack([1 if (i in axes or i - rank in axes) else dims[i] for i in range(rank)])
