"""tfreduce: gradient all-reduce for synchronous data-parallel TensorFlow.

Every reduction takes the per-tower gradients as a K x N list
(``all_grads[k][n]``: tower k, variable n) and returns the reduced gradients
as a K x N list whose element [k][n] is placed on ``devices[k]``, built as an
explicit, device-placed TensorFlow subgraph. Importing tfreduce changes
nothing in TensorFlow.

The public names are loaded on first use (PEP 562), so that
``python -m tfreduce.launch``, which needs only the standard library, starts
its workers without first importing TensorFlow and Keras.

The modules are in packages named for their layers (docs/architecture.md).
A module's path before that move (``tfreduce.hierarchical``,
``tfreduce.replicated``, ``tfreduce.nccl_ops``, ...) still imports, as the
same module object: ``import tfreduce.hierarchical`` is
``tfreduce.algorithms.hierarchical``.
"""

import importlib
import importlib.util
import sys

__version__ = "0.1.0"

# public name -> the module that owns it
_EXPORTS = {
    "ALGORITHMS": "tfreduce.algorithms.registry",
    "allreduce_grads": "tfreduce.doors.allreduce",
    "choose_algorithm": "tfreduce.algorithms.registry",
    "Cluster": "tfreduce.workers.cluster",
    "cluster_from_environment": "tfreduce.workers.environment",
    "WorkerLostError": "tfreduce.workers.failures",
    "CollectiveKeys": "tfreduce.blocks.collective",
    "Compression": "tfreduce.buffers.compression",
    "Compressor": "tfreduce.buffers.compression",
    "CrossDeviceOps": "tfreduce.doors.distribute",
    "merge_grad_list": "tfreduce.basis.contract",
    "logical_devices": "tfreduce.basis.devices",
    "split_grad_list": "tfreduce.basis.contract",
    "allreduce_grads_hierarchical": "tfreduce.doors.allreduce",
    "default_groups": "tfreduce.algorithms.hierarchical",
    "allreduce_grads_multiworker": "tfreduce.doors.multiworker",
    "broadcast_variables_multiworker": "tfreduce.doors.multiworker",
    "allreduce_grads_collective": "tfreduce.doors.allreduce",
    "allreduce_grads_nccl": "tfreduce.doors.allreduce",
    "allreduce_grads_flat": "tfreduce.doors.allreduce",
    "broadcast_variables": "tfreduce.algorithms.replicated",
    "max_replica_difference": "tfreduce.algorithms.replicated",
    "allreduce_grads_ring": "tfreduce.doors.allreduce",
    "PowerSGD": "tfreduce.algorithms.powersgd",
    "Topology": "tfreduce.basis.topology",
    "Traffic": "tfreduce.analysis.traffic",
    "analyze_traffic": "tfreduce.analysis.traffic",
    "bus_bandwidth": "tfreduce.analysis.traffic",
    "plan_allreduce": "tfreduce.doors.allreduce",
    "predict": "tfreduce.analysis.costmodel",
    "predict_step": "tfreduce.doors.stepmodel",
    "ReplicatedTrainer": "tfreduce.trainer",
    "Reduction": "tfreduce.choice.reduction",
    "reduce_scatter": "tfreduce.doors.collectives",
    "all_gather": "tfreduce.doors.collectives",
    "broadcast": "tfreduce.doors.collectives",
    "reduce": "tfreduce.doors.collectives",
    "all_to_all": "tfreduce.doors.collectives",
}

__all__ = sorted(_EXPORTS)

# package -> the modules that were at the top level before it held them
_PACKAGED = {
    "basis": ["tf_config", "startup", "choices", "topology", "collective_rules", "devices",
              "contract", "shards"],
    "buffers": ["packing", "compression"],
    "blocks": ["primitives", "collective", "stage"],
    "algorithms": ["frame", "replicated", "hierarchical", "ring", "nccl_ops", "registry",
                   "powersgd"],
    "analysis": ["graphwalk", "traffic", "timeline", "costmodel", "hostprobe", "profiler",
                 "planner"],
    "workers": ["watchdog", "progress", "stragglers", "failures", "cluster", "localcluster",
                "consistency", "crossworker"],
    "choice": ["reduction", "collective_build"],
    "doors": ["allreduce", "multiworker", "collectives", "stepmodel", "distribute"],
    "trainer": ["models"],
}
#: {old module name: its package}: ``tfreduce.<name>`` still imports.
MOVED = {name: package for package, names in _PACKAGED.items() for name in names}


class _OldPaths:
    """Imports ``tfreduce.<old name>`` as the module at its new path (a meta path finder).

    The loader puts the real module in ``sys.modules`` under the old name,
    so both names are one module object: a monkeypatch or an isinstance
    check through either sees the same thing.
    """

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.partition(".")
        if prefix != __name__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None  # the default module, replaced in exec_module

    def exec_module(self, module):
        name = module.__name__.partition(".")[2]
        sys.modules[module.__name__] = importlib.import_module(f"{__name__}.{MOVED[name]}.{name}")


if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
    sys.meta_path.append(_OldPaths())


def __getattr__(name):
    if name in MOVED:  # tfreduce.<old module name>, imported by its old path
        return importlib.import_module(f"{__name__}.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tfreduce' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
