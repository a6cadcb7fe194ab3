"""SyncBatchNormalization: BatchNorm whose batch statistics are those of the global batch.

Each process normalises with the mean and variance of every process's
examples together (two all-reduces: the sums and the count, then the summed
squared deviations from the global mean), so a run on P processes computes
what one process computes on the whole global batch, and the moving
statistics stay equal on every process. The backward pass all-reduces the
gradients of those sums the same way.

Sources: Horovod's SyncBatchNormalization (horovod.tensorflow); the
cross-replica BatchNorm of Peng et al., "MegDet: A Large Mini-Batch Object
Detector" (2018).
"""

import keras
import tensorflow as tf

from tfreduce.tensorflow.ops import grouped_allreduce
from tfreduce.tensorflow.reduce_ops import Sum

__all__ = ["SyncBatchNormalization"]


@tf.custom_gradient
def _global_sum(x):
    # The sum over processes of x; its gradient is the sum over processes of
    # the upstream gradients (every process's loss depends on every x).
    def grad(dy):
        return grouped_allreduce([dy], op=Sum)[0]

    return grouped_allreduce([x], op=Sum)[0], grad


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization with the statistics of the batches of every process.

    Takes BatchNormalization's arguments. In training, the mean and variance
    over the reduction axes are computed over the examples of all processes
    (float32 or wider); in inference the moving statistics are used, as
    BatchNormalization does.

    Raises:
      ValueError: a mask is given (masked inputs are not supported).
    """

    def _moments(self, inputs, mask):
        if mask is not None:
            raise ValueError(f"{self.name}: SyncBatchNormalization does not support masks")
        axes = list(self._reduction_axes)
        shape = tf.shape(inputs)
        count = tf.cast(tf.reduce_prod(tf.gather(shape, axes)), inputs.dtype)
        total = _global_sum(tf.concat([tf.reshape(tf.reduce_sum(inputs, axes), [-1]),
                                       tf.reshape(count, [1])], axis=0))
        mean = total[:-1] / total[-1]
        deviation = tf.square(inputs - tf.stop_gradient(tf.reshape(mean, self._broadcast(
            inputs, axes))))
        variance = _global_sum(tf.reduce_sum(deviation, axes)) / tf.stop_gradient(total[-1])
        return mean, variance

    def _broadcast(self, inputs, axes):
        # mean's shape broadcast against inputs: 1 on the reduction axes.
        return [1 if a in axes else -1 for a in range(inputs.shape.rank)]
