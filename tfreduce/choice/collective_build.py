"""One group's collective, built by its stage (``tfreduce.doors.collectives`` checks the call).

The public collectives validate their input once and pick a stage per group;
this module turns one group's present tensors into the stage's dense K x M
input (the pieces of an all-to-all, the values and shifted indices of
``tf.IndexedSlices`` to all-gather) and its output back into tensors, and,
for "auto" with a topology, costs every algorithm's build of it.
"""

import tensorflow as tf

from tfreduce.algorithms.registry import STAGES, choose_algorithm, make_stage
from tfreduce.algorithms.tree import TreeStage
from tfreduce.basis.collective_rules import COLLECTIVE_RULES, builds
from tfreduce.basis.contract import dense_shape, values_of
from tfreduce.basis.shards import Tensors
from tfreduce.blocks.primitives import scale_by_reciprocal, split_rows
from tfreduce.blocks.stage import ReduceContext

__all__ = ["BUILDERS", "build_group", "build_wire_group", "plan_algorithm", "result_dtypes"]


def result_dtypes(tensors, tower):
    """The result dtype of each present tensor, in entry order, from one tower's row."""
    return [values_of(tensors.tensors[tower][n]).dtype for n in tensors.present]


def _dense(tensors, group):
    # The group's present tensors, dense, on their towers: K_g x M.
    rows = []
    for i in group:
        row = []
        for n in tensors.present:
            t = tensors.tensors[i][n]
            if isinstance(t, tf.IndexedSlices):
                with tf.device(tensors.devices[i]):
                    t = tf.convert_to_tensor(t)
            row.append(t)
        rows.append(row)
    return rows


def _build_reduce_scatter(stage, tensors, group, ctx, splits):
    return stage.reduce_scatter(_dense(tensors, group), ctx)


def _build_broadcast(stage, tensors, group, ctx, splits):
    return stage.broadcast(_dense(tensors, [group[ctx.root]])[0], ctx)


def _build_reduce(stage, tensors, group, ctx, splits):
    return stage.reduce_to_root(_dense(tensors, group), ctx)


def _build_all_to_all(stage, tensors, group, ctx, splits):
    parts = stage.pieces_per_tower(len(group))
    pieces = []
    for j, row in zip(group, _dense(tensors, group)):
        with tf.device(tensors.devices[j]):
            pieces.append([split_rows(t, parts, name=f"entry{m}_dev{j}_pieces",
                                      sizes=None if splits is None else splits[j])
                           for m, t in enumerate(row)])
    return stage.all_to_all(pieces, ctx)


def _build_all_gather(stage, tensors, group, ctx, splits):
    # Dense tensors gather as they are; IndexedSlices (on every tower) gather
    # their values and their indices shifted by the rows before them.
    sparse = [stage.gathers_slices and all(isinstance(tensors.tensors[i][n], tf.IndexedSlices)
                                           for i in group) for n in tensors.present]
    for s, n in zip(sparse, tensors.present):
        for i in group if s else ():
            _dense_rows(tensors.tensors[i][n], i, n)  # checked before any op is built
    gathered = stage.all_gather(_dense_unless(tensors, group, sparse), ctx)
    if not any(sparse):
        return gathered
    return _as_slices(gathered, tensors, group, sparse)


def _dense_unless(tensors, group, sparse):
    # K_g x M': dense tensors, and for each sparse entry two: values, shifted indices.
    out = []
    for position, i in enumerate(group):
        row = []
        with tf.device(tensors.devices[i]):
            for s, n in zip(sparse, tensors.present):
                t = tensors.tensors[i][n]
                if not s:
                    row.append(tf.convert_to_tensor(t))
                    continue
                before = [_dense_rows(tensors.tensors[j][n], j, n) for j in group[:position]]
                offset = tf.add_n(before) if before else tf.constant(0, tf.int64)
                row += [t.values, tf.cast(t.indices, tf.int64) + offset]
        out.append(row)
    return out


def _dense_rows(slices, k, n):
    if slices.dense_shape is None:
        raise ValueError(f"all_gather: tensor {n} on tower {k} is an IndexedSlices without "
                         f"dense_shape: its rows are what the next towers' indices are shifted "
                         f"by; give it a dense_shape")
    return tf.cast(slices.dense_shape[0], tf.int64)


def _as_slices(gathered, tensors, group, sparse):
    # Each device's gathered entries back into tensors and IndexedSlices.
    out = []
    for i, row in zip(group, gathered):
        entries, at = [], 0
        with tf.device(tensors.devices[i]):
            for s, n in zip(sparse, tensors.present):
                if not s:
                    entries.append(row[at])
                    at += 1
                    continue
                column = [tensors.tensors[j][n] for j in group]
                rows = tf.add_n([_dense_rows(t, j, n) for j, t in zip(group, column)])
                shape = tf.concat([[rows], tf.cast(column[0].dense_shape[1:], tf.int64)], 0)
                entries.append(tf.IndexedSlices(row[at], row[at + 1], shape))
                at += 2
        out.append(entries)
    return out


#: Each collective's builder of one group: fn(stage, tensors, group, ctx,
#: splits) -> len(group) rows of the present tensors' results (a row on the
#: root where its rule is ``on_root``), from the stage's methods.
BUILDERS = {"reduce_scatter": _build_reduce_scatter, "all_gather": _build_all_gather,
            "broadcast": _build_broadcast, "reduce": _build_reduce,
            "all_to_all": _build_all_to_all}


def build_group(collective, stage, tensors, group, ctx, splits=None):
    """Builds one group's collective with its stage.

    Args:
      collective: str, a name in ``choices.COLLECTIVES``.
      stage: stage.Stage bound to the group's devices, or a
        crossworker.CrossWorkerCollectives.
      tensors: shards.Tensors, the validated call.
      group: list of the group's tower indices.
      ctx: stage.ReduceContext of the group (its devices, average, result
        dtypes, root position).
      splits: the checked all-to-all splits, or None.

    Returns:
      list of len(group) rows of the present tensors' results (one list, on
      the root, where the collective's rule is ``on_root``: reduce).
    """
    return BUILDERS[collective](stage, tensors, group, ctx, splits)


def build_wire_group(collective, stage, tensors, group, root, average, wire, splits=None):
    """One group's collective in its wire dtype: compressed, built by its stage, restored.

    Args:
      collective, stage, tensors, group, splits: as ``build_group``.
      root: int, the root's position in the group.
      average: bool, the mean over the group.
      wire: a compression.Compressor; it compresses reduce-scatter and
        reduce only (the door passes Compression.none for the others):
        each tower's tensors prescaled by 1/K_g when averaging, 16-bit
        partial sums (``ReduceContext.wire_sum``), results back in their
        dtype on their devices.

    Returns:
      as ``build_group``.
    """
    restore = _compress(tensors, group, wire, average)
    ctx = ReduceContext([tensors.devices[i] for i in group], average and not wire.compresses,
                        result_dtypes(tensors, group[root]), root=root,
                        wire_sum=wire.compresses)
    rows = build_group(collective, stage, tensors, group, ctx, splits)
    return _decompress(rows, collective, tensors, group, root, wire, restore)


def _compress(tensors, group, wire, average):
    # Each tower of the group casts its tensors to the wire dtype on its
    # device, prescaled by 1/K_g when averaging (Horovod's prescale: no
    # partial sum of a mean overflows); {n: [ctx of each group tower]}.
    restore = {}
    if not wire.compresses:
        return restore
    for n in tensors.present:
        contexts = []
        for i in group:
            with tf.device(tensors.devices[i]), tf.name_scope(f"tensor{n}_dev{i}_compress"):
                t = tf.convert_to_tensor(tensors.tensors[i][n])
                if average and wire.wire_dtype(t.dtype) != t.dtype:
                    t = scale_by_reciprocal(t, len(group))
                tensors.tensors[i][n], ctx = wire.compress(t)
            contexts.append(ctx)
        restore[n] = contexts
    return restore


def _decompress(rows, collective, tensors, group, root, wire, restore):
    # The results back in their dtypes, on their devices.
    if not restore:
        return rows
    on_root = COLLECTIVE_RULES[collective].on_root
    if on_root:
        rows, owners = [rows], [group[root]]
    else:
        owners = group
    out = []
    for i, row in zip(owners, rows):
        with tf.device(tensors.devices[i]):
            out.append([wire.decompress(t, restore[n][group.index(i)])
                        for n, t in zip(tensors.present, row)])
    return out[0] if on_root else out


def collective_stage(reduction, collective, devices, planned=None):
    """The stage that builds one of the other collectives on one group's devices.

    The reduction's named algorithm; for "auto" the registry's rule
    (``choose_algorithm``), or "ring" where that algorithm lacks the
    collective (NCCL's reduce-scatter, all-gather and all-to-all); with a
    topology, the algorithm the door planned (``plan_algorithm``). The
    collectives move each tensor as it is: ``pack_bytes`` and
    ``sparse_as_dense`` apply to all-reduce only.

    Args:
      reduction: the tfreduce.Reduction the door was given or made.
      collective: str, a name in ``tfreduce.COLLECTIVES``.
      devices: list of the group's canonical device names.
      planned: str, the algorithm a plan chose for "auto" with a
        topology, or None.

    Returns:
      stage.Stage, bound to the devices.

    Raises:
      ValueError: compression (the doors of the sums take it off before
        choosing a stage); a topology without a plan; an algorithm that
        does not build this collective (naming those that do); devices the
        algorithm cannot use.
    """
    if reduction.compression.compresses:
        raise ValueError(f"{collective}: compression={reduction.compression.name!r} applies to "
                         f"the sums (all-reduce, reduce_scatter, reduce); {collective} "
                         f"moves the tensors in their own dtype")
    if reduction.topology is not None and planned is None:
        raise ValueError(f"{collective}: topology= is planned per call on the tensors' "
                         f"shapes: call tfreduce.{collective}(..., reduction=...)")
    stage = reduction.stage
    if stage is None:
        name = planned or choose_algorithm(devices)
        stage = make_stage(name if builds(STAGES[name], collective) else "ring", {})
    if not builds(stage, collective):
        able = [name for name, cls in STAGES.items() if builds(cls, collective)]
        raise ValueError(f"algorithm {stage.name!r} does not build {collective} (TF has no "
                         f"such {stage.name} op); use algorithm= one of {able}")
    if reduction.deterministic and COLLECTIVE_RULES[collective].sums:
        stage = TreeStage(stage)  # the algorithm moves the data; the fixed tree sums it
    return stage.bind(devices)


def plan_algorithm(collective, reduction, tensors, group, ctx, splits=None):
    """The algorithm the cost model predicts fastest for one group's collective.

    Every algorithm that builds the collective (NCCL only on GPU names) is
    built in a scratch graph on tensors of the group's static shapes and
    dtypes (nothing runs, the devices need not exist) and costed by
    ``tfreduce.predict`` on ``topology``.

    Args:
      collective: str, a name in ``choices.COLLECTIVES``.
      reduction: the tfreduce.Reduction with the topology; it keeps the
        choice by collective, devices, root, average and shapes.
      tensors: shards.Tensors, the validated call.
      group: list of the group's tower indices.
      ctx: stage.ReduceContext of the group.
      splits: the checked all-to-all splits, or None.

    Returns:
      str, the algorithm's name.

    Raises:
      ValueError: a tensor whose shape is not fully known when built (named).
    """
    specs = []
    for i in group:
        row = []
        for n in tensors.present:
            shape = dense_shape(tensors.tensors[i][n])
            if not shape.is_fully_defined():
                raise ValueError(f"{collective}: topology= costs static shapes, but tensor {n} "
                                 f"on tower {i} has shape {shape}; name the algorithm")
            row.append((tuple(shape.as_list()), values_of(tensors.tensors[i][n]).dtype))
        specs.append(row)
    key = (collective, tuple(ctx.devices), ctx.root, ctx.average, str(specs), str(splits))
    from tfreduce.analysis.planner import planned  # only to plan: the doors need it not
    return planned(reduction, key, lambda: _fastest(collective, reduction.topology, specs, ctx,
                                                   splits))


def _fastest(collective, topology, specs, ctx, splits):
    # Every registered algorithm that builds it and binds on these devices
    # (NCCL refuses devices that are not GPUs), built in one scratch graph
    # and costed.
    from tfreduce.analysis.costmodel import predict  # only to plan: the doors need it not
    stages = {}
    for name, cls in STAGES.items():
        if builds(cls, collective):
            try:
                stages[name] = make_stage(name, {}).bind(list(ctx.devices))
            except ValueError:
                continue
    times = {}
    with tf.Graph().as_default():
        rows = []
        for row, device in zip(specs, ctx.devices):
            with tf.device(device):
                rows.append([tf.zeros(shape, dtype) for shape, dtype in row])
        scratch = Tensors(rows, list(ctx.devices), list(range(len(specs[0]))))
        positions = list(range(len(specs)))
        for name, stage in stages.items():
            with tf.name_scope(name):
                out = build_group(collective, stage, scratch, positions, ctx, splits)
            times[name] = predict(out, topology, inputs=rows).seconds
    return min(stages, key=lambda name: times[name])
