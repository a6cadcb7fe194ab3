"""tfreduce: gradient all-reduce for synchronous data-parallel TensorFlow.

Every reduction takes the per-tower gradients as a K x N list
(``all_grads[k][n]``: tower k, variable n) and returns the reduced gradients
as a K x N list whose element [k][n] is placed on ``devices[k]``, built as an
explicit, device-placed TensorFlow subgraph. Importing tfreduce changes
nothing in TensorFlow.
"""

from tfreduce.allreduce import ALGORITHMS, allreduce_grads, choose_algorithm
from tfreduce.contract import merge_grad_list, split_grad_list
from tfreduce.hierarchical import allreduce_grads_hierarchical, default_groups
from tfreduce.nccl_ops import CollectiveKeys, allreduce_grads_collective, allreduce_grads_nccl
from tfreduce.replicated import (allreduce_grads_flat, broadcast_variables,
                                 max_replica_difference)

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "CollectiveKeys",
    "allreduce_grads",
    "allreduce_grads_collective",
    "allreduce_grads_flat",
    "allreduce_grads_hierarchical",
    "allreduce_grads_nccl",
    "broadcast_variables",
    "choose_algorithm",
    "default_groups",
    "max_replica_difference",
    "merge_grad_list",
    "split_grad_list",
]
