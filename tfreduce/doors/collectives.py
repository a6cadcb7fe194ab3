"""The collectives besides all-reduce: reduce-scatter, all-gather, broadcast, reduce, all-to-all.

Each takes the K x N list of the all-reduce, ``all_tensors[k][n]``: tensor n
of tower k (K towers, N tensors), and the same communication choice (an
``algorithm`` name and its options, or a ``tfreduce.Reduction``). Outputs
are K x N lists whose ``out[k][n]`` is placed on ``devices[k]`` (``reduce``:
N tensors on the root). Rows are split and joined along axis 0; a split
follows tfreduce's one shard rule (``contract.shard_sizes``: the first
``B % K`` shards one row larger). K=2, N=1, a tensor of 3 rows per tower
(``a0..a2`` on tower 0, ``b0..b2`` on tower 1)::

    reduce_scatter  [[a],  [b]]  ->  [[a0+b0, a1+b1]],  [[a2+b2]]
    all_gather      [[a],  [b]]  ->  [[a; b]],          [[a; b]]
    broadcast       [[a],  None] ->  [[a]],             [[a]]          (root=0)
    reduce          [[a],  [b]]  ->  [a+b] on devices[root]
    all_to_all      [[a],  [b]]  ->  [[a0, a1; b0, b1]], [[a2; b2]]

(``[x; y]`` joins rows.) ``all_gather(reduce_scatter(x))`` is the
all-reduce of x. With ``groups=`` (lists of tower indices that partition
0..K-1, sizes may differ: JAX's ``axis_index_groups``, Horovod's process
sets) each group runs its own collective, and ``root`` is a position inside
every group.

How each algorithm builds them (the algorithm's stage owns it):

- flat: sums and joins on a root device per tensor (spread by bytes), then
  copies back (reduce-scatter sends each device its shard only);
- hierarchical: inside each of its own groups (``Reduction("hierarchical",
  groups=...)``, by position within a collective group) on a root, then
  across the roots (the DGX-1 scheme);
- ring: reduce-scatter and all-gather are the two halves of the ring
  all-reduce (Patarasuk & Yuan, JPDC 2009); broadcast and reduce pass the
  whole tensor hop by hop along the ring (NCCL's ring broadcast pipelines
  it in chunks);
- collective: TF's ``CollectiveReduceV2`` (reduce-scatter keeps each
  device's shard of the sum: TF's ``CollectiveReduceScatterV2`` has no CPU
  kernel), ``CollectiveGatherV2`` (all-gather; all-to-all gathers every
  tower's pieces and keeps its own, K-1 times the bytes of point to point)
  and ``CollectiveBcastSendV2``/``RecvV2``;
- nccl: ``nccl_ops.broadcast`` and ``reduce_sum`` (TF has no NCCL
  reduce-scatter, all-gather or all-to-all op).

All-to-all is point to point for flat, hierarchical and ring: each piece is
one copy from its tower to its destination (MPI's and NCCL's pairwise
exchange). float16 and bfloat16 sums are formed in float32 and rounded once.
Reduce-scatter and reduce take the all-reduce's ``compression=`` ("fp16",
"bf16"; in one process): float32 and float64 tensors cross devices in 16
bits, prescaled by 1/K when averaging, partial sums included, and come
back in their dtype.
As for the all-reduce, the K ops of a TF collective wait for each other: in
a ``tf.compat.v1.Session`` run every output of a call with algorithm
"collective" or ``cluster=``, never some of them.
``tf.IndexedSlices`` are gathered as rows by ``all_gather``; the other
collectives convert them to dense tensors first.
"""

import contextlib
import dataclasses

import tensorflow as tf

from tfreduce.basis.choices import COLLECTIVES
from tfreduce.basis.collective_rules import COLLECTIVE_RULES
from tfreduce.basis.contract import check_flag, values_of
from tfreduce.basis.shards import (check_list, check_root, check_splits, resolve_groups,
                                   validate_tensors)
from tfreduce.blocks.collective import in_function
from tfreduce.blocks.primitives import check_average_dtype, copy_to
from tfreduce.blocks.stage import ReduceContext
from tfreduce.buffers.compression import Compression
from tfreduce.choice.collective_build import (build_wire_group, collective_stage, plan_algorithm,
                                              result_dtypes)
from tfreduce.choice.reduction import as_reduction
from tfreduce.workers.cluster import Cluster
from tfreduce.workers.crossworker import CrossWorkerCollectives, cross_worker_options
from tfreduce.workers.localcluster import LocalCluster

__all__ = ["COLLECTIVES", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"]


@tf.autograph.experimental.do_not_convert
def reduce_scatter(all_tensors, devices=None, average=False, algorithm="auto", *, groups=None,
                   reduction=None, cluster=None, **options):
    """Sums K x N tensors and leaves shard k of each sum on device k.

    ``out[k][n]`` is shard k, along axis 0, of the sum (or mean) over the
    towers of ``all_tensors[.][n]`` (the module docstring's table). The
    first ``B % K`` shards of B rows are one row larger; with fewer rows
    than towers the last shards have 0 rows. The first half of a ring
    all-reduce, and what a sharded optimizer (ZeRO) reduces gradients with.

    Args:
      all_tensors: list of K lists of N tensors of rank >= 1, one shape and
        dtype per tensor n on every tower (None on every tower stays None).
      devices: list of K device strings, or None for the tensors' devices.
      average: bool, the mean over the towers (of the group) instead of the sum.
      algorithm: a name in ``tfreduce.ALGORITHMS`` but "nccl"; "auto" is
        flat on CPUs, ring on GPUs.
      groups: None, or lists of tower indices that partition 0..K-1: each
        group reduce-scatters over its own towers, in group order (a
        hierarchical algorithm's own groups are given as
        ``reduction=Reduction("hierarchical", groups=...)``, by position
        inside each of these groups).
      reduction: a ``tfreduce.Reduction`` instead of ``algorithm`` and options.
      cluster: None (this process), or the started ``tfreduce.Cluster`` of
        this worker: every worker calls with its own K towers, tower k of
        rank w is tower ``w * K + k`` of all T = W * K, and the result is
        that of one process holding all T (no ``groups`` then).
      **options: the algorithm's options (``tfreduce.Reduction``'s fields).

    Returns:
      list[list[tf.Tensor]], K x N; ``out[k][n]`` is placed on ``devices[k]``.

    Raises:
      TypeError: not K lists of tensors; ``average`` on integer tensors.
      ValueError: shapes or dtypes that differ between towers, a scalar,
        groups that are no partition, an algorithm without reduce-scatter
        (naming the tower, the tensor and the values), compression across
        workers.
    """
    check_flag(average, "average")
    return _run("reduce_scatter", all_tensors, devices, (algorithm, reduction, options), groups,
                average=average, cluster=cluster)


@tf.autograph.experimental.do_not_convert
def all_gather(all_tensors, devices=None, algorithm="auto", *, groups=None, reduction=None,
               cluster=None, **options):
    """Concatenates the towers' tensors along axis 0, on every device.

    ``out[k][n]`` is ``all_tensors[0][n]``, ..., ``all_tensors[K-1][n]``
    joined along axis 0 (tower order; with groups, the group's towers in
    group order). Towers may hold different row counts (0 included), like
    Horovod's ``allgather``; the other axes agree. ``tf.IndexedSlices`` (on
    every tower) are gathered as rows: tower k's indices are shifted by the
    rows of the towers before it, so the dense value of ``out[k][n]`` is the
    concatenation of the dense values.

    Args:
      all_tensors: list of K lists of N tensors of rank >= 1.
      devices: list of K device strings, or None for the tensors' devices.
      algorithm: a name in ``tfreduce.ALGORITHMS`` but "nccl".
      groups: None, or lists of tower indices that partition 0..K-1.
      reduction: a ``tfreduce.Reduction`` instead of ``algorithm`` and options.
      cluster: as for ``reduce_scatter`` (the worker's rows are joined on
        its first device, gathered across workers and copied, whatever the
        algorithm; IndexedSlices are made dense).
      **options: the algorithm's options (``tfreduce.Reduction``'s fields).

    Returns:
      list[list[tf.Tensor]], K x N; ``out[k][n]`` is placed on ``devices[k]``.

    Raises:
      TypeError: not K lists of tensors.
      ValueError: axes after the first that differ between towers (naming
        both shapes), dtypes that differ, a scalar, bad groups.
    """
    return _run("all_gather", all_tensors, devices, (algorithm, reduction, options), groups,
                cluster=cluster)


@tf.autograph.experimental.do_not_convert
def broadcast(all_tensors, devices=None, root=0, algorithm="auto", *, groups=None,
              reduction=None, cluster=None, **options):
    """Copies the root tower's N tensors to every device.

    ``out[k][n]`` is ``all_tensors[root][n]``; only the root's row is read
    (with groups, the row of each group's root), the others may be None.

    Args:
      all_tensors: list of K rows; the root's is a list of N tensors.
      devices: list of K device strings, or None for the tensors' devices
        (then every row must hold tensors).
      root: int, the root tower, a position inside every group.
      algorithm: a name in ``tfreduce.ALGORITHMS``.
      groups: None, or lists of tower indices that partition 0..K-1.
      reduction: a ``tfreduce.Reduction`` instead of ``algorithm`` and options.
      cluster: as for ``reduce_scatter`` (``root`` is then a tower index of
        all T, and every worker passes, at its tower ``root % K``, tensors
        of the root's static shapes and dtypes: the root worker sends, the
        others receive into them).
      **options: the algorithm's options (``tfreduce.Reduction``'s fields).

    Returns:
      list[list[tf.Tensor]], K x N; ``out[k][n]`` is placed on ``devices[k]``.

    Raises:
      TypeError: a root row that is not a list of tensors.
      ValueError: a root outside a group, bad groups or devices.
    """
    return _run("broadcast", all_tensors, devices, (algorithm, reduction, options), groups,
                root=root, cluster=cluster)


@tf.autograph.experimental.do_not_convert
def reduce(all_tensors, devices=None, root=0, average=False, algorithm="auto", *, groups=None,
           reduction=None, cluster=None, **options):
    """Sums K x N tensors on the root device.

    Args:
      all_tensors: list of K lists of N tensors, one shape and dtype per n.
      devices: list of K device strings, or None for the tensors' devices.
      root: int, the tower that receives the sums, a position inside every group.
      average: bool, the mean instead of the sum.
      algorithm: a name in ``tfreduce.ALGORITHMS``.
      groups: None, or lists of tower indices that partition 0..K-1.
      reduction: a ``tfreduce.Reduction`` instead of ``algorithm`` and options.
      cluster: as for ``reduce_scatter`` (``root`` is then a tower index of
        all T).
      **options: the algorithm's options (``tfreduce.Reduction``'s fields).

    Returns:
      list of N tf.Tensor (None where a tensor is None on every tower), the
      sums (means) placed on ``devices[root]``; with ``groups``, one such
      list per group (its sums on ``devices[groups[g][root]]``); with
      ``cluster``, every worker's list, on its tower ``root % K``.

    Raises:
      TypeError: not K lists of tensors; ``average`` on integer tensors.
      ValueError: shapes or dtypes that differ, a root outside a group,
        compression across workers.
    """
    check_flag(average, "average")
    out = _run("reduce", all_tensors, devices, (algorithm, reduction, options), groups,
               root=root, average=average, cluster=cluster)
    return out[0] if groups is None else out


@tf.autograph.experimental.do_not_convert
def all_to_all(all_tensors, devices=None, splits=None, algorithm="auto", *, groups=None,
               reduction=None, cluster=None, **options):
    """Sends piece k of every tower's tensors to tower k.

    Tower j splits ``all_tensors[j][n]`` along axis 0 into one piece per
    tower of its group (the shard rule, or ``splits[j]``); ``out[k][n]`` is
    piece k of every tower joined in tower order.

    Args:
      all_tensors: list of K lists of N tensors of rank >= 1; row counts may
        differ between towers, the other axes agree.
      devices: list of K device strings, or None for the tensors' devices.
      splits: None, or a list of K lists: ``splits[j]`` holds the rows tower
        j sends to each tower of its group (ints >= 0 adding up to its rows
        of every tensor; across workers, to each of all T towers), like
        Horovod's ``alltoall(splits=)``.
      algorithm: a name in ``tfreduce.ALGORITHMS`` but "nccl".
      groups: None, or lists of tower indices that partition 0..K-1.
      reduction: a ``tfreduce.Reduction`` instead of ``algorithm`` and options.
      cluster: as for ``reduce_scatter`` (the worker's rows and the pieces'
        row counts are gathered across workers, and each tower cuts out its
        pieces: W times the bytes of point to point).
      **options: the algorithm's options (``tfreduce.Reduction``'s fields).

    Returns:
      list[list[tf.Tensor]], K x N; ``out[k][n]`` is placed on ``devices[k]``.

    Raises:
      ValueError: splits of the wrong size or that do not add up to a
        tower's rows (naming the tower, the tensor, the splits and the
        rows), axes after the first that differ, a scalar, bad groups.
    """
    return _run("all_to_all", all_tensors, devices, (algorithm, reduction, options), groups,
                splits=splits, cluster=cluster)


def _run(collective, all_tensors, devices, choice, groups, root=0, average=False, splits=None,
         cluster=None):
    # Checks the call once, then builds each group's collective with the
    # stage the reduction picks for the group's devices.
    reduction, rule = as_reduction(*choice), COLLECTIVE_RULES[collective]
    num_towers = check_list(all_tensors, collective)
    across = _across_workers(cluster, collective, groups)
    wire, reduction = _wire(collective, reduction, across)
    if across is not None:
        everyone = [list(range(num_towers * across.num_workers))]
        if rule.rooted:
            root = check_root(root, everyone, collective)
        groups, local_root = [list(range(num_towers))], root % num_towers
    else:
        groups = resolve_groups(groups, num_towers, collective)
        if rule.rooted:
            root = check_root(root, groups, collective)
        local_root = root
    tensors = validate_tensors(all_tensors, devices, collective, [g[local_root] for g in groups])
    if rule.takes_splits and splits is not None:
        splits = check_splits(splits, tensors, groups, None if across is None else
                              num_towers * across.num_workers)
    if rule.sums:
        for n in tensors.present:
            check_average_dtype(values_of(tensors.tensors[0][n]).dtype, n, average,
                                f"{collective}: tensor {{n}}", "tensors")
    if across is not None:
        # Full names keep the ops on this worker.
        tensors.devices = across.devices(tensors.devices)
    stages = _stages(collective, reduction, tensors, groups, across, root, average, splits)
    for n in tensors.present if rule.sums else ():
        for stage in stages:
            _check_sum_dtype(stage, wire.wire_dtype(values_of(tensors.tensors[0][n]).dtype),
                             n, collective)
    root = local_root

    def build():
        with tf.name_scope(f"{collective}_{stages[0].name}"):
            out = [[None] * tensors.num_vars for _ in range(tensors.num_towers)]
            results = []
            for gi, (group, stage) in enumerate(zip(groups, stages)):
                scope = tf.name_scope(f"group{gi}") if len(groups) > 1 else contextlib.nullcontext()
                with scope:
                    results.append(build_wire_group(collective, stage, tensors, group, root,
                                                    average, wire, splits))
            if rule.on_root:
                # N per group, None where a tensor is None on every tower.
                return [_spread(row, tensors) for row in results]
            for group, rows in zip(groups, results):
                for i, row in zip(group, rows):
                    for n, t in zip(tensors.present, row):
                        out[i][n] = t
            return out

    if not any(stage.needs_function for stage in stages):
        return build()
    out = in_function(build)
    if tf.executing_eagerly():
        # A tf.function hands its results back on the host: copy each back.
        if rule.on_root:
            return [[copy_to(t, tensors.devices[g[root]]) for t in row]
                    for g, row in zip(groups, out)]
        out = [[copy_to(t, device) for t in row] for row, device in zip(out, tensors.devices)]
    return out


def _wire(collective, reduction, across):
    # (the compression of the sums, the reduction that chooses the stage).
    # Reduce-scatter and reduce compress as the all-reduce does; the other
    # collectives refuse compression when they choose their stage.
    if not COLLECTIVE_RULES[collective].sums or not reduction.compression.compresses:
        return Compression.none, reduction
    if across is not None:
        raise ValueError(f"{collective}: compression={reduction.compression.name!r} compresses "
                         f"the sums of one process; across workers {collective} moves the "
                         f"tensors in their own dtype")
    return reduction.compression, dataclasses.replace(reduction, compression="none")


def _stages(collective, reduction, tensors, groups, across, root, average, splits):
    # The stage of each group; across workers one, around the local stage.
    if across is None:
        stages = []
        for g in groups:
            try:
                stages.append(collective_stage(
                    reduction, collective, [tensors.devices[i] for i in g],
                    _plan(collective, reduction, tensors, g, root, average, splits)))
            except (TypeError, ValueError) as error:
                if reduction.groups is None or len(groups) == 1:
                    raise
                raise type(error)(
                    f"{error}; with groups={groups} each collective group has its own "
                    f"towers: the Reduction's groups= arrange one group's towers by "
                    f"position (0..{len(g) - 1} for {g})") from None
        return stages
    if reduction.topology is not None:
        raise ValueError(f"{collective}: topology={reduction.topology!r} plans for the devices "
                         f"of one process; across workers name the algorithm")
    if reduction.deterministic:
        raise ValueError(f"{collective}: deterministic=True is built for the towers of one "
                         f"process; across workers the sums would add in TF's order")
    options, keys = cross_worker_options(across, "auto", None, None)
    # What the local stage builds: the collective's own local step, or those
    # of the collectives it is composed of. Checked even where no local
    # stage runs (compression, an algorithm without the collective), so
    # that every worker refuses alike.
    rule = COLLECTIVE_RULES[collective]
    steps = sorted({COLLECTIVE_RULES[name].local_step for name in rule.needs or (collective,)}
                   - {None})
    for step in steps or [collective]:
        local = collective_stage(reduction, step, tensors.devices)
    return [CrossWorkerCollectives(across, local if steps else None, options, keys, root=root)]


def _plan(collective, reduction, tensors, group, root, average, splits):
    # "auto" with a topology: the algorithm the cost model picks, else None.
    if reduction.topology is None or reduction.compression.compresses:
        return None
    ctx = ReduceContext([tensors.devices[i] for i in group], average,
                        result_dtypes(tensors, group[root]), root=root)
    return plan_algorithm(collective, reduction, tensors, group, ctx, splits)


def _across_workers(cluster, collective, groups):
    # The cluster of a collective across workers, or None for one process.
    if cluster is None:
        return None
    if not isinstance(cluster, (Cluster, LocalCluster)):
        raise TypeError(f"{collective}: cluster must be a tfreduce.Cluster or None (this "
                        f"process), got {type(cluster).__name__} {cluster!r}")
    if cluster.is_local:
        return None
    if groups is not None:
        raise ValueError(f"{collective}: groups= run inside one process; across workers the "
                         f"collective spans every tower of every worker")
    return cluster


def _spread(row, tensors):
    # The present tensors' results at their places among N, None elsewhere.
    out = [None] * tensors.num_vars
    for n, t in zip(tensors.present, row):
        out[n] = t
    return out


def _check_sum_dtype(stage, dtype, n, collective):
    if stage.dtypes is not None and dtype not in stage.dtypes:
        raise TypeError(f"{collective}: tensor {n}: algorithm {stage.name!r} cannot sum "
                        f"{dtype.name} (it takes "
                        f"{', '.join(sorted(d.name for d in stage.dtypes))})")
