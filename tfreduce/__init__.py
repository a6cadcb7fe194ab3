"""tfreduce: gradient all-reduce for synchronous data-parallel TensorFlow.

Every reduction takes the per-tower gradients as a K x N list
(``all_grads[k][n]``: tower k, variable n) and returns the reduced gradients
as a K x N list whose element [k][n] is placed on ``devices[k]``, built as an
explicit, device-placed TensorFlow subgraph. Importing tfreduce changes
nothing in TensorFlow.
"""

from tfreduce.allreduce import ALGORITHMS, allreduce_grads, choose_algorithm
from tfreduce.cluster import Cluster, WorkerLostError
from tfreduce.contract import merge_grad_list, split_grad_list
from tfreduce.hierarchical import allreduce_grads_hierarchical, default_groups
from tfreduce.multiworker import allreduce_grads_multiworker, broadcast_variables_multiworker
from tfreduce.nccl_ops import CollectiveKeys, allreduce_grads_collective, allreduce_grads_nccl
from tfreduce.replicated import (allreduce_grads_flat, broadcast_variables,
                                 max_replica_difference)
from tfreduce.ring import allreduce_grads_ring
from tfreduce.traffic import Traffic, analyze_traffic

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "Cluster",
    "CollectiveKeys",
    "Traffic",
    "WorkerLostError",
    "allreduce_grads",
    "allreduce_grads_collective",
    "allreduce_grads_flat",
    "allreduce_grads_hierarchical",
    "allreduce_grads_multiworker",
    "allreduce_grads_nccl",
    "allreduce_grads_ring",
    "analyze_traffic",
    "broadcast_variables",
    "broadcast_variables_multiworker",
    "choose_algorithm",
    "default_groups",
    "max_replica_difference",
    "merge_grad_list",
    "split_grad_list",
]
