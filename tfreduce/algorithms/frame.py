"""The frame every reduction runs in, and the contract of its stages.

One public call builds one reduction:

    validate the K x N input (the caller, once) -> bind the stages to the K
    devices -> densify what must be dense -> pack into M entries (K x M) ->
    run the stages on the dense entries, gather the sparse ones -> unpack
    to K x N

An algorithm is a ``Stage`` (``tfreduce.blocks.stage``, which states its contract):
it only reduces packed dense buffers. Every check, the packing, the sparse
path and the errors users see are shared, so all algorithms behave the same.
A reduction of several stages (the multi-worker one: local stage ->
cross-worker stage) is a list of stages run by the same frame: every stage
but the last forms plain sums in the accumulation dtype; the last scales
once and casts back once.
"""

import tensorflow as tf

from tfreduce.basis.contract import nbytes, values_of
from tfreduce.basis.devices import host_device
from tfreduce.blocks.collective import in_function
from tfreduce.blocks.primitives import (RootBalancer, accumulation_dtype, broadcast_slices,
                                        check_average_dtype, copy_to, gather_slices,
                                        scale_by_reciprocal, sum_order)
from tfreduce.blocks.stage import ReduceContext
from tfreduce.buffers.compression import Compression
from tfreduce.buffers.packing import PackPlan

__all__ = ["run_stages"]


def run_stages(grads, stages, average, scope=None, pack_bytes=None, sparse_as_dense=False,
               compression=Compression.none):
    """Packs, reduces with the stages and unpacks a validated K x N gradient list.

    The caller checked the options (``tfreduce.Reduction``, once); what is
    checked here depends on the gradients.

    Args:
      grads: contract.Gradients, validated once by the public call.
      stages: list of Stage, run in order on the dense entries.
      average: bool, mean instead of sum.
      scope: str, the name scope of this call; default ``allreduce_<name>``
        of the only stage.
      pack_bytes: int or None, see packing.PackPlan.
      sparse_as_dense: bool, reduce ``tf.IndexedSlices`` as dense tensors
        (else gathered: on one device, then by the later stages).
      compression: a compression.Compressor: float32 and float64 gradients
        cross devices in its dtype.

    Returns:
      list of K lists of N, ``out[k][n]`` on ``grads.devices[k]``.

    Raises:
      TypeError: average=True on integer gradients; a dtype a stage cannot
        reduce.
      ValueError: devices a stage cannot use (NCCL on CPUs, groups that do
        not cover K).
      tf.errors.InvalidArgumentError: when the graph runs, a variable whose
        shape is known only then differs between towers (the message names
        the tower and the variable).
    """
    stages = [stage.bind(grads.devices) for stage in stages]
    for n in grads.reduced:
        dtype = values_of(grads.grads[0][n]).dtype
        check_average_dtype(dtype, n, average)
        dtype = compression.wire_dtype(dtype)
        for stage in stages:
            if stage.dtypes is not None and dtype not in stage.dtypes:
                raise TypeError(
                    f"variable {n}: algorithm {stage.name!r} cannot reduce {dtype.name} "
                    f"gradients (it takes {', '.join(sorted(d.name for d in stage.dtypes))}); "
                    f"choose another algorithm or cast the gradients")
    scope = scope or f"allreduce_{stages[0].name}"

    # Compressed, a mean is formed from means: each tower scales its
    # gradients by 1/K before the cast, so a mean that fits in 16 bits never
    # overflows on the way (a value above 65504 on one tower included), and
    # the stages only sum (Horovod's prescale).
    prescale = average and compression.compresses

    def build():
        with tf.name_scope(scope):
            _check_shapes_at_run_time(grads)
            _densify(grads, sparse_as_dense)
            if prescale:
                _prescale(grads)
            restore = _compress(grads, compression)
            plan = PackPlan(grads, pack_bytes)
            packed = plan.pack()  # K x M
            out = plan.unpack(_reduce_entries(packed, grads.devices, average and not prescale,
                                              stages, compression.compresses))
            return _decompress(out, restore, grads.devices, compression)

    if not any(stage.needs_function for stage in stages):
        return build()
    out = in_function(build)
    if tf.executing_eagerly():
        # A tf.function hands its results back on the host: copy each to its
        # tower, so that eagerly too out[k][n] is on devices[k].
        out = [[copy_to(g, device) for g in row] for row, device in zip(out, grads.devices)]
    return out


def _check_shapes_at_run_time(grads):
    # Shapes known only when the graph runs are compared with tower 0's then:
    # a mismatch fails naming tower and variable, where a sum would fail in
    # a kernel without saying which, or a ring or packing reshape silently.
    for n in grads.reduced:
        if grads.static(n):
            continue
        column = grads.column(n)
        full = all(not isinstance(g, tf.IndexedSlices) or g.dense_shape is not None
                   for g in column)
        # String ops and the serialising copy have CPU kernels only: they run
        # on the host of each tower's task (a GPU tower's gradient makes a
        # round trip, which only gradients without a static shape pay).
        hosts = [host_device(d) for d in grads.devices]
        with tf.device(hosts[0]):
            ref = _shape_text(column[0], full)
        same = []
        for k in range(1, grads.num_towers):
            with tf.device(hosts[k]):
                same.append(tf.equal(_shape_text(column[k], full), ref))
            with tf.device(grads.devices[k]):
                grads.grads[k][n] = _checked(
                    column[k], same[-1], f"variable {n}: tower {k} has another shape than tower 0",
                    hosts[k])
        if same:
            # Tower 0 waits too, so that no tower starts a collective (which
            # a failed peer would leave aborted for the whole process).
            other = "tower 1" if len(same) == 1 else "a tower"
            with tf.device(hosts[0]):
                all_same = tf.reduce_all(tf.stack(same))
            with tf.device(grads.devices[0]):
                grads.grads[0][n] = _checked(
                    column[0], all_same, f"variable {n}: {other} has another shape than tower 0",
                    hosts[0])


def _shape_text(g, full):
    # The dense shape as text, e.g. "3,2" (so that two ranks compare too);
    # without the first axis (rows) when some tower's IndexedSlices carry no
    # dense_shape.
    if isinstance(g, tf.IndexedSlices):
        shape = g.dense_shape if full else tf.shape(g.values)[1:]
    else:
        shape = tf.shape(g) if full else tf.shape(g)[1:]
    return tf.strings.reduce_join(tf.strings.as_string(shape), separator=",")


def _checked(g, ok, message, host):
    # g again, by a path Grappler cannot shortcut: a copy opaque to its shape
    # inference (serialised and parsed back), times a one that exists only if
    # ``ok`` (1 / ok goes through a CheckNumerics that fails with ``message``
    # on the infinity). Every reader of g then waits for the check. Simpler
    # forms fail: an Assert on a control dependency, a reshape or a product
    # with g itself all let Grappler, which assumes the sum downstream is
    # valid and so that the shapes agree, fold the check away and run the
    # sum first, which then fails without the message. x * 1 is exact. Only
    # gradients whose shape is not static pay for the copy.
    values = values_of(g)
    with tf.device(host):
        one = tf.raw_ops.CheckNumerics(tensor=1.0 / tf.cast(ok, tf.float64), message=message)
        opaque = tf.io.parse_tensor(tf.io.serialize_tensor(values), values.dtype)
    opaque.set_shape(values.shape)
    values = opaque * tf.cast(one, values.dtype)
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(values, g.indices, g.dense_shape)
    return values


def _densify(grads, sparse_as_dense):
    # A variable that is sparse on some towers and dense on others is reduced
    # densely: its sum is dense anyway.
    for n in grads.reduced:
        column = grads.column(n)
        sparse = [isinstance(g, tf.IndexedSlices) for g in column]
        if any(sparse) and (sparse_as_dense or not all(sparse)):
            for k, g in enumerate(column):
                if isinstance(g, tf.IndexedSlices):
                    with tf.device(grads.devices[k]):
                        grads.grads[k][n] = tf.convert_to_tensor(g)


def _prescale(grads):
    # Each tower's gradients times 1/K, in their dtype, on the tower.
    for n in grads.reduced:
        for k, device in enumerate(grads.devices):
            g = grads.grads[k][n]
            with tf.device(device), tf.name_scope(f"var{n}_dev{k}_prescale"):
                if isinstance(g, tf.IndexedSlices):
                    g = tf.IndexedSlices(scale_by_reciprocal(g.values, grads.num_towers),
                                         g.indices, g.dense_shape)
                else:
                    g = scale_by_reciprocal(g, grads.num_towers)
            grads.grads[k][n] = g


def _compress(grads, compression):
    # Each tower compresses its gradients on its own device, before anything
    # crosses devices; returns {n: [ctx of tower k]} of the cast ones.
    restore = {}
    for n in grads.reduced:
        contexts = []
        for k, device in enumerate(grads.devices):
            with tf.device(device):
                grads.grads[k][n], ctx = compression.compress(grads.grads[k][n])
            contexts.append(ctx)
        if any(ctx is not None for ctx in contexts):
            restore[n] = contexts
    return restore


def _decompress(out, restore, devices, compression):
    # Each tower restores its results' dtypes, on its device.
    for n, contexts in restore.items():
        for k, device in enumerate(devices):
            with tf.device(device):
                out[k][n] = compression.decompress(out[k][n], contexts[k])
    return out


def _reduce_entries(packed, devices, average, stages, wire_sum):
    # packed: K x M; dense entries go through the stages, sparse ones are
    # gathered on a root and broadcast.
    num_towers, num_entries = len(packed), len(packed[0])
    out = [[None] * num_entries for _ in range(num_towers)]
    sparse = [m for m in range(num_entries) if isinstance(packed[0][m], tf.IndexedSlices)]
    dense = sorted(set(range(num_entries)) - set(sparse))
    if dense:
        buffers = [[row[m] for m in dense] for row in packed]  # K x M'
        for k, row in enumerate(_run_pipeline(buffers, devices, average, stages, wire_sum)):
            for m, t in zip(dense, row):
                out[k][m] = t
    balancer = RootBalancer(num_towers)
    sizes = [nbytes(packed[0][m]) for m in sparse]
    for i in sum_order(sizes):
        m = sparse[i]
        root = balancer.pick(range(num_towers), sizes[i])
        # Several stages: the later ones gather further and scale once.
        gathered = gather_slices([packed[k][m] for k in range(num_towers)], devices[root],
                                 num_towers, average and len(stages) == 1,
                                 name=f"entry{m}_gather")
        for stage in stages[1:]:
            gathered = stage.gather(gathered, devices[root], average, m)
        for k, s in enumerate(broadcast_slices(gathered, devices,
                                               name_fmt=f"entry{m}_dev{{}}_out")):
            out[k][m] = s
    return out


def _run_pipeline(buffers, devices, average, stages, wire_sum):
    # buffers: K x M dense. One stage reduces and finishes. Several: the
    # inputs go up to the accumulation dtype first, every stage but the last
    # sums in it inside its own name scope, and the last one finishes.
    dtypes = [t.dtype for t in buffers[0]]
    if len(stages) == 1:
        return stages[0].reduce(buffers, ReduceContext(devices, average, dtypes,
                                                       wire_sum=wire_sum))
    buffers = _to_accumulation(buffers, devices)  # K x M
    partial = [t.dtype for t in buffers[0]]
    upstream_collective = False
    for stage in stages[:-1]:
        with tf.name_scope(f"allreduce_{stage.name}"):
            buffers = stage.reduce(buffers, ReduceContext(devices, False, partial,
                                                          upstream_collective))
        upstream_collective = stage.collective
    return stages[-1].reduce(buffers, ReduceContext(devices, average, dtypes,
                                                    upstream_collective))


def _to_accumulation(buffers, devices):
    # Half types go up to float32 on each tower, before the first sum, so
    # that every sum of the pipeline is float32 and the result rounds once.
    out = []
    for k, (row, device) in enumerate(zip(buffers, devices)):
        cast_row = []
        for m, g in enumerate(row):
            acc = accumulation_dtype(g.dtype)
            if acc != g.dtype:
                with tf.device(device):
                    g = tf.cast(g, acc, name=f"entry{m}_dev{k}_to_{acc.name}")
            cast_row.append(g)
        out.append(cast_row)
    return out
