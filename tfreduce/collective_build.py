"""One group's collective, built by its stage (``tfreduce.collectives`` checks the call).

The public collectives validate their input once and pick a stage per group;
this module turns one group's present tensors into the stage's dense K x M
input (the pieces of an all-to-all, the values and shifted indices of
``tf.IndexedSlices`` to all-gather) and its output back into tensors, and,
for "auto" with a topology, costs every algorithm's build of it.
"""

import tensorflow as tf

from tfreduce.contract import dense_shape, values_of
from tfreduce.costmodel import predict
from tfreduce.devices import is_gpu
from tfreduce.primitives import split_rows
from tfreduce.registry import STAGES, make_stage
from tfreduce.shards import Tensors

__all__ = ["build_group", "plan_algorithm", "result_dtypes"]


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


_BUILDERS = {"reduce_scatter": _build_reduce_scatter, "all_gather": _build_all_gather,
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
      list of len(group) rows of the present tensors' results (reduce: one
      list, on the root).
    """
    return _BUILDERS[collective](stage, tensors, group, ctx, splits)


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
    return reduction.planned(key, lambda: _fastest(collective, reduction.topology, specs, ctx,
                                                   splits))


def _fastest(collective, topology, specs, ctx, splits):
    # Every candidate built in one scratch graph and costed.
    candidates = [name for name, cls in STAGES.items() if collective in cls.collectives
                  and (name != "nccl" or all(is_gpu(d) for d in ctx.devices))]
    times = {}
    with tf.Graph().as_default():
        rows = []
        for row, device in zip(specs, ctx.devices):
            with tf.device(device):
                rows.append([tf.zeros(shape, dtype) for shape, dtype in row])
        scratch = Tensors(rows, list(ctx.devices), list(range(len(specs[0]))))
        positions = list(range(len(specs)))
        for name in candidates:
            stage = make_stage(name, {}).bind(scratch.devices)
            with tf.name_scope(name):
                out = build_group(collective, stage, scratch, positions, ctx, splits)
            times[name] = predict(out, topology, inputs=rows).seconds
    return min(candidates, key=lambda name: times[name])
