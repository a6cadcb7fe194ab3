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

from tfreduce.basis.contract import shard_sizes
from tfreduce.blocks.primitives import accumulation_dtype
from tfreduce.blocks.stage import Stage

__all__ = ["tree_sum", "tree_tower_counts", "TreeStage", "fix_summation_order",
           "REORDERING_PASSES"]

#: Grappler's passes that regroup a graph's sums: the arithmetic optimizer
#: folds chains of adds into one AddN (whose CPU kernel may add in any
#: order), constant folding and remapping regroup and fuse ops.
REORDERING_PASSES = ("arithmetic_optimization", "constant_folding", "remapping")


def fix_summation_order():
    """Turns the REORDERING_PASSES off for this process (TF's setting is process-wide).

    Functions traced before keep their optimised graphs; a deterministic
    reduction calls this as it builds, before its graph is optimised.
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
    """An algorithm's all-reduce with every element summed in the fixed tree over the towers.

    Wraps a stage that builds ``all_to_all`` and ``all_gather`` (flat,
    hierarchical, ring, collective; not NCCL, whose all-reduce is one op):
    the wrapped stage moves the data, and each shard's sum is
    ``tree_sum`` over the K towers on the device that owns the shard
    (``contract.shard_sizes`` of the flattened buffer). The all-reduce is
    ``Reduction(..., deterministic=True)``'s.

    Args:
      inner: stage.Stage, the algorithm that moves the data.
    """

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.collective = inner.collective
        self.needs_function = inner.needs_function
        self.dtypes = inner.dtypes

    def bind(self, devices):
        return TreeStage(self.inner.bind(devices))

    def reduce(self, buffers, ctx):
        num_towers = len(ctx.devices)
        # Shard k of each flattened entry, by the one shard rule.
        sizes = [shard_sizes(t.shape.num_elements() if t.shape.is_fully_defined() else tf.size(t),
                             num_towers) for t in buffers[0]]
        pieces = []
        for k, (row, device) in enumerate(zip(buffers, ctx.devices)):
            with tf.device(device):
                pieces.append([tf.split(tf.reshape(t, [-1]), sizes[m], num=num_towers,
                                        name=f"entry{m}_dev{k}_pieces")
                               for m, t in enumerate(row)])
        exchanged = self.inner.all_to_all(pieces, ctx)
        shards = []
        for k, (row, device) in enumerate(zip(exchanged, ctx.devices)):
            with tf.device(device):
                sums = []
                for m, joined in enumerate(row):
                    parts = tf.split(joined, num_towers, name=f"entry{m}_dev{k}_parts")
                    acc = accumulation_dtype(parts[0].dtype)
                    total = tree_sum([tf.cast(p, acc) for p in parts],
                                     name=f"entry{m}_dev{k}_tree")
                    sums.append(ctx.finish(total, m, num_towers, device,
                                           name=f"entry{m}_dev{k}_shard"))
                shards.append(sums)
        gathered = self.inner.all_gather(shards, ctx)
        out = []
        for k, (row, device) in enumerate(zip(gathered, ctx.devices)):
            with tf.device(device):
                out.append([tf.reshape(t, tf.shape(buffers[k][m]), name=f"entry{m}_dev{k}_out")
                            for m, t in enumerate(row)])
        return out
