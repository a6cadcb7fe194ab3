"""Hierarchical (group) all-reduce for any K and any partition into groups.

The DGX-1 scheme of tf_cnn_benchmarks and tensorpack
(``allreduce_grads_hierarchical``; TF's HierarchicalCopyAllReduce): the eight
GPUs form two groups of four joined by fast links inside a group and fewer
links between groups. Each gradient is summed inside each group on a group
root, the group roots combine their sums, and the total goes back through the
roots to every device. Only one copy of each gradient crosses between groups
per direction.

tensorpack's version asserts ``num_gpu == 8`` and scales by 1/K on every
device. This one takes any K >= 1 and any partition ``groups`` (uneven too),
pairs the roots by position inside their groups (for K=8 with the default
groups: devices i and i+4, as on the DGX-1), spreads the roots by bytes, and
divides by K once, on the device that forms the total.
"""

import tensorflow as tf

from tfreduce.contract import nbytes, validate_groups
from tfreduce.stage import Stage
from tfreduce.primitives import RootBalancer, broadcast, finish_sum, reduce_to, sum_order

__all__ = ["HierarchicalStage", "default_groups"]


def default_groups(num_devices):
    """The default partition: two halves, the first one larger for odd K.

    ``default_groups(8) == [[0, 1, 2, 3], [4, 5, 6, 7]]`` (the DGX-1 layout),
    ``default_groups(3) == [[0, 1], [2]]``, ``default_groups(1) == [[0]]``.

    Args:
      num_devices: int K >= 1.

    Returns:
      list[list[int]].
    """
    if num_devices < 2:
        return [list(range(num_devices))]
    half = (num_devices + 1) // 2
    return [list(range(half)), list(range(half, num_devices))]


class HierarchicalStage(Stage):
    """Per entry: sums inside groups on paired roots, combine the roots, broadcast back.

    Args:
      groups: list of lists of device indices partitioning 0..K-1, or None
        for ``default_groups(K)``; checked here as far as K is not needed
        (ints, no group empty, no index twice or left out below the
        largest), against K in ``bind``.

    Raises:
      TypeError, ValueError: groups that cannot partition 0..K-1 for any K.
    """

    name = "hierarchical"

    def __init__(self, groups=None):
        self.groups = None if groups is None else validate_groups(groups)

    def bind(self, devices):
        groups = default_groups(len(devices)) if self.groups is None else self.groups
        return HierarchicalStage(validate_groups(groups, len(devices)))

    def reduce(self, buffers, ctx):
        devices, groups = ctx.devices, self.groups
        num_towers = len(devices)
        positions = max(len(g) for g in groups)
        balancer = RootBalancer(num_towers)
        sizes = [nbytes(t) for t in buffers[0]]
        out = [[None] * len(sizes) for _ in range(num_towers)]  # K x M
        for m in sum_order(sizes):
            # Position p minimising the summed load of the roots it selects.
            p = min(range(positions),
                    key=lambda q: sum(balancer.load[g[q % len(g)]] for g in groups))
            roots = [g[p % len(g)] for g in groups]
            for r in roots:
                balancer.load[r] += sizes[m]
            combiner = balancer.pick(roots, sizes[m])
            group_sums = [
                reduce_to([buffers[i][m] for i in g], devices[r], name=f"entry{m}_group{gi}_sum")
                for gi, (g, r) in enumerate(zip(groups, roots))]
            if ctx.wire_sum:
                # Compressed: the group sums cross between roots in 16 bits too
                # (one more rounding each; of means when averaging: the
                # frame prescaled); the combiner sums them in float32.
                group_sums = [finish_sum(t, buffers[0][m].dtype, num_towers, False,
                                         devices[r], name=f"entry{m}_group{gi}_wire")
                              for gi, (t, r) in enumerate(zip(group_sums, roots))]
            total = reduce_to(group_sums, devices[combiner], name=f"entry{m}_sum")
            total = finish_sum(total, ctx.dtypes[m], num_towers, ctx.average,
                               devices[combiner], name=f"entry{m}_total")
            for gi, (g, r) in enumerate(zip(groups, roots)):
                root_total = total
                if r != combiner:
                    with tf.device(devices[r]):
                        root_total = tf.identity(total, name=f"entry{m}_group{gi}_total")
                for k, t in zip(g, broadcast(root_total, [devices[i] for i in g],
                                             name_fmt=f"entry{m}_dev{{}}_out", indices=g)):
                    out[k][m] = t
        return out
