"""tfreduce: gradient all-reduce for synchronous data-parallel TensorFlow.

Every reduction takes the per-tower gradients as a K x N list
(``all_grads[k][n]``: tower k, variable n) and returns the reduced gradients
as a K x N list whose element [k][n] is placed on ``devices[k]``, built as an
explicit, device-placed TensorFlow subgraph. Importing tfreduce changes
nothing in TensorFlow.

The public names are loaded on first use (PEP 562), so that
``python -m tfreduce.launch``, which needs only the standard library, starts
its workers without first importing TensorFlow and Keras.
"""

import importlib

__version__ = "0.1.0"

# public name -> the module that owns it
_EXPORTS = {
    "ALGORITHMS": "tfreduce.registry",
    "allreduce_grads": "tfreduce.allreduce",
    "choose_algorithm": "tfreduce.registry",
    "Cluster": "tfreduce.cluster",
    "WorkerLostError": "tfreduce.failures",
    "CollectiveKeys": "tfreduce.collective",
    "Compression": "tfreduce.compression",
    "Compressor": "tfreduce.compression",
    "CrossDeviceOps": "tfreduce.distribute",
    "merge_grad_list": "tfreduce.contract",
    "logical_devices": "tfreduce.devices",
    "split_grad_list": "tfreduce.contract",
    "allreduce_grads_hierarchical": "tfreduce.allreduce",
    "default_groups": "tfreduce.hierarchical",
    "allreduce_grads_multiworker": "tfreduce.multiworker",
    "broadcast_variables_multiworker": "tfreduce.multiworker",
    "allreduce_grads_collective": "tfreduce.allreduce",
    "allreduce_grads_nccl": "tfreduce.allreduce",
    "allreduce_grads_flat": "tfreduce.allreduce",
    "broadcast_variables": "tfreduce.replicated",
    "max_replica_difference": "tfreduce.replicated",
    "allreduce_grads_ring": "tfreduce.allreduce",
    "PowerSGD": "tfreduce.powersgd",
    "Topology": "tfreduce.topology",
    "Traffic": "tfreduce.traffic",
    "analyze_traffic": "tfreduce.traffic",
    "bus_bandwidth": "tfreduce.traffic",
    "plan_allreduce": "tfreduce.allreduce",
    "predict": "tfreduce.costmodel",
    "predict_step": "tfreduce.stepmodel",
    "ReplicatedTrainer": "tfreduce.trainer",
    "Reduction": "tfreduce.reduction",
    "reduce_scatter": "tfreduce.collectives",
    "all_gather": "tfreduce.collectives",
    "broadcast": "tfreduce.collectives",
    "reduce": "tfreduce.collectives",
    "all_to_all": "tfreduce.collectives",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tfreduce' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
