"""A fixed summation tree: the same bits for any number of towers (``deterministic=True``).

Floating-point addition is not associative, so the bits of a sum depend on
the order of its terms; an all-reduce's order depends on K, the algorithm
(ring hops, group roots, TF's collective ring), the pack size and the
order buffers are ready in. A deterministic reduction fixes the order to
one tree over the M leaves (a trainer's micro-batches): each level adds
adjacent pairs (0+1, 2+3, ...) with two-input ``tf.add`` ops, and an odd
last node goes up unchanged.

When each of K towers holds s = M / K consecutive leaves and s is a power
of two, tower k's leaves are one node of that tree, so each tower sums its
own subtree and the all-reduce sums only the levels above it: the same
tree over the K tower sums. ``TreeStage`` builds that all-reduce from any
stage's exchanges, which copy and never add: an all-to-all brings tower
j's piece of shard k to device k, device k sums its K pieces in the tree,
and the stage's all-gather copies the summed shards back to every device.
The bytes moved are those of a reduce-scatter plus an all-gather, the
ring's; each element is summed in the same order whatever the algorithm,
the pack size and K. (Demmel and Nguyen, "Fast reproducible floating-point
summation", ARITH 2013, survey other ways; a fixed tree is the one that
costs no extra arithmetic.)
"""

import tensorflow as tf

from tfreduce.blocks.primitives import accumulation_dtype, split_rows
from tfreduce.blocks.stage import Stage

__all__ = ["tree_sum", "tree_tower_counts", "TreeStage", "fix_summation_order",
           "REORDERING_PASSES"]

#: Grappler's passes that regroup a graph's sums: the arithmetic optimizer
#: folds chains of adds into one AddN (whose CPU kernel may add in any
#: order), constant folding and remapping regroup and fuse ops.
REORDERING_PASSES = ("arithmetic_optimization", "constant_folding", "remapping")


def fix_summation_order():
    """Turns the REORDERING_PASSES off for this process (TF's setting is process-wide).

    Functions traced before keep their optimised graphs; ``TreeStage.bind``
    calls this as a deterministic sum is built, before its graph is optimised.
    """
    tf.config.optimizer.set_experimental_options({name: False for name in REORDERING_PASSES})


def tree_sum(values, name="tree"):
    """Sums tensors in the fixed tree: adjacent pairs per level, an odd last one carried up.

    Args:
      values: non-empty list of tf.Tensor of one shape and dtype; the
        leaves, in order.
      name: str, prefix of the ``tf.add`` ops' names.

    Returns:
      tf.Tensor, the sum; ``values[0]`` itself for one value.
    """
    level = list(values)
    depth = 0
    while len(level) > 1:
        pairs = [tf.add(level[i], level[i + 1], name=f"{name}_l{depth}_{i // 2}")
                 for i in range(0, len(level) - 1, 2)]
        level = pairs + level[len(pairs) * 2:]
        depth += 1
    return level[0]


def tree_tower_counts(leaves):
    """The tower counts K for which each tower's leaves are one subtree of the tree.

    Args:
      leaves: int M >= 1, the tree's leaves (micro-batches).

    Returns:
      list of int K, ascending: those that divide M with M / K a power of two.
    """
    counts, k = [leaves], leaves
    while k % 2 == 0:
        k //= 2
        counts.append(k)
    return sorted(counts)


class TreeStage(Stage):
    """An algorithm's sums with every element summed in the fixed tree over the towers.

    Wraps a stage that builds ``all_to_all`` and ``all_gather`` (flat,
    hierarchical, ring, collective; not NCCL, whose all-reduce is one op):
    the wrapped stage moves the data, and each sum is ``tree_sum`` over the
    K towers, in tower order, on the device that owns it.

    - reduce-scatter: an all-to-all brings shard k of every tower's rows
      (``contract.shard_sizes``) to device k, which sums the K pieces;
    - all-reduce: the reduce-scatter of each flattened entry, then the
      stage's all-gather (``Reduction(..., deterministic=True)``);
    - reduce: every tower's tensor copied to the root and summed there;
    - all-gather, broadcast and all-to-all copy and never add: the stage's own.

    Args:
      inner: stage.Stage, the algorithm that moves the data.
    """

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.collective = inner.collective
        self.needs_function = inner.needs_function
        self.dtypes = inner.dtypes
        self.collectives = inner.collectives
        self.gathers_slices = inner.gathers_slices

    def bind(self, devices):
        # Every deterministic sum is bound here while its graph is built,
        # before TF optimises it: the one place the order is fixed.
        fix_summation_order()
        return TreeStage(self.inner.bind(devices))

    def pieces_per_tower(self, group_size):
        return self.inner.pieces_per_tower(group_size)

    def reduce(self, buffers, ctx):
        flat = [[tf.reshape(t, [-1]) for t in row] for row in buffers]
        gathered = self.inner.all_gather(self.reduce_scatter(flat, ctx), ctx)
        out = []
        for k, (row, device) in enumerate(zip(gathered, ctx.devices)):
            with tf.device(device):
                out.append([tf.reshape(t, tf.shape(buffers[k][m]), name=f"entry{m}_dev{k}_out")
                            for m, t in enumerate(row)])
        return out

    def reduce_scatter(self, buffers, ctx):
        num_towers = len(ctx.devices)
        pieces = []
        for k, (row, device) in enumerate(zip(buffers, ctx.devices)):
            with tf.device(device):
                pieces.append([split_rows(t, num_towers, name=f"entry{m}_dev{k}_pieces")
                               for m, t in enumerate(row)])
        exchanged = self.inner.all_to_all(pieces, ctx)
        out = []
        for k, (row, device) in enumerate(zip(exchanged, ctx.devices)):
            with tf.device(device):
                # Device k's K pieces, one per tower in tower order, of equal rows.
                out.append([self._finish(tf.split(joined, num_towers, axis=0), m, ctx, device,
                                         f"entry{m}_dev{k}")
                            for m, joined in enumerate(row)])
        return out

    def reduce_to_root(self, buffers, ctx):
        device = ctx.devices[ctx.root]
        with tf.device(device):
            return [self._finish([tf.identity(row[m]) for row in buffers], m, ctx, device,
                                 f"entry{m}_root")
                    for m in range(len(buffers[0]))]

    def all_gather(self, buffers, ctx):
        return self.inner.all_gather(buffers, ctx)

    def broadcast(self, row, ctx):
        return self.inner.broadcast(row, ctx)

    def all_to_all(self, pieces, ctx):
        return self.inner.all_to_all(pieces, ctx)

    @staticmethod
    def _finish(parts, m, ctx, device, name):
        # The tree sum of one entry's K parts (in tower order), scaled and cast back.
        acc = accumulation_dtype(parts[0].dtype)
        total = tree_sum([tf.cast(p, acc) for p in parts], name=f"{name}_tree")
        return ctx.finish(total, m, len(ctx.devices), device, name=f"{name}_sum")
