"""Horovod's TensorFlow API (``horovod.tensorflow``) on TensorFlow's own collectives.

A Horovod TF2 script moves to tfreduce by changing its import::

    import tfreduce.tensorflow as hvd      # was: import horovod.tensorflow as hvd

and its launch, ``tfreduce-launch --workers N -- python train.py`` (was
``horovodrun -np N python train.py``). One process per device; ``init()``
reads TF_CONFIG, which the launcher sets. Underneath, every reduction is
tfreduce's multi-worker one (packing, compression, TF's gRPC collectives).
See docs/horovod.md for the migration table and what differs.
"""

from tfreduce.tensorflow.ops import (Average, Compression, ProcessSet, Sum, allgather,
                                     allreduce, broadcast, broadcast_variables,
                                     global_process_set, grouped_allgather, grouped_allreduce)
from tfreduce.tensorflow.process import (cross_rank, cross_size, init, is_initialized,
                                         local_rank, local_size, rank, shutdown, size)
from tfreduce.tensorflow.scatter import alltoall, grouped_reducescatter, reducescatter
from tfreduce.tensorflow.sync_batch_norm import SyncBatchNormalization
from tfreduce.tensorflow.tape import DistributedGradientTape

__all__ = ["Average", "Compression", "DistributedGradientTape", "ProcessSet", "Sum",
           "SyncBatchNormalization",
           "allgather", "allreduce", "alltoall", "broadcast", "broadcast_variables",
           "cross_rank", "cross_size", "global_process_set", "grouped_allgather",
           "grouped_allreduce", "grouped_reducescatter", "init", "is_initialized",
           "local_rank", "local_size", "rank", "reducescatter", "shutdown", "size"]
