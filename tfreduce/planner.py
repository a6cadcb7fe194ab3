"""Choosing the all-reduce for a machine: every candidate built and costed by the model.

``plan_allreduce`` builds each candidate reduction of the given gradient
shapes on the given device names in one scratch graph (nothing runs, no
device is needed), predicts its time on the topology with
``tfreduce.predict`` and returns the fastest, with the whole table, so the
choice can be read and checked.
"""

import tensorflow as tf

from tfreduce.allreduce import allreduce_grads
from tfreduce.costmodel import predict
from tfreduce.devices import is_gpu, normalize_devices
from tfreduce.hierarchical import default_groups
from tfreduce.topology import Topology

__all__ = ["Plan", "plan_allreduce", "PACK_SIZES"]

#: The pack sizes tried: none, 64 KiB (the default), 1 MiB, 4 MiB.
PACK_SIZES = (None, 64 * 2**10, 2**20, 4 * 2**20)


class Plan:
    """The fastest candidate, and every candidate's predicted time.

    Attributes:
      algorithm: str, a name in tfreduce.ALGORITHMS.
      options: dict of allreduce_grads options (pack_bytes, groups).
      seconds: float, its predicted time.
      table: list of (algorithm, options, seconds), fastest first.
    """

    def __init__(self, table):
        self.table = sorted(table, key=lambda row: row[2])
        self.algorithm, self.options, self.seconds = self.table[0]

    def kwargs(self):
        """{"algorithm": ..., **options}: what to pass to tfreduce.allreduce_grads."""
        return {"algorithm": self.algorithm, **self.options}

    def __repr__(self):
        return f"Plan({self.algorithm}, {self.options}, {self.seconds * 1e3:.3f} ms)"


def candidates(num_devices, on_gpus):
    """(algorithm, options) pairs to try for K devices."""
    algorithms = ["flat", "ring", "collective"] + (["nccl"] if on_gpus else [])
    groups = [default_groups(num_devices)]
    if num_devices % 4 == 0 and num_devices > 4:
        groups.append([list(range(g, g + 4)) for g in range(0, num_devices, 4)])
    out = []
    for pack_bytes in PACK_SIZES:
        out += [(a, {"pack_bytes": pack_bytes}) for a in algorithms]
        out += [("hierarchical", {"pack_bytes": pack_bytes, "groups": g}) for g in groups]
    return out


def plan_allreduce(shapes, devices, topology, dtype=tf.float32, average=True):
    """The all-reduce with the lowest predicted time for these gradients on this machine.

    Tries flat, hierarchical (the default groups and, for K a multiple of
    4 above 4, groups of four), ring, collective and, on GPU names, NCCL,
    each unpacked and with every size in PACK_SIZES.

    Args:
      shapes: list of N gradient shapes (lists of ints), e.g. the model's
        trainable variables' shapes.
      devices: list of K device names ("/gpu:k"); they need not exist here.
      topology: a tfreduce.Topology or a preset name, with at least K devices.
      dtype: tf.DType of the gradients.
      average: bool.

    Returns:
      Plan; ``tfreduce.allreduce_grads(grads, devices, **plan.kwargs())``.

    Raises:
      ValueError: no shapes, or a topology with fewer devices than K.
    """
    if not shapes:
        raise ValueError("plan_allreduce: give the shapes of at least one gradient")
    if isinstance(topology, str):
        topology = Topology.preset(topology)
    devices = normalize_devices(devices)
    if topology.num_devices < len(devices):
        raise ValueError(f"plan_allreduce: topology {topology.name!r} has "
                         f"{topology.num_devices} devices, fewer than the {len(devices)} given")
    table = []
    # One scratch graph: every candidate reduces the same inputs, and each
    # prediction walks back from its own outputs to them.
    with tf.Graph().as_default():
        grads = []
        for d in devices:
            with tf.device(d):
                grads.append([tf.zeros(s, dtype) for s in shapes])
        for algorithm, options in candidates(len(devices), all(map(is_gpu, devices))):
            out = allreduce_grads(grads, devices, average=average, algorithm=algorithm,
                                  **options)
            table.append((algorithm, options, predict(out, topology, inputs=grads).seconds))
    return Plan(table)
