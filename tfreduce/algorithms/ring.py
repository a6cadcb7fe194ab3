"""Ring all-reduce: reduce-scatter then all-gather over K chunks.

Each gradient (after packing) is flattened and split into K chunks of nearly
equal size. In the reduce-scatter, chunk c is summed hop by hop along the
ring of devices and completes on one device, its owner; in the all-gather,
each owner's completed chunk travels once more around the ring. Every device
then concatenates the K chunks and reshapes them to the gradient's shape.

Each device sends 2(K-1)/K * S bytes and receives as many, only to and from
its ring neighbours, whatever K is: the bandwidth optimum for an all-reduce
(Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 2009; the scheme of Baidu's ring all-reduce, Horovod and
NCCL's ring). The price is latency: the longest chain of dependent transfers
is 2(K-1) hops, against 2 for the flat reduction, and K*(K-1) adds and as
many copies per gradient, so pack small gradients (``pack_bytes``) before
using it.

On one host with shared memory (logical CPU devices) a "transfer" is free
and the ring does more memory passes than a flat sum; it pays off where
links between devices are the bottleneck.
"""

import tensorflow as tf

from tfreduce.basis.contract import shard_sizes
from tfreduce.blocks.primitives import (concat_rows, ring_all_gather, ring_reduce_scatter,
                                        split_rows)
from tfreduce.blocks.stage import Stage

__all__ = ["RingStage"]


class RingStage(Stage):
    """Per entry: K chunks, ring reduce-scatter, one finish per chunk, ring all-gather."""

    name = "ring"

    def reduce(self, buffers, ctx):
        columns = [_ring_entry([row[m] for row in buffers], ctx, m)  # M x K
                   for m in range(len(buffers[0]))]
        return [list(row) for row in zip(*columns)]  # K x M

    # The other collectives: reduce-scatter and all-gather are the ring's
    # halves; broadcast and reduce pass the whole tensor hop by hop along
    # the ring (NCCL pipelines it in chunks).
    collectives = ("reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")

    def reduce_scatter(self, buffers, ctx):
        columns = [_scatter_entry([row[m] for row in buffers], ctx, m)  # M x K
                   for m in range(len(buffers[0]))]
        return [list(row) for row in zip(*columns)]  # K x M

    def all_gather(self, buffers, ctx):
        devices = ctx.devices
        out = [[None] * len(buffers[0]) for _ in devices]  # K x M
        for m in range(len(buffers[0])):
            column = [row[m] for row in buffers]
            # Towers with no rows (known when built) send nothing.
            blocks = [None if t.shape[0] == 0 else t for t in column]
            gathered = ring_all_gather(blocks, devices, f"entry{m}")
            for k, device in enumerate(devices):
                parts = [t for t in gathered[k] if t is not None] or [column[k]]
                with tf.device(device):
                    out[k][m] = concat_rows(parts, name=f"entry{m}_dev{k}_out")
        return out

    def broadcast(self, row, ctx):
        devices, num_devices = ctx.devices, len(ctx.devices)
        out = [[None] * len(row) for _ in devices]  # K x M
        for m, t in enumerate(row):
            totals = [t if c == ctx.root else None for c in range(num_devices)]
            for k, copies in enumerate(ring_all_gather(totals, devices, f"entry{m}")):
                out[k][m] = copies[ctx.root]
            # The root's own result too is an op on its device.
            with tf.device(devices[ctx.root]):
                out[ctx.root][m] = tf.identity(t, name=f"entry{m}_dev{ctx.root}_out")
        return out

    def reduce_to_root(self, buffers, ctx):
        devices, root, num_devices = ctx.devices, ctx.root, len(ctx.devices)
        out = []
        for m in range(len(buffers[0])):
            pieces = [[row[m] if c == root else None for c in range(num_devices)]
                      for row in buffers]
            total = ring_reduce_scatter(pieces, devices, f"entry{m}")[root]
            out.append(ctx.finish(total, m, num_devices, devices[root], name=f"entry{m}_out"))
        return out


def _scatter_entry(column, ctx, m):
    # The ring's first half on axis-0 shards: shard c completes on device c.
    devices, num_devices = ctx.devices, len(ctx.devices)
    name = f"entry{m}"
    shards = []
    for k, (t, d) in enumerate(zip(column, devices)):
        with tf.device(d):
            shards.append(split_rows(t, num_devices, name=f"{name}_dev{k}_split"))
    rows = column[0].shape[0]
    sizes = shard_sizes(rows, num_devices) if rows is not None else [None] * num_devices
    # Shards with no rows (known when built) travel nowhere.
    pieces = [[None if sizes[c] == 0 else own[c] for c in range(num_devices)] for own in shards]
    # Compressed (ctx.wire_sum): partial sums cross in 16 bits, as the
    # all-reduce's do.
    dtype = column[0].dtype
    wire = dtype if ctx.wire_sum and dtype.is_floating and dtype.size == 2 else None
    totals = ring_reduce_scatter(pieces, devices, name, wire)
    out = []
    for c, d in enumerate(devices):
        if totals[c] is None:
            with tf.device(d):
                out.append(tf.identity(shards[c][c], name=f"{name}_dev{c}_out"))
            continue
        out.append(ctx.finish(totals[c], m, num_devices, d, name=f"{name}_dev{c}_out"))
    return out


def _ring_entry(column, ctx, m):
    # column: the K towers' copies of entry m; returns the K results.
    devices = ctx.devices
    num_devices = len(devices)
    name = f"entry{m}"
    static = all(t.shape.is_fully_defined() for t in column)
    if static:
        sizes = shard_sizes(column[0].shape.num_elements(), num_devices)
        if not any(sizes):
            # An empty gradient: its sum is itself, on every device.
            out = []
            for k, d in enumerate(devices):
                with tf.device(d):
                    out.append(tf.identity(column[k], name=f"{name}_dev{k}_out"))
            return out
        chunks = [j for j, s in enumerate(sizes) if s]
    else:
        chunks = list(range(num_devices))
    owners = [(j + m) % num_devices for j in chunks]

    # Compressed (ctx.wire_sum): partial sums cross in 16 bits (of means
    # when averaging: the frame prescaled the inputs).
    dtype = column[0].dtype
    wire = dtype if ctx.wire_sum and dtype.is_floating and dtype.size == 2 else None
    pieces = [[None] * num_devices for _ in range(num_devices)]
    for k, (g, d) in enumerate(zip(column, devices)):
        with tf.device(d):
            # Packed buffers and biases are 1-D already: no reshape op.
            flat = g if g.shape.rank == 1 else tf.reshape(g, [-1], name=f"{name}_dev{k}_flat")
            if static and len(chunks) == 1:
                parts = [flat]
            elif static:
                parts = tf.split(flat, [sizes[j] for j in chunks], name=f"{name}_dev{k}_split")
            else:
                parts = tf.split(flat, shard_sizes(tf.size(flat), num_devices),
                                 num=num_devices,
                                 name=f"{name}_dev{k}_split")
        for owner, part in zip(owners, parts):
            pieces[k][owner] = part

    totals = ring_reduce_scatter(pieces, devices, name, wire)
    for c in owners:
        totals[c] = ctx.finish(totals[c], m, num_devices, devices[c],
                               name=f"{name}_chunk{c}_total")
    gathered = ring_all_gather(totals, devices, name)
    return _reassemble(column, gathered, owners, devices, static, name)


def _reassemble(column, gathered, owners, devices, static, name):
    # Each device's gathered chunks, in order, back into the entry's shape.
    out = []
    for k, d in enumerate(devices):
        with tf.device(d):
            parts = [gathered[k][c] for c in owners]
            if column[0].shape.rank == 1:
                out.append(parts[0] if len(parts) == 1 else tf.concat(
                    parts, axis=0, name=f"{name}_dev{k}_out"))
                continue
            flat = parts[0] if len(parts) == 1 else tf.concat(
                parts, axis=0, name=f"{name}_dev{k}_concat")
            shape = column[0].shape if static else tf.shape(column[k])
            out.append(tf.reshape(flat, shape, name=f"{name}_dev{k}_out"))
    return out
