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
from tfreduce.frame import Stage, run_stage
from tfreduce.packing import DEFAULT_PACK_BYTES
from tfreduce.primitives import RootBalancer, broadcast, finish_sum, reduce_to, sum_order

__all__ = ["HierarchicalStage", "allreduce_grads_hierarchical", "default_groups"]


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


def allreduce_grads_hierarchical(all_grads, devices=None, average=False, groups=None,
                                 pack_bytes=DEFAULT_PACK_BYTES, sparse_as_dense=False,
                                 compression=None):
    """All-reduces K x N gradients inside groups, then across the group roots.

    Same name and first arguments as tensorpack's
    ``tensorpack.graph_builder.utils.allreduce_grads_hierarchical``, so it is a
    drop-in replacement, and it gives the same values for K=8.

    For each gradient (after packing):

    1. pick a position p in the groups (least-loaded by bytes); the root of
       group g is ``groups[g][p % len(groups[g])]``, so roots pair up by
       position (devices i and i+4 for the default K=8 groups);
    2. ``group{g}_sum``: the group's gradients summed on its root;
    3. ``total``: the group sums combined on one of the roots (the least
       loaded), divided by K there if ``average``;
    4. ``group{g}_total``: the total copied to every other root;
    5. ``dev{k}_out``: each root copies the total to the devices of its group.

    K x N contract, K=2, N=2, sum::

        [[A, B],      ->   [[A+C, B+D],    # on devices[0]
         [C, D]]            [A+C, B+D]]    # on devices[1]

    Args:
      all_grads: list of K lists of N gradients (``tf.Tensor``,
        ``tf.IndexedSlices`` or None); ``all_grads[k][n]`` from tower k.
      devices: list of K device strings, or None to use each tower's tensor
        device.
      average: bool; divide by K once per gradient, where the total is formed.
      groups: list of lists of device indices that covers 0..K-1 exactly once,
        e.g. ``[[0, 1, 2, 3], [4, 5, 6, 7]]``; default ``default_groups(K)``.
      pack_bytes: int bytes or None; gradients under this size are packed
        into buffers of about this size (packing.PackPlan); default
        ``packing.DEFAULT_PACK_BYTES`` (64 KiB); None or 0 packs nothing.
      sparse_as_dense: bool; reduce ``tf.IndexedSlices`` as dense tensors
        instead of gathering their rows on one device.
      compression: None, "fp16" or "bf16": float32/float64 gradients are
        cast to that 16-bit dtype on their tower before crossing devices and
        cast back on each tower after (``frame.COMPRESSIONS``).

    Returns:
      list[list[tf.Tensor]], K x N; ``out[k][n]`` is placed on ``devices[k]``
      with the shape and dtype of ``all_grads[k][n]``; None stays None.
      float16/bfloat16 are summed in float32 (group sums cross between groups
      in float32) and rounded once.

    Raises:
      TypeError, ValueError: bad gradients or devices (see
        ``contract.validate_grads``), or groups that do not partition 0..K-1.
    """
    return run_stage(HierarchicalStage(groups), all_grads, devices, average, pack_bytes,
                     sparse_as_dense, compression)


class HierarchicalStage(Stage):
    """Per entry: sums inside groups on paired roots, combine the roots, broadcast back.

    Args:
      groups: list of lists of device indices partitioning 0..K-1, or None
        for ``default_groups(K)``; checked against K in ``bind``.
    """

    name = "hierarchical"

    def __init__(self, groups=None):
        self.groups = groups

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
                # (one more rounding each), already scaled by 1/K when
                # averaging so that a mean cannot overflow; the combiner sums
                # them in float32 and only rounds.
                group_sums = [finish_sum(t, buffers[0][m].dtype, num_towers, ctx.average,
                                         devices[r], name=f"entry{m}_group{gi}_wire")
                              for gi, (t, r) in enumerate(zip(group_sums, roots))]
            total = reduce_to(group_sums, devices[combiner], name=f"entry{m}_sum")
            total = finish_sum(total, ctx.dtypes[m], num_towers, ctx.average and not ctx.wire_sum,
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
