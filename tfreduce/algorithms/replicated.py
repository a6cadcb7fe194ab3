"""Flat all-reduce and the sync of replicated variables.

Flat all-reduce: for each gradient, sum the K tower copies on one root device
(``add_n``) and copy the sum back to every device (``identity``). It is the
``reduce_to_one_device`` + broadcast scheme of tf_cnn_benchmarks'
"replicated" variable mode and of tf.distribute's ReductionToOneDevice, with
the roots spread over the devices by bytes. On one host with shared memory
(logical CPU devices) it moves the fewest bytes of any scheme: each root
reads K copies and writes one.

Replicated variables: every tower holds its own copy of each variable;
``broadcast_variables`` copies tower 0's values to the others (at start, after
a restore, or periodically) and ``max_replica_difference`` measures how far
the copies have drifted apart.
"""

import tensorflow as tf

from tfreduce.basis.contract import check_variables, nbytes, tf_variables
from tfreduce.blocks.primitives import (RootBalancer, broadcast, concat_rows, reduce_to,
                                        split_rows, sum_order)
from tfreduce.blocks.stage import Stage

__all__ = ["FlatStage", "broadcast_variables", "max_replica_difference"]


class FlatStage(Stage):
    """Per entry: ``add_n`` on a root (least-loaded by bytes), ``identity`` to every device."""

    name = "flat"

    def reduce(self, buffers, ctx):
        devices = ctx.devices
        num_towers = len(devices)
        balancer = RootBalancer(num_towers)
        sizes = [nbytes(t) for t in buffers[0]]
        out = [[None] * len(sizes) for _ in range(num_towers)]  # K x M
        for m in sum_order(sizes):
            root = balancer.pick(range(num_towers), sizes[m])
            total = reduce_to([row[m] for row in buffers], devices[root], name=f"entry{m}_sum")
            total = ctx.finish(total, m, num_towers, devices[root], name=f"entry{m}_total")
            for k, t in enumerate(broadcast(total, devices, name_fmt=f"entry{m}_dev{{}}_out")):
                out[k][m] = t
        return out

    # The other collectives: every one through a root, spread by bytes.
    collectives = ("reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")

    def _roots(self, buffers):
        # (entry, its root) pairs, largest entries first, roots least loaded.
        balancer = RootBalancer(len(buffers))
        sizes = [sum(nbytes(row[m]) for row in buffers) for m in range(len(buffers[0]))]
        return [(m, balancer.pick(range(len(buffers)), sizes[m])) for m in sum_order(sizes)]

    def reduce_scatter(self, buffers, ctx):
        devices, num_towers = ctx.devices, len(ctx.devices)
        out = [[None] * len(buffers[0]) for _ in devices]  # K x M
        for m, root in self._roots(buffers):
            total = reduce_to([row[m] for row in buffers], devices[root], name=f"entry{m}_sum")
            total = ctx.finish(total, m, num_towers, devices[root], name=f"entry{m}_total")
            with tf.device(devices[root]):
                shards = split_rows(total, num_towers, name=f"entry{m}_split")
            for k, (shard, device) in enumerate(zip(shards, devices)):
                with tf.device(device):
                    out[k][m] = tf.identity(shard, name=f"entry{m}_dev{k}_out")
        return out

    def all_gather(self, buffers, ctx):
        out = [[None] * len(buffers[0]) for _ in ctx.devices]  # K x M
        for m, root in self._roots(buffers):
            with tf.device(ctx.devices[root]):
                whole = concat_rows([row[m] for row in buffers], name=f"entry{m}_concat")
            for k, t in enumerate(broadcast(whole, ctx.devices,
                                            name_fmt=f"entry{m}_dev{{}}_out")):
                out[k][m] = t
        return out

    def broadcast(self, row, ctx):
        copies = [broadcast(t, ctx.devices, name_fmt=f"entry{m}_dev{{}}_out")
                  for m, t in enumerate(row)]  # M x K
        return [list(tower) for tower in zip(*copies)]

    def reduce_to_root(self, buffers, ctx):
        device, num_towers = ctx.devices[ctx.root], len(ctx.devices)
        return [ctx.finish(reduce_to([row[m] for row in buffers], device, name=f"entry{m}_sum"),
                           m, num_towers, device, name=f"entry{m}_out")
                for m in range(len(buffers[0]))]


@tf.autograph.experimental.do_not_convert
def broadcast_variables(all_vars, root=0):
    """Copies the root tower's variable values to every other tower.

    Each assignment is placed on the device of the variable it writes, so the
    copy is one root -> tower transfer per variable.

    Args:
      all_vars: list of K lists of N ``tf.Variable`` or Keras variables;
        ``all_vars[k][n]`` is tower k's copy of variable n (same shapes and
        dtypes on every tower).
      root: int, the tower whose values are copied.

    Returns:
      list of the K-1 times N assign ops in graph mode; in eager mode the
      assignments are done and the list holds their results.

    Raises:
      TypeError: if all_vars is not K lists of variables.
      ValueError: if towers hold different numbers, shapes or dtypes of
        variables, or root is not a tower index.
    """
    check_variables(all_vars)
    all_vars = tf_variables(all_vars)
    if not 0 <= root < len(all_vars):
        raise ValueError(f"root tower {root} is outside 0..{len(all_vars) - 1}")
    ops = []
    with tf.name_scope("broadcast_variables"):
        for k, tower in enumerate(all_vars):
            if k == root:
                continue
            for v, src in zip(tower, all_vars[root]):
                with tf.device(v.device):
                    ops.append(v.assign(src.read_value(), read_value=False))
    return ops


@tf.autograph.experimental.do_not_convert
def max_replica_difference(all_vars):
    """The largest absolute difference between any tower's copy and tower 0's.

    Args:
      all_vars: list of K lists of N ``tf.Variable`` (see broadcast_variables).

    Returns:
      scalar tf.float64 tensor; 0.0 when every replica equals tower 0 (and
      for K=1).

    Raises:
      TypeError, ValueError: as broadcast_variables.
    """
    check_variables(all_vars)
    all_vars = tf_variables(all_vars)
    diffs = [tf.constant(0.0, tf.float64)]
    for k, tower in enumerate(all_vars[1:], start=1):
        # Compare on tower k's device: only tower 0's copy crosses over.
        with tf.device(tower[0].device if tower else None):
            for v, ref in zip(tower, all_vars[0]):
                if v.dtype.is_floating or v.dtype.is_integer:
                    d = tf.abs(tf.cast(v, tf.float64) - tf.cast(ref, tf.float64))
                    diffs.append(tf.reduce_max(d) if v.shape.num_elements() != 0
                                 else tf.constant(0.0, tf.float64))
    return tf.reduce_max(tf.stack(diffs))

