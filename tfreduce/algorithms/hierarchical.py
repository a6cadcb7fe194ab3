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
divides by K once, on the device that forms the total. That device, one of
the roots, adds its own group's tensors and the other roots' group sums in
one sum: the copies are those of summing its group first, with one pass
over the data fewer (on K=8 logical CPU devices, where a copy is free,
ResNet50's mean went from 1.65x to 1.42x the time of one 8-way sum).
"""

import tensorflow as tf

from tfreduce.basis.contract import nbytes, validate_groups
from tfreduce.blocks.primitives import (RootBalancer, broadcast, concat_rows, finish_sum,
                                        reduce_to, split_rows, sum_order)
from tfreduce.blocks.stage import Stage

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

    @classmethod
    def plan_options(cls, num_devices):
        """Two halves (``default_groups``), and groups of 4 when K > 4 is a multiple of 4."""
        groups = [default_groups(num_devices)]
        if num_devices % 4 == 0 and num_devices > 4:
            groups.append([list(range(g, g + 4)) for g in range(0, num_devices, 4)])
        return [{"groups": g} for g in groups]

    def __init__(self, groups=None):
        self.groups = None if groups is None else validate_groups(groups)

    def bind(self, devices):
        groups = default_groups(len(devices)) if self.groups is None else self.groups
        return HierarchicalStage(validate_groups(groups, len(devices)))

    def _pick_roots(self, balancer, size, fixed=None):
        # (roots, combiner): the group roots at the position p that loads them
        # least (paired by position, i and i+4 for the DGX-1 groups), and the
        # least-loaded root to combine on; ``fixed`` (a tower) roots its group
        # and combines.
        groups = self.groups
        positions = max(len(g) for g in groups)
        p = min(range(positions),
                key=lambda q: sum(balancer.load[g[q % len(g)]] for g in groups))
        roots = [fixed if fixed in g else g[p % len(g)] for g in groups]
        for r in roots:
            balancer.load[r] += size
        return roots, (fixed if fixed is not None else balancer.pick(roots, size))

    def _total(self, buffers, ctx, m, roots, combiner):
        # The sum of entry m, finished on the combiner. The other roots sum
        # their groups; the combiner adds its own group's tensors and those
        # sums in one pass (the same copies as summing its group first, one
        # pass over the data fewer: 11 S read and written for K=8 in two
        # groups instead of 15 S).
        devices = ctx.devices
        own, others = [], []
        for gi, (g, r) in enumerate(zip(self.groups, roots)):
            if r == combiner:
                own = [buffers[i][m] for i in g]
                continue
            group_sum = reduce_to([buffers[i][m] for i in g], devices[r],
                                  name=f"entry{m}_group{gi}_sum")
            if ctx.wire_sum:
                # Compressed: a group sum crosses to the combiner in 16 bits
                # too (one more rounding; of means when averaging: the frame
                # prescaled); the combiner sums in float32.
                group_sum = finish_sum(group_sum, buffers[0][m].dtype, len(devices), False,
                                       devices[r], name=f"entry{m}_group{gi}_wire")
            others.append(group_sum)
        total = reduce_to(own + others, devices[combiner], name=f"entry{m}_sum")
        return finish_sum(total, ctx.dtypes[m], len(devices), ctx.average,
                          devices[combiner], name=f"entry{m}_total")

    def _to_roots(self, total, devices, m, roots, combiner):
        # The combiner's result copied to every other root.
        at_roots = []
        for gi, r in enumerate(roots):
            if r == combiner:
                at_roots.append(total)
                continue
            with tf.device(devices[r]):
                at_roots.append(tf.identity(total, name=f"entry{m}_group{gi}_total"))
        return at_roots

    def reduce(self, buffers, ctx):
        devices = ctx.devices
        balancer = RootBalancer(len(devices))
        sizes = [nbytes(t) for t in buffers[0]]
        out = [[None] * len(sizes) for _ in devices]  # K x M
        for m in sum_order(sizes):
            roots, combiner = self._pick_roots(balancer, sizes[m])
            total = self._total(buffers, ctx, m, roots, combiner)
            for g, root_total in zip(self.groups, self._to_roots(total, devices, m, roots,
                                                                  combiner)):
                for k, t in zip(g, broadcast(root_total, [devices[i] for i in g],
                                             name_fmt=f"entry{m}_dev{{}}_out", indices=g)):
                    out[k][m] = t
        return out

    # The other collectives, through the group roots the same way.
    collectives = ("reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")

    def reduce_scatter(self, buffers, ctx):
        devices, num_towers = ctx.devices, len(ctx.devices)
        balancer = RootBalancer(num_towers)
        sizes = [nbytes(t) for t in buffers[0]]
        out = [[None] * len(sizes) for _ in devices]  # K x M
        for m in sum_order(sizes):
            roots, combiner = self._pick_roots(balancer, sizes[m])
            total = self._total(buffers, ctx, m, roots, combiner)
            for g, r, root_total in zip(self.groups, roots,
                                        self._to_roots(total, devices, m, roots, combiner)):
                with tf.device(devices[r]):
                    shards = split_rows(root_total, num_towers, name=f"entry{m}_dev{r}_split")
                for k in g:
                    with tf.device(devices[k]):
                        out[k][m] = tf.identity(shards[k], name=f"entry{m}_dev{k}_out")
        return out

    def all_gather(self, buffers, ctx):
        devices = ctx.devices
        balancer = RootBalancer(len(devices))
        sizes = [sum(nbytes(row[m]) for row in buffers) for m in range(len(buffers[0]))]
        out = [[None] * len(sizes) for _ in devices]  # K x M
        for m in sum_order(sizes):
            roots, _ = self._pick_roots(balancer, sizes[m])
            # Each root collects its group's tensors, then the other roots'.
            own = {}
            for g, r in zip(self.groups, roots):
                for i in g:
                    with tf.device(devices[r]):
                        own[i] = buffers[i][m] if i == r else tf.identity(
                            buffers[i][m], name=f"entry{m}_dev{i}_to_root{r}")
            for gi, (g, r) in enumerate(zip(self.groups, roots)):
                with tf.device(devices[r]):
                    whole = concat_rows([own[i] for i in range(len(devices))],
                                        name=f"entry{m}_group{gi}_concat")
                for k, t in zip(g, broadcast(whole, [devices[i] for i in g],
                                             name_fmt=f"entry{m}_dev{{}}_out", indices=g)):
                    out[k][m] = t
        return out

    def broadcast(self, row, ctx):
        devices = ctx.devices
        balancer = RootBalancer(len(devices))
        out = [[None] * len(row) for _ in devices]  # K x M
        for m, t in enumerate(row):
            roots, _ = self._pick_roots(balancer, nbytes(t), fixed=ctx.root)
            for g, root_copy in zip(self.groups, self._to_roots(t, devices, m, roots, ctx.root)):
                for k, copy in zip(g, broadcast(root_copy, [devices[i] for i in g],
                                                name_fmt=f"entry{m}_dev{{}}_out", indices=g)):
                    out[k][m] = copy
        return out

    def reduce_to_root(self, buffers, ctx):
        balancer = RootBalancer(len(ctx.devices))
        out = []
        for m in range(len(buffers[0])):
            roots, _ = self._pick_roots(balancer, nbytes(buffers[0][m]), fixed=ctx.root)
            out.append(self._total(buffers, ctx, m, roots, ctx.root))
        return out
