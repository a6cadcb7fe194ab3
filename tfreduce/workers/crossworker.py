"""The cross-worker stage: one collective per (packed) gradient between the workers.

The second stage of a multi-worker all-reduce (``[<local stage>,
CrossWorkerStage]``, see ``tfreduce.doors.multiworker``): one device per worker
all-reduces the worker's local sum with the same device of every other
worker (``CollectiveReduceV2`` over TF's gRPC cluster), scales once and
casts back, then copies the result to the worker's other devices.
"""

import functools

import tensorflow as tf

from tfreduce.algorithms.tree import tree_sum
from tfreduce.basis.choices import COLLECTIVES
from tfreduce.basis.contract import nbytes
from tfreduce.basis.devices import local_name
from tfreduce.blocks.collective import (CollectiveChain, CollectiveOptions, check_broadcast_shape,
                                        check_keys)
from tfreduce.blocks.primitives import (RootBalancer, accumulation_dtype, broadcast, concat_rows,
                                        finish_sum, mean_of_sum, scale_by_reciprocal, split_rows,
                                        sum_order, widen_half)
from tfreduce.blocks.stage import ReduceContext, Stage
from tfreduce.buffers.compression import Compression

__all__ = ["CrossWorkerStage", "CrossWorkerCollectives", "cross_worker_options",
           "CROSS_WORKER_PACK_BYTES"]

#: Default buffer size for packing before the cross-worker all-reduce. Each
#: collective between hosts pays a network round trip or more, so small
#: gradients are fused into buffers of this size (see packing.PackPlan).
CROSS_WORKER_PACK_BYTES = 4 * 1024 * 1024


def _round(method):
    """A stage method that is one cross-worker round, counted by the cluster (``workers.rounds``)."""
    @functools.wraps(method)
    def counted(self, data, ctx):
        out = method(self, data, ctx)
        rounds = getattr(self.cluster, "rounds", None)
        if rounds is not None:
            rounds.mark(_tensors(data), _tensors(out))
        return out
    return counted


def _tensors(nested):
    # The dense tensors of a nested list (the values of IndexedSlices).
    flat = tf.nest.flatten(nested, expand_composites=True)
    return [t for t in flat if isinstance(t, tf.Tensor) and t.dtype != tf.resource]


def cross_worker_options(cluster, communication, timeout, keys):
    """(CollectiveOptions, CollectiveKeys) of cross-worker collectives; None: the cluster's.

    A timeout given here is set on each op (a thread per op execution, see
    ``Cluster.op_timeout``); None leaves the bound to the watchdog."""
    options = CollectiveOptions(communication, timeout,
                                none_means=f"the cluster's {cluster.timeout:g}s")
    check_keys(keys, none_means="the cluster's")
    return options.with_timeout(cluster.op_timeout), cluster.keys if keys is None else keys


class CrossWorkerStage(Stage):
    """Per entry: one device per worker all-reduces across workers, then copies to the others.

    The entry's root r is picked by bytes, largest entries first, so the K
    devices of a worker each carry about 1/K of the cross-worker traffic.
    On r: ``entry{m}_cross_worker``, a ``CollectiveReduceV2`` over device r
    of every worker (chained per device), then the one scaling by 1/T
    (T = W * K towers) and cast back, ``entry{m}_total``; then
    ``entry{m}_dev{k}_out``, the copy to each of the worker's devices.

    With ``compression``, the local sum of a float32/float64 entry is scaled
    by 1/T first when averaging (so a mean cannot overflow), cast to the
    16-bit wire dtype, all-reduced across workers in it, and cast back:
    half the bytes cross the network.

    With ``deterministic``, the local sums are all-gathered instead (copies,
    no sums) and summed in the fixed tree over the workers in rank order
    (``algorithms.tree``): each worker's towers are one subtree.

    Args:
      cluster: tfreduce.Cluster of this worker.
      options: collective.CollectiveOptions, with a timeout.
      keys: CollectiveKeys that hand out the same keys on every worker.
      compression: compression.Compressor of the cross-worker hop.
      deterministic: bool, sum in the fixed tree over the workers.
    """

    name = "cross_worker"
    collective = True
    needs_function = True

    def __init__(self, cluster, options, keys, compression=Compression.none,
                 deterministic=False):
        self.cluster = cluster
        self.options = options
        self.keys = keys
        self.compression = compression
        self.deterministic = deterministic
        self._chain = self._towers = None  # set by bind, per call

    def bind(self, devices):
        # A fresh chain for each call, shared by its dense and sparse entries.
        bound = CrossWorkerStage(self.cluster, self.options, self.keys, self.compression,
                                 self.deterministic)
        bound._chain = CollectiveChain(self.options)
        bound._towers = self.cluster.num_workers * len(devices)  # T
        return bound

    def _ordered(self, device):
        group_key = self.cluster.group_key([local_name(device)])
        self._chain.token(device, f"tfreduce_cross_order_{group_key}", "cross_worker_order")
        return group_key

    def gather(self, slices, device, average, m):
        """All-gathers a worker's gathered rows from every worker (row counts differ)."""
        chain, num_workers = self._chain, self.cluster.num_workers
        group_key = self._ordered(device)
        values = slices.values
        with chain.after_previous(device):
            indices = chain.all_gather_rows(slices.indices, device, num_workers, group_key,
                                            self.keys, name=f"entry{m}_cross_indices")
            if values.shape[1:].num_elements() == 0:
                # Rows of no elements: nothing to send (TF's kernels crash on it).
                values = tf.zeros(tf.concat([tf.shape(indices), tf.shape(values)[1:]], 0),
                                  values.dtype)
            else:
                values = chain.all_gather_rows(values, device, num_workers, group_key,
                                               self.keys, name=f"entry{m}_cross_values")
            if average:
                # The frame gathered without scaling: 1/T once, here.
                values = mean_of_sum(values, self._towers)
        return tf.IndexedSlices(values, indices, slices.dense_shape)

    @_round
    def reduce(self, buffers, ctx):
        devices, num_workers = ctx.devices, self.cluster.num_workers
        num_local = len(devices)
        group_keys = [self.cluster.group_key([local_name(d)]) for d in devices]
        chain = self._chain
        balancer = RootBalancer(num_local)
        sizes = [nbytes(t) for t in buffers[0]]
        out = [[None] * len(sizes) for _ in range(num_local)]  # K x M
        for m in sum_order(sizes):
            r = balancer.pick(range(num_local), sizes[m])
            self._ordered(devices[r])
            # Only device r's copy is read, but the K ops of a collective
            # local stage wait for each other: all K must run, or a
            # tf.compat.v1 session hangs.
            others = ([buffers[k][m] for k in range(num_local) if k != r]
                      if ctx.upstream_collective else [])
            local_sum = buffers[r][m]
            # Compressed, only the network hop crosses in the wire dtype: the
            # local sum, scaled by 1/T first when averaging (a mean cannot
            # overflow), is compressed on r and the sum restored there.
            compressed = self.compression.wire_dtype(ctx.dtypes[m]) != ctx.dtypes[m]
            if compressed:
                with tf.device(devices[r]), tf.name_scope(f"entry{m}_to_wire"):
                    if ctx.average:
                        local_sum = scale_by_reciprocal(local_sum, self._towers)
                    local_sum, restore = self.compression.compress(local_sum)
            with chain.after_previous(devices[r], extra=others):
                if self.deterministic:
                    summed = self._tree_across(local_sum, devices[r], group_keys[r], m)
                else:
                    summed = chain.all_reduce(local_sum, devices[r], num_workers, group_keys[r],
                                              self.keys.instance_key(),
                                              name=f"entry{m}_cross_worker")
            if compressed:
                with tf.device(devices[r]):
                    summed = self.compression.decompress(summed, restore)
            # Prescaled entries are means already.
            total = finish_sum(summed, ctx.dtypes[m], self._towers,
                               ctx.average and not compressed, devices[r],
                               name=f"entry{m}_total")
            for k, t in enumerate(broadcast(total, devices, name_fmt=f"entry{m}_dev{{}}_out")):
                out[k][m] = t
        return out

    def _tree_across(self, local_sum, device, group_key, m):
        # Every worker's sum gathered in rank order, then summed in the tree.
        num_workers = self.cluster.num_workers
        rows = self._chain.all_gather(tf.reshape(local_sum, [1, -1]), device, num_workers,
                                      group_key, self.keys.instance_key(),
                                      name=f"entry{m}_cross_worker")
        with tf.device(device):
            parts = tf.unstack(tf.cast(rows, accumulation_dtype(rows.dtype)), num=num_workers)
            total = tree_sum(parts, name=f"entry{m}_workers_tree")
            return tf.reshape(total, tf.shape(local_sum))


class CrossWorkerCollectives(Stage):
    """The other collectives across workers: a local step, one device per worker across, a local step.

    Every worker calls with its K towers; tower k of the worker of rank w is
    global tower ``w * K + k`` of T = W * K, and the results equal those of
    one process holding all T towers. Per collective:

    - reduce_scatter: the local stage sums on device 0
      (``reduce_to_root``), ``CollectiveReduceV2`` across workers, the one
      scaling by 1/T, then device k keeps global shard ``w * K + k``;
    - all_gather: the worker's rows joined on device 0, gathered across
      workers (``CollectiveGatherV2``, padded to the longest, in rank
      order), then copied to the worker's devices;
    - broadcast: the root's worker sends from its tower ``root % K``
      (``CollectiveBcastSendV2``), the same tower of every other worker
      receives, then the local stage's broadcast from there;
    - reduce: the local stage sums on tower ``root % K``, then
      ``CollectiveReduceV2`` across workers: every worker holds the sum
      there (TF has no reduce-to-one across hosts);
    - all_to_all: the worker's rows and the row counts of its pieces are
      gathered across workers on device 0, which cuts out each local
      tower's pieces: W times the bytes of point to point (TF's
      ``CollectiveAllToAllV2`` has no CPU kernel).

    Args:
      cluster: tfreduce.Cluster of this worker (started).
      stage: stage.Stage, the local algorithm, bound to the K devices; None
        for all_gather and all_to_all, which join the worker's rows on its
        first device and copy them, whatever the algorithm.
      options: collective.CollectiveOptions, with a timeout.
      keys: CollectiveKeys that hand out the same keys on every worker.
      root: int, the global root tower of a broadcast.
    """

    name = "cross_worker"
    needs_function = True
    collectives = COLLECTIVES
    # The rows of other workers' towers are not known here: dense.
    gathers_slices = False

    def __init__(self, cluster, stage, options, keys, root=0):
        self.cluster = cluster
        self.root = root
        self.stage = stage
        self.dtypes = None if stage is None else stage.dtypes
        self.keys = keys
        self.chain = CollectiveChain(options)

    def pieces_per_tower(self, group_size):
        """One piece per tower of every worker."""
        return group_size * self.cluster.num_workers

    def _across(self, device):
        # The group key of this device across workers, its token made.
        group_key = self.cluster.group_key([local_name(device)])
        self.chain.token(device, f"tfreduce_cross_order_{group_key}", "cross_worker_order")
        return group_key

    def _local_sums(self, buffers, ctx, root):
        # The worker's sums on devices[root], in the accumulation dtype.
        acc = ReduceContext(ctx.devices, False, [accumulation_dtype(d) for d in ctx.dtypes],
                            root=root)
        return self.stage.reduce_to_root(buffers, acc)

    def _sum_across(self, local, device, m):
        group_key = self._across(device)
        with self.chain.after_previous(device):
            return self.chain.all_reduce(local, device, self.cluster.num_workers, group_key,
                                         self.keys.instance_key(), name=f"entry{m}_cross_worker")

    @_round
    def reduce_scatter(self, buffers, ctx):
        devices, rank = ctx.devices, self.cluster.rank
        num_local = len(devices)
        total_towers = num_local * self.cluster.num_workers
        out = [[None] * len(buffers[0]) for _ in devices]  # K x M
        for m, local in enumerate(self._local_sums(buffers, ctx, 0)):
            total = finish_sum(self._sum_across(local, devices[0], m), ctx.dtypes[m],
                               total_towers, ctx.average, devices[0], name=f"entry{m}_total")
            with tf.device(devices[0]):
                shards = split_rows(total, total_towers, name=f"entry{m}_split")
            for k, device in enumerate(devices):
                with tf.device(device):
                    out[k][m] = tf.identity(shards[rank * num_local + k],
                                            name=f"entry{m}_dev{k}_out")
        return out

    @_round
    def reduce_to_root(self, buffers, ctx):
        device = ctx.devices[ctx.root]
        total_towers = len(ctx.devices) * self.cluster.num_workers
        return [finish_sum(self._sum_across(local, device, m), ctx.dtypes[m], total_towers,
                           ctx.average, device, name=f"entry{m}_out")
                for m, local in enumerate(self._local_sums(buffers, ctx, ctx.root))]

    @_round
    def all_gather(self, buffers, ctx):
        device, num_workers = ctx.devices[0], self.cluster.num_workers
        group_key = self._across(device)
        row = []
        for m in range(len(buffers[0])):
            with tf.device(device):
                mine = concat_rows([tower[m] for tower in buffers], name=f"entry{m}_local")
            with self.chain.after_previous(device):
                if mine.shape[1:].num_elements() == 0:
                    # Rows of no elements: only the row counts cross.
                    rows = self.chain.all_gather(tf.shape(mine)[:1], device, num_workers,
                                                 group_key, self.keys.instance_key(),
                                                 name=f"entry{m}_cross_rows")
                    whole = tf.zeros(tf.concat([[tf.reduce_sum(rows)], tf.shape(mine)[1:]], 0),
                                     mine.dtype)
                else:
                    whole = tf.cast(self.chain.all_gather_rows(
                        widen_half(mine), device, num_workers, group_key, self.keys,
                        name=f"entry{m}_cross_worker"), mine.dtype)
            row.append(whole)
        # Copied to the worker's devices (the gathered rows are known only
        # when the graph runs, which TF's collective broadcast cannot take).
        copies = [broadcast(t, ctx.devices, name_fmt=f"entry{m}_dev{{}}_out")
                  for m, t in enumerate(row)]  # M x K
        return [list(tower) for tower in zip(*copies)]

    @_round
    def broadcast(self, row, ctx):
        device, num_workers = ctx.devices[ctx.root], self.cluster.num_workers
        sender = self.root // len(ctx.devices)
        group_key = self._across(device)
        received = []
        for m, t in enumerate(row):
            check_broadcast_shape(t, m, f"across workers every worker passes a tensor of the "
                                        f"root's static shape at tower {ctx.root}")
            if t.shape.num_elements() == 0:
                received.append(t)
                continue
            with self.chain.after_previous(device):
                got = self.chain.broadcast(
                    widen_half(t) if self.cluster.rank == sender else None, device, num_workers,
                    group_key, self.keys.instance_key(), name=f"entry{m}_cross_worker",
                    shape=t.shape, dtype=widen_half(t).dtype)
            received.append(tf.cast(got, t.dtype))
        return self.stage.broadcast(received, ctx)

    @_round
    def all_to_all(self, pieces, ctx):
        devices, num_workers = ctx.devices, self.cluster.num_workers
        device, num_local = devices[0], len(devices)
        total_towers = num_local * num_workers
        group_key = self._across(device)
        out = [[None] * len(pieces[0]) for _ in devices]  # K x M
        for m in range(len(pieces[0])):
            with tf.device(device):
                rows = [concat_rows(row[m], name=f"entry{m}_dev{j}_rows")
                        for j, row in enumerate(pieces)]
                mine = concat_rows(rows, name=f"entry{m}_local")
                counts = tf.reshape(tf.stack([tf.shape(p)[0] for row in pieces for p in row[m]]),
                                    [-1])  # K*T: tower j's piece for each tower
            with self.chain.after_previous(device):
                counts = tf.reshape(self.chain.all_gather(
                    counts, device, num_workers, group_key, self.keys.instance_key(),
                    name=f"entry{m}_cross_counts"), [total_towers, total_towers])
                if mine.shape[1:].num_elements() == 0:
                    whole = tf.zeros(tf.concat([[tf.reduce_sum(counts)], tf.shape(mine)[1:]], 0),
                                     mine.dtype)
                else:
                    whole = tf.cast(self.chain.all_gather_rows(
                        widen_half(mine), device, num_workers, group_key, self.keys,
                        name=f"entry{m}_cross_worker"), mine.dtype)
            for k in range(num_local):
                with tf.device(device):
                    target = self.cluster.rank * num_local + k
                    out[k][m] = _pieces_for(whole, counts, target, f"entry{m}_dev{k}")
                with tf.device(devices[k]):
                    out[k][m] = tf.identity(out[k][m], name=f"entry{m}_dev{k}_out")
        return out


def _pieces_for(whole, counts, target, name):
    # Tower ``target``'s piece of every tower, cut from all towers' rows in
    # tower order (counts[j][t]: the rows tower j sends to tower t).
    starts = tf.cumsum(tf.reduce_sum(counts, axis=1), exclusive=True) + tf.cumsum(
        counts, axis=1, exclusive=True)[:, target]
    parts = []
    for j in range(counts.shape[0]):
        parts.append(tf.slice(whole, tf.concat([[starts[j]], tf.zeros_like(tf.shape(whole)[1:])],
                                               0),
                              tf.concat([[counts[j, target]], tf.shape(whole)[1:]], 0)))
    return concat_rows(parts, name=f"{name}_gathered")

