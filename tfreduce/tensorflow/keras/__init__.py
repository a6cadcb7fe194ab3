"""Horovod's Keras API (``horovod.tensorflow.keras``) for Keras 3 and Keras 2 on TensorFlow.

A Horovod Keras script moves to tfreduce by changing its import::

    import tfreduce.tensorflow.keras as hvd   # was: import horovod.tensorflow.keras as hvd

``DistributedOptimizer`` wraps any optimizer of Keras 3 or of tf_keras
(Keras 2, both its optimizer families); the callbacks broadcast the first
state, average the logged metrics and warm the learning rate up, and are
callbacks of the Keras ``tf.keras`` is (Keras 2 under
``TF_USE_LEGACY_KERAS=1``), as Horovod's; ``load_model`` reads a saved model
with its optimizer distributed. See docs/horovod.md.
"""

import tensorflow as tf

from tfreduce.buffers.compression import Compression
from tfreduce.tensorflow import ops
from tfreduce.tensorflow.keras import callbacks, elastic
from tfreduce.tensorflow.keras.data import DistributedBatches
from tfreduce.tensorflow.keras.optimizer import (DistributedOptimizer, PartialDistributedOptimizer,
                                                 load_model)
from tfreduce.tensorflow.process import (cross_rank, cross_size, init, is_initialized, local_rank,
                                         local_size, rank, shutdown, size)
from tfreduce.tensorflow.reduce_ops import (Average, Max, Min, ProcessSet, Product, Sum,
                                            global_process_set)
from tfreduce.tensorflow.sync_batch_norm import SyncBatchNormalization

__all__ = ["Average", "Compression", "DistributedBatches", "DistributedOptimizer", "Max", "Min",
           "PartialDistributedOptimizer", "ProcessSet", "Product", "Sum",
           "SyncBatchNormalization", "allgather",
           "allreduce", "broadcast", "broadcast_global_variables", "callbacks", "cross_rank",
           "cross_size", "elastic", "global_process_set", "init", "is_initialized", "load_model", "local_rank",
           "local_size", "rank", "shutdown", "size"]


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none):
    """The mean (op=Average, default) or sum over processes of a value (a number, an array).

    Returns:
      tf.Tensor, on this process's device.
    """
    return ops.allreduce(tf.constant(value, name=name), average=average, op=op,
                         prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                         compression=compression)


def allgather(value, name=None):
    """Every process's value concatenated along axis 0, in rank order (a tf.Tensor)."""
    return ops.allgather(tf.constant(value, name=name))


def broadcast(value, root_rank, name=None):
    """root_rank's value, on every process (a tf.Tensor)."""
    return ops.broadcast(tf.constant(value, name=name), root_rank)


def broadcast_global_variables(root_rank):
    """Horovod's TF1 broadcast of the global variables: TF2 has none.

    Raises:
      RuntimeError: always; use callbacks.BroadcastGlobalVariablesCallback
        or tfreduce.tensorflow.broadcast_variables.
    """
    raise RuntimeError(
        f"broadcast_global_variables({root_rank!r}): TensorFlow 2 has no global variables; "
        "pass callbacks.BroadcastGlobalVariablesCallback(root_rank) to fit, or call "
        "tfreduce.tensorflow.broadcast_variables(model.variables, root_rank)")
