"""Horovod's collectives over the processes of the run, on tfreduce's cross-worker stages.

Each process holds one tower (its device, ``process.device()``); a
collective spans every process, so a process's tensor is one row of a
size x 1 K x N list, and the reductions are tfreduce's multi-worker ones:
gradients packed into 4 MiB buffers, compressed on the wire if asked, summed
with TensorFlow's ``CollectiveReduceV2`` over gRPC; allgather and broadcast
are ``tfreduce.doors.collectives``' (with ``cluster=``), as reducescatter and
alltoall are (scatter.py); Min, Max and Product, which tfreduce's
all-reduce does not offer, are TF's collective all-reduce of those ops.
They run eagerly or inside a ``tf.function`` (``model.fit``'s train step);
every process must call the same collectives in the same order, as in
Horovod.

Sources: Horovod's API (horovod.tensorflow: allreduce with op, prescale and
postscale factors, allgather with uneven first dimensions, broadcast from
any root rank); TensorFlow's collective ops as the engine.
"""

import tensorflow as tf

from tfreduce.basis.contract import check_root_rank, tf_variables
from tfreduce.basis.devices import local_name
from tfreduce.blocks.collective import CollectiveChain, CollectiveOptions
from tfreduce.buffers.compression import Compression, as_compressor
from tfreduce.doors.collectives import all_gather, broadcast as tfreduce_broadcast
from tfreduce.doors.multiworker import allreduce_grads_multiworker, broadcast_variables_multiworker
from tfreduce.tensorflow import mpi_calls, prepared_calls
from tfreduce.tensorflow.calls import (agree, differentiable, in_session, one_call, result_spec,
                                       run_cached, session_graph, tensor_or_slices)
from tfreduce.tensorflow.process import cluster, device
from tfreduce.tensorflow.reduce_ops import (ELEMENTWISE, Adasum, Average, Sum, check_op,
                                           check_process_set, global_process_set)
from tfreduce.tensorflow.wire import (check_dtypes, finish_mean, integer_mean, mean_dtype, narrow,
                                      off_wire, on_wire, scale, widen, wire_dtype)

__all__ = ["Compression", "allreduce", "grouped_allreduce", "allgather", "grouped_allgather",
           "broadcast", "broadcast_variables"]

@tf.autograph.experimental.do_not_convert
@one_call("allreduce")
def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """All-reduces a list of tensors over every process, packed together.

    The N tensors of this process are one row of a size x N K x N list (one
    tower per process); ``out[n]`` is ``postscale * reduce(prescale * x[n])``
    over the processes, the mean (op=Average, default) or sum (op=Sum),
    on this process's device, with x[n]'s shape and dtype. Dense tensors
    are packed into 4 MiB buffers, one ``CollectiveReduceV2`` each;
    ``tf.IndexedSlices`` stay sparse (their rows are all-gathered).

    Args:
      tensors: list of N tf.Tensor (float or int, static shapes, the same
        on every process) or tf.IndexedSlices.
      average: Horovod's deprecated bool spelling of op.
      device_dense: Horovod's device hint; the collectives run on this
        process's device whatever it says.
      device_sparse: as device_dense.
      compression: tfreduce.Compression.none, .fp16 or .bf16 (or their
        names): float32/float64 tensors cross between processes in 16 bits,
        prescaled by 1/size when averaging so a mean that fits never
        overflows.
      op: Average (None) or Sum.
      prescale_factor: float multiplied in before the reduction (the values
        of IndexedSlices).
      postscale_factor: float multiplied in after it.
      process_set: global_process_set (the only one).
      ignore_name_scope: accepted for Horovod's signature.
      name: accepted for Horovod's signature; ops are named by tfreduce.

    Returns:
      list of N tensors.

    Raises:
      RuntimeError: init() was not called.
      ValueError: an unsupported op or process set, tensors tfreduce cannot
        reduce (named).
    """
    del device_dense, device_sparse, ignore_name_scope
    out = prepared_calls.allreduce(tensors, average, compression, op, prescale_factor,
                                   postscale_factor, process_set, name, "grouped_allreduce")
    if out is not None:  # eagerly on the MPI transport, prepared once per signature
        return out

    def reduce(tensors):
        return _allreduce_list(tensors, average, compression, op, prescale_factor,
                               postscale_factor, process_set, "grouped_allreduce", name)

    return differentiable(reduce, reduce, tensors)  # Horovod's gradient: the same reduction


def _allreduce_list(tensors, average, compression, op, prescale_factor, postscale_factor,
                    process_set, where, name=None):
    tensors = [tensor_or_slices(t) for t in tensors]
    if op == Adasum and any(isinstance(t, tf.IndexedSlices) for t in tensors):
        # Horovod's class for this case, whose op is refused for any tensor below.
        raise NotImplementedError(f"{where}: op=Adasum does not reduce tf.IndexedSlices (nor "
                                  "anything else here); use Sum or Average")
    op = check_op(op, average, where)
    check_process_set(process_set, where)
    if op in ELEMENTWISE and any(isinstance(t, tf.IndexedSlices) for t in tensors):
        raise NotImplementedError(
            f"{where}: op={op!r} does not reduce tf.IndexedSlices, only Sum and Average do "
            "(densify them first: tf.convert_to_tensor, or sparse_as_dense=True)")
    check_dtypes(tensors, where)
    if not tensors:
        return []
    if session_graph():
        return in_session(
            lambda ts: _allreduce_list(ts, None, compression, op, prescale_factor,
                                       postscale_factor, process_set, where, name),
            tensors, [result_spec(t, mean_dtype(t, op == Average)) for t in tensors])
    found, place = cluster(), device()
    compression = as_compressor(compression)

    def build(tensors):
        with tf.device(place):
            out = _reduce(found, place, [scale(t, prescale_factor) for t in tensors], op,
                          compression)
            return [finish_mean(t, op == Average, postscale_factor, found.num_workers) for t in out]

    # How a process waiting in join() makes this call with zeros (functions.join);
    # pickled only when one waits.
    recipe = None if op not in (Sum, Average) or any(
        isinstance(t, tf.IndexedSlices) for t in tensors) else prepared_calls.allreduce_recipe(
        op, compression.name, prescale_factor, postscale_factor, name, tensors)

    def over_mpi(mpi, tensors):  # the same steps, the sums over MPI (mpi_calls)
        with tf.device(place):
            out = mpi_calls.allreduce(mpi, [scale(t, prescale_factor) for t in tensors], op,
                                      found.num_workers)
            return [finish_mean(t, op == Average, postscale_factor, found.num_workers) for t in out]

    dense = not compression.compresses and (recipe is not None or op in ELEMENTWISE)
    return run_cached(("allreduce", op, compression.name, prescale_factor, postscale_factor),
                      build, tensors, name=name, recipe=recipe, mpi=over_mpi if dense else None,
                      same_specs=True)


def _reduce(found, place, tensors, op, compression):
    """The op over the processes of each tensor (widened on the wire where TF needs it)."""
    if found.is_local:
        return [t if isinstance(t, tf.IndexedSlices) else tf.identity(t) for t in tensors]
    given = tensors
    tensors = [on_wire(t) for t in tensors]
    if op in ELEMENTWISE:
        chain, group_key, _ = _chain_for(found, place)
        out = []
        for n, t in enumerate(tensors):
            wire, context = compression.compress(t)
            with chain.after_previous(place):
                reduced = chain.all_reduce(wire, place, found.num_workers, group_key,
                                           found.keys.instance_key(), name=f"{op}{n}",
                                           merge_op=ELEMENTWISE[op])
            out.append(compression.decompress(reduced, context))
    else:
        # Integers are summed; their mean is scaled after (wire.finish_mean).
        means = [op == Average and not integer_mean(t, op == Average) for t in tensors]
        out = [None] * len(tensors)
        for average in (True, False):
            picked = [n for n, m in enumerate(means) if m == average]
            if picked:
                with tf.control_dependencies([t for t in out if t is not None
                                              and not isinstance(t, tf.IndexedSlices)]):
                    reduced = allreduce_grads_multiworker(
                        [[tensors[n] for n in picked]], [place], average=average,
                        cluster=found, compression=compression)[0]
                for n, t in zip(picked, reduced):
                    out[n] = t
    return [off_wire(t, like) for t, like in zip(out, given)]


@tf.autograph.experimental.do_not_convert
@one_call("allreduce")
def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=global_process_set, ignore_name_scope=False):
    """All-reduces one tensor over every process: ``grouped_allreduce([tensor], ...)[0]``.

    Example, 2 processes, op=Average (the default)::

        rank 0: tf.constant([1., 2.])  ->  [2., 3.]
        rank 1: tf.constant([3., 4.])  ->  [2., 3.]

    Raises:
      As grouped_allreduce.
    """
    del device_dense, device_sparse, ignore_name_scope
    out = prepared_calls.allreduce([tensor], average, compression, op, prescale_factor,
                                   postscale_factor, process_set, name, "allreduce")
    if out is not None:
        return out[0]

    def reduce(tensors):
        return _allreduce_list(tensors, average, compression, op, prescale_factor,
                               postscale_factor, process_set, "allreduce", name)

    return differentiable(reduce, reduce, [tensor])[0]


def _chain_for(found, where):
    options = CollectiveOptions(timeout=found.op_timeout)
    chain = CollectiveChain(options)
    group_key = found.group_key([local_name(where)])
    chain.token(where, f"tfreduce_hvd_order_{group_key}", "hvd_order")
    return chain, group_key, options


@tf.autograph.experimental.do_not_convert
@one_call("allgather")
def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    """All-gathers each tensor along axis 0 over every process, in rank order.

    Processes may differ in axis 0 (Horovod's uneven allgather), not in the
    other axes. Example, 2 processes::

        rank 0: [[1, 2]]          ->  [[1, 2], [3, 4], [5, 6]]
        rank 1: [[3, 4], [5, 6]]  ->  [[1, 2], [3, 4], [5, 6]]

    Args:
      tensors: list of tf.Tensor of rank >= 1.

    Returns:
      list of tensors [sum over processes of axis 0, ...], on this process's device.

    Raises:
      RuntimeError: init() was not called.
      ValueError: a scalar (named by its position), an unsupported process set.
    """
    del ignore_name_scope
    check_process_set(process_set, "allgather")
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    check_dtypes(tensors, "allgather")
    for n, t in enumerate(tensors):
        if t.shape.rank == 0:
            raise ValueError(f"allgather: tensor {n} is a scalar; gather tensors of rank >= 1 "
                             "(tf.reshape(x, [1]))")
    found, place = cluster(), device()

    def build(tensors):
        # tfreduce's all-gather across workers: row counts first, then the
        # rows padded to the longest, each worker's kept.
        with tf.device(place):
            out = all_gather([[widen(t) for t in tensors]], [place], cluster=found)[0]
            return [narrow(o, t.dtype) for o, t in zip(out, tensors)]

    def gather(tensors):
        if session_graph():
            return in_session(gather, tensors, [result_spec(t, rows_vary=True) for t in tensors])
        if not tf.executing_eagerly():
            return build(tensors)
        # TF's runtime keeps the shape an instance key first ran with: each
        # pattern of row counts gets its own function (and keys), so a later
        # call with other counts never meets an earlier call's shape.
        counts = agree(("allgather",), tensors, rows_vary=True, name=name,
                       values=[int(t.shape[0]) for t in tensors])
        return run_cached(("allgather", counts), build, tensors, check=False,
                          mpi=lambda mpi, ts: mpi_calls.allgather(mpi, ts, counts))

    def gradient(upstream):
        # Horovod's: this process's rows of the mean of the upstream gradients.
        means = grouped_allreduce(upstream)
        # After the means: in a TF1 session two side-by-side collectives run
        # in any order, which may differ between the processes.
        with tf.control_dependencies(means):
            rows = gather([tf.shape(t, tf.int64)[:1] for t in tensors])
        return [tf.split(g, tf.cast(r, tf.int32), num=found.num_workers)[found.rank]
                for g, r in zip(means, rows)]

    return differentiable(gather, gradient, tensors)


@tf.autograph.experimental.do_not_convert
@one_call("allgather")
def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """All-gathers one tensor along axis 0: ``grouped_allgather([tensor])[0]``."""
    return grouped_allgather([tensor], name, ignore_name_scope, process_set)[0]


def _check_root(root_rank, where):
    check_root_rank(root_rank, cluster().num_workers, f"{where}: ", " processes")


@tf.autograph.experimental.do_not_convert
@one_call("broadcast")
def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Every process gets root_rank's tensor (same shape and dtype on every process).

    Example, 2 processes, root_rank=1::

        rank 0: [1., 2.]  ->  [3., 4.]
        rank 1: [3., 4.]  ->  [3., 4.]

    Raises:
      RuntimeError: init() was not called.
      ValueError: a root_rank outside 0..size-1, a shape not known when a
        tf.function traces (across processes), an unsupported process set.
    """
    del ignore_name_scope
    check_process_set(process_set, "broadcast")
    _check_root(root_rank, "broadcast")
    tensor = tf.convert_to_tensor(tensor)
    check_dtypes([tensor], "broadcast")
    found, place = cluster(), device()

    def build(tensors):
        # tfreduce's broadcast across workers; root_rank is the root tower
        # (one tower per process).
        with tf.device(place):
            out = tfreduce_broadcast([[widen(tensors[0])]], [place], root=root_rank,
                                     cluster=found)[0][0]
            return [narrow(out, tensor.dtype)]

    def gradient(upstream):
        # Horovod's: the mean of the upstream gradients on the root, zeros elsewhere.
        mean = allreduce(upstream[0])
        if found.rank == root_rank:
            return [mean]
        # In a graph, zeros that do not depend on the all-reduce would let the
        # session prune it on this process only, and the root would wait.
        with tf.control_dependencies([mean]):
            return [tf.zeros_like(mean)]

    def forward(tensors):
        if session_graph():
            return in_session(forward, tensors, [result_spec(tensors[0])])
        return run_cached(("broadcast", root_rank), build, tensors, name=name, same_specs=True,
                          mpi=lambda mpi, ts: mpi_calls.broadcast(mpi, ts, root_rank))

    return differentiable(forward, gradient, [tensor])[0]


def _broadcast_variables_graph(variables, found, root_rank):
    """The ops that assign root_rank's values to `variables`, in a graph.

    Dtypes TF's broadcast takes go packed, one buffer per dtype
    (``broadcast_variables_multiworker``); the others (8- and 16-bit
    integers, bfloat16) one by one, widened on the wire."""
    packed = [v for v in variables if wire_dtype(v.dtype) == v.dtype.base_dtype]
    ops = broadcast_variables_multiworker([packed], found, root_rank=root_rank) if packed else []
    for v in variables:
        if wire_dtype(v.dtype) != v.dtype.base_dtype:  # after the packed: one order everywhere
            with tf.control_dependencies(ops):
                ops = ops + [v.assign(broadcast(v.read_value(), root_rank))]
    return ops


@tf.autograph.experimental.do_not_convert
@one_call("broadcast_variables")
def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assigns root_rank's values to the variables of every process, one buffer per dtype.

    Call it at the same point on every process (after building the model and
    the optimizer's variables), e.g. ``broadcast_variables(model.variables, 0)``.

    Args:
      variables: list of tf.Variable (Keras variables too), the same shapes
        and dtypes on every process.
      root_rank: int in 0..size-1.
      process_set: global_process_set (the only one).
      inplace: accepted for Horovod's signature (the assignments are in place).

    Raises:
      RuntimeError: init() was not called.
      ValueError: a bad root_rank or process set; variables that differ.
    """
    del inplace
    check_process_set(process_set, "broadcast_variables")
    _check_root(root_rank, "broadcast_variables")
    variables = tf_variables([list(variables)])
    if not variables[0]:
        return
    found = cluster()
    if session_graph():
        # The user's session runs the broadcast of the values, then the assignments.
        values = [v.read_value() for v in variables[0]]
        values = in_session(lambda ts: [broadcast(t, root_rank) for t in ts], values,
                            [result_spec(t) for t in values])
        return [v.assign(t) for v, t in zip(variables[0], values)]
    if not tf.executing_eagerly():
        return _broadcast_variables_graph(variables[0], found, root_rank)

    def build(_):
        with tf.control_dependencies(_broadcast_variables_graph(variables[0], found, root_rank)):
            return [tf.constant(0)]

    # Processes compare the variables' shapes and dtypes; the same variables
    # again (a later fit) reuse the function.
    agree(("broadcast_variables", root_rank), variables[0])
    run_cached(("broadcast_variables", root_rank, tuple(id(v) for v in variables[0])), build, [],
               check=False, mpi=lambda mpi, _: mpi_calls.assign_broadcast(mpi, variables[0],
                                                                          root_rank))
