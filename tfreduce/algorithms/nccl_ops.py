"""The two all-reduce engines TensorFlow ships: NCCL and collective ops.

- NCCL (``tensorflow.python.ops.nccl_ops.all_sum``): one ``NcclAllReduce``
  op per device, GPUs only. The engine of tf_cnn_benchmarks'
  ``--all_reduce_spec=nccl`` and of MirroredStrategy's NcclAllReduce.
- TF collective ops (``CollectiveReduceV2``): a group of K ops, one per
  device, that meet in TF's collective runtime; it runs a ring on CPUs and
  GPUs, or NCCL on GPUs, and spans hosts over TF's gRPC cluster. The engine of
  MultiWorkerMirroredStrategy.

Both form the sum on every device, so ``average=True`` divides on every
device; there is no single place where the sum exists.
"""

import tensorflow as tf
from tensorflow.python.ops import nccl_ops as _tf_nccl

from tfreduce.basis.devices import is_gpu
from tfreduce.blocks.collective import (CollectiveChain, CollectiveKeys, CollectiveOptions,
                                        check_broadcast_shape, check_keys)
from tfreduce.blocks.primitives import (accumulation_dtype, concat_rows, scale_by_reciprocal,
                                        split_rows, widen_half)
from tfreduce.blocks.stage import Stage

__all__ = ["NcclStage", "CollectiveStage"]


class NcclStage(Stage):
    """Per entry: one ``NcclAllReduce`` per device (``nccl_ops.all_sum``), GPUs only."""

    name = "nccl"
    collective = True
    # NcclAllReduce's kernels; it sums in the input dtype, so no bfloat16.
    dtypes = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)

    def bind(self, devices):
        others = [d for d in devices if not is_gpu(d)]
        if others:
            raise ValueError(
                f"NCCL runs only on GPUs, but devices {others} are not GPUs: use "
                f"algorithm='collective', 'flat' or 'hierarchical' there")
        return self

    def reduce(self, buffers, ctx):
        num_towers = len(ctx.devices)
        columns = []  # M x K
        for m in range(len(buffers[0])):
            placed = []
            for k, d in enumerate(ctx.devices):
                with tf.device(d):
                    g = buffers[k][m]
                    if ctx.average:
                        # NCCL sums in the input dtype: prescale (Horovod's
                        # prescale), so a float16 sum cannot overflow.
                        g = scale_by_reciprocal(g, num_towers)
                    placed.append(tf.identity(g, name=f"entry{m}_dev{k}_in"))
            columns.append(_tf_nccl.all_sum(placed))
        return [list(row) for row in zip(*columns)]  # K x M

    # TF's NCCL ops besides all_sum: broadcast and reduce_sum (no
    # reduce-scatter, all-gather or all-to-all).
    collectives = ("broadcast", "reduce")

    def broadcast(self, row, ctx):
        out = [[None] * len(row) for _ in ctx.devices]  # K x M
        for m, t in enumerate(row):
            if t.dtype not in self.dtypes:
                raise TypeError(f"broadcast: tensor {m}: NCCL cannot send {t.dtype.name} (it "
                                f"takes {', '.join(sorted(d.name for d in self.dtypes))})")
            with tf.device(ctx.devices[ctx.root]):
                sent = _tf_nccl.broadcast(tf.identity(t, name=f"entry{m}_in"))
            for k, d in enumerate(ctx.devices):
                with tf.device(d):
                    out[k][m] = tf.identity(sent, name=f"entry{m}_dev{k}_out")
        return out

    def reduce_to_root(self, buffers, ctx):
        device, num_towers = ctx.devices[ctx.root], len(ctx.devices)
        out = []
        for m in range(len(buffers[0])):
            column = []
            for k, d in enumerate(ctx.devices):
                with tf.device(d):
                    # Half types go up to float32 first: NCCL sums in the
                    # input dtype, and the sum is scaled and rounded once.
                    g = buffers[k][m]
                    acc = accumulation_dtype(g.dtype)
                    column.append(tf.cast(g, acc, name=f"entry{m}_dev{k}_in") if acc != g.dtype
                                  else tf.identity(g, name=f"entry{m}_dev{k}_in"))
            with tf.device(device):
                total = _tf_nccl.reduce_sum(column)
            out.append(ctx.finish(total, m, num_towers, device, name=f"entry{m}_out"))
        return out


class CollectiveStage(Stage):
    """Per entry: one ``CollectiveReduceV2`` per device, chained per device.

    Args:
      communication: "auto", "ring" or "nccl", TF's communication hint.
      keys: CollectiveKeys, or None for ``CollectiveKeys.for_call`` of the
        call's graph, scope, devices and entry shapes.
      timeout: float seconds > 0, or None to wait forever.

    Raises:
      ValueError: unknown communication, or a timeout that is not None or > 0.
      TypeError: keys that are not a CollectiveKeys.
    """

    name = "collective"
    collective = True
    needs_function = True
    # CollectiveReduceV2's kernels, after half types go up to float32.
    dtypes = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)

    def __init__(self, communication="auto", keys=None, timeout=None):
        self.options = CollectiveOptions(communication, timeout)
        self.keys = check_keys(keys)

    def _start(self, buffers, devices):
        # (keys, group key, chain) of one call, each device's token made.
        keys = self.keys
        if keys is None:
            # The graph object too: two tf.functions of one name, scope and
            # layout (unknown shapes print alike) must not share keys, since
            # TF remembers each key's shape for the life of the process. The
            # K members of this group are all in this process, so keys need
            # not agree with any other process.
            graph = tf.compat.v1.get_default_graph()
            layout = [(t.dtype.name, str(t.shape)) for row in buffers for t in row]
            keys = CollectiveKeys.for_call(
                f"{getattr(graph, 'name', '')}|{id(graph)}|{graph.get_name_scope()}|"
                f"{devices}|{layout}")
        group_key = keys.group_key(devices)
        chain = CollectiveChain(self.options)
        for k, d in enumerate(devices):
            chain.token(d, f"tfreduce_order_{group_key}_{k}", f"dev{k}_order")
        return keys, group_key, chain

    def _sums(self, buffers, ctx):
        # K x M: each device's sum of each entry, not yet scaled or cast back.
        devices = ctx.devices
        keys, group_key, chain = self._start(buffers[:1], devices)
        out = [[None] * len(buffers[0]) for _ in devices]  # K x M
        for m in range(len(buffers[0])):
            instance_key = keys.instance_key()  # one per entry, shared by its K ops
            for k, d in enumerate(devices):
                g = buffers[k][m]
                # Compressed (ctx.wire_sum): 16 bits cross (means when
                # averaging: the frame prescaled the inputs). Otherwise half
                # types go up to float32 first and the sum is scaled once.
                in_wire = ctx.wire_sum and g.dtype != accumulation_dtype(g.dtype)
                acc = g.dtype if in_wire else accumulation_dtype(g.dtype)
                with chain.after_previous(d):
                    x = tf.cast(g, acc) if acc != g.dtype else tf.identity(g)
                    out[k][m] = chain.all_reduce(x, d, len(devices), group_key, instance_key,
                                                 name=f"entry{m}_dev{k}_allreduce")
        return out

    def reduce(self, buffers, ctx):
        num_towers = len(ctx.devices)
        return [[ctx.finish(r, m, num_towers, d, name=f"entry{m}_dev{k}_out")
                 for m, r in enumerate(row)]
                for k, (row, d) in enumerate(zip(self._sums(buffers, ctx), ctx.devices))]

    # The other collectives, from TF's CollectiveReduceV2, GatherV2 and
    # BcastSendV2/RecvV2 (TF's reduce-scatter and all-to-all ops have no CPU
    # kernel).
    collectives = ("reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")

    def reduce_scatter(self, buffers, ctx):
        # Every device forms the sum and keeps its shard.
        num_towers = len(ctx.devices)
        out = []
        for k, (row, d) in enumerate(zip(self._sums(buffers, ctx), ctx.devices)):
            with tf.device(d):
                shards = [split_rows(r, num_towers, name=f"entry{m}_dev{k}_split")[k]
                          for m, r in enumerate(row)]
            out.append([ctx.finish(t, m, num_towers, d, name=f"entry{m}_dev{k}_out")
                        for m, t in enumerate(shards)])
        return out

    def reduce_to_root(self, buffers, ctx):
        # Every device forms the sum (the root's result waits for all of
        # them, so fetching it runs the whole group).
        sums = self._sums(buffers, ctx)
        root, device = ctx.root, ctx.devices[ctx.root]
        out = []
        for m in range(len(buffers[0])):
            others = [row[m] for k, row in enumerate(sums) if k != root]
            with tf.control_dependencies(others):
                out.append(ctx.finish(sums[root][m], m, len(ctx.devices), device,
                                      name=f"entry{m}_out"))
        return out

    def broadcast(self, row, ctx):
        devices, root = ctx.devices, ctx.root
        keys, group_key, chain = self._start([row], devices)
        out = [[None] * len(row) for _ in devices]  # K x M
        for m, t in enumerate(row):
            check_broadcast_shape(t, m, "TF's collective broadcast needs it: use "
                                        "algorithm='flat'")
            if t.shape.num_elements() == 0:
                # TF's collective kernels crash on empty tensors: copy.
                for k, d in enumerate(devices):
                    with tf.device(d):
                        out[k][m] = tf.identity(t, name=f"entry{m}_dev{k}_out")
                continue
            instance_key = keys.instance_key()
            for k, d in enumerate(devices):
                with chain.after_previous(d):
                    sent = widen_half(t) if k == root else None
                    got = chain.broadcast(sent, d, len(devices), group_key, instance_key,
                                          name=f"entry{m}_dev{k}_bcast", shape=t.shape,
                                          dtype=widen_half(t).dtype)
                    out[k][m] = tf.cast(got, t.dtype, name=f"entry{m}_dev{k}_out")
        return out

    def all_gather(self, buffers, ctx):
        devices = ctx.devices
        keys, group_key, chain = self._start(buffers, devices)
        # TF orders a gather by its own ranking of the devices: each member
        # gathers its tower index once, and every entry is put back in tower
        # order by it.
        ranks = []
        instance_key = keys.instance_key()
        for k, d in enumerate(devices):
            with chain.after_previous(d):
                order = chain.all_gather(tf.constant([k], tf.int32), d, len(devices), group_key,
                                         instance_key, name=f"dev{k}_tower_order")
                ranks.append(tf.argsort(order))  # ranks[k][j]: the rank of tower j
        out = [[None] * len(buffers[0]) for _ in devices]  # K x M
        for m in range(len(buffers[0])):
            column = [row[m] for row in buffers]
            gathered = _gather_entry(chain, keys, group_key, column, ranks, devices, m)
            for k in range(len(devices)):
                out[k][m] = gathered[k]
        return out

    def all_to_all(self, pieces, ctx):
        # Every tower's pieces joined into one block, the blocks all-gathered,
        # each device keeping its pieces: K-1 times the bytes of point to
        # point, the price of having only TF's gather across devices.
        devices, num_towers = ctx.devices, len(ctx.devices)
        for m in range(len(pieces[0])):
            if any(p.shape[0] is None for row in pieces for p in row[m]):
                raise ValueError(f"all_to_all: tensor {m}'s pieces have row counts not known "
                                 f"when built; algorithm 'collective' needs them: use 'flat'")
        blocks = []
        for j, (row, d) in enumerate(zip(pieces, devices)):
            with tf.device(d):
                blocks.append([concat_rows(parts, name=f"entry{m}_dev{j}_block")
                               for m, parts in enumerate(row)])
        gathered = self.all_gather(blocks, ctx)
        out = [[None] * len(pieces[0]) for _ in devices]  # K x M
        for m in range(len(pieces[0])):
            counts = [[p.shape[0] for p in row[m]] for row in pieces]  # K x K rows
            for k, d in enumerate(devices):
                starts = [sum(map(sum, counts[:j])) + sum(counts[j][:k])
                          for j in range(num_towers)]
                with tf.device(d):
                    out[k][m] = concat_rows(
                        [gathered[k][m][s:s + counts[j][k]] for j, s in enumerate(starts)],
                        name=f"entry{m}_dev{k}_out")
        return out


def _gather_entry(chain, keys, group_key, column, ranks, devices, m):
    # The K towers' rows of one entry joined in tower order on every device:
    # row counts (gathered when not known), every x padded to the longest
    # (TF's gather takes one shape), gathered, put in tower order, unpadded.
    num_towers = len(devices)
    counts = [t.shape[0] for t in column]
    trailing = column[0].shape[1:]
    static = None not in counts
    if static and (max(counts) == 0 or trailing.num_elements() == 0):
        # Nothing to send (TF's kernels crash on empty tensors).
        out = []
        for k, d in enumerate(devices):
            with tf.device(d):
                out.append(tf.zeros([sum(counts)] + trailing.as_list(), column[0].dtype,
                                    name=f"entry{m}_dev{k}_out"))
        return out
    if not static:
        instance_key = keys.instance_key()
        gathered_counts = []
        for k, (t, d) in enumerate(zip(column, devices)):
            with chain.after_previous(d):
                rows = chain.all_gather(tf.shape(t)[:1], d, num_towers, group_key, instance_key,
                                        name=f"entry{m}_dev{k}_rows")
                gathered_counts.append(tf.gather(rows, ranks[k]))
    instance_key = keys.instance_key()
    out = []
    for k, (t, d) in enumerate(zip(column, devices)):
        with chain.after_previous(d):
            tower_counts = counts if static else gathered_counts[k]
            longest = max(max(counts), 1) if static else tf.maximum(tf.reduce_max(
                tower_counts), 1)
            rows = counts[k] if static else tf.shape(t)[0]
            padded = tf.pad(widen_half(t), [[0, longest - rows]] + [[0, 0]] * (t.shape.rank - 1))
            whole = chain.all_gather(padded, d, num_towers, group_key, instance_key,
                                     name=f"entry{m}_dev{k}_gather")
            blocks = tf.gather(tf.reshape(whole, tf.concat([[num_towers, longest],
                                                            tf.shape(t)[1:]], 0)), ranks[k])
            keep = tf.reshape(tf.sequence_mask(tower_counts, longest), [-1])
            flat = tf.reshape(blocks, tf.concat([[-1], tf.shape(t)[1:]], 0))
            out.append(tf.cast(tf.boolean_mask(flat, keep), t.dtype, name=f"entry{m}_dev{k}_out"))
    return out
