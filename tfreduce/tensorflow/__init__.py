"""Horovod's TensorFlow API (``horovod.tensorflow``) on TensorFlow's own collectives.

A Horovod TF2 script moves to tfreduce by changing its import::

    import tfreduce.tensorflow as hvd      # was: import horovod.tensorflow as hvd

and its launch, ``tfreduce-launch --workers N -- python train.py`` (was
``horovodrun -np N python train.py``). One process per device; ``init()``
reads TF_CONFIG, which the launcher sets. Underneath, every reduction is
tfreduce's multi-worker one (packing, compression, TF's gRPC collectives).
See docs/horovod.md for the migration table and what differs.
"""

from tfreduce.tensorflow.functions import (allgather_object, broadcast_, broadcast_global_variables,
                                           broadcast_object, join, local_rank_op, local_size_op,
                                           rank_op, size_op)
from tfreduce.tensorflow.ops import (Compression, allgather, allreduce, broadcast,
                                     broadcast_variables, grouped_allgather, grouped_allreduce)
from tfreduce.tensorflow.process import (ccl_built, cross_rank, cross_size, cuda_built,
                                         ddl_built, gloo_built, gloo_enabled, init,
                                         is_homogeneous, is_initialized, local_rank, local_size,
                                         mpi_built, mpi_enabled, mpi_threads_supported,
                                         nccl_built, rank, rocm_built, shutdown, size)
from tfreduce.tensorflow.reduce_ops import (Adasum, Average, Max, Min, Product, ProcessSet, Sum,
                                            global_process_set)
from tfreduce.tensorflow.scatter import alltoall, grouped_reducescatter, reducescatter
from tfreduce.tensorflow.sync_batch_norm import SyncBatchNormalization
from tfreduce.tensorflow.tape import DistributedGradientTape, PartialDistributedGradientTape
from tfreduce.tensorflow import elastic, util

_executing_eagerly = util._executing_eagerly  # Horovod's name (private there too), which its scripts call

__all__ = ["Adasum", "Average", "Compression", "DistributedGradientTape", "Max", "Min",
           "PartialDistributedGradientTape",
           "ProcessSet", "Product", "Sum", "SyncBatchNormalization",
           "allgather", "allgather_object", "allreduce", "alltoall", "broadcast", "broadcast_",
           "broadcast_global_variables", "broadcast_object", "broadcast_variables",
           "cross_rank", "elastic", "cross_size", "global_process_set", "grouped_allgather",
           "grouped_allreduce", "grouped_reducescatter", "init", "is_initialized", "join",
           "local_rank", "local_rank_op", "local_size", "local_size_op", "rank", "rank_op",
           "reducescatter", "shutdown", "size", "size_op", "ccl_built", "cuda_built",
           "ddl_built", "gloo_built", "gloo_enabled", "is_homogeneous", "mpi_built",
           "mpi_enabled", "mpi_threads_supported", "nccl_built", "rocm_built"]
