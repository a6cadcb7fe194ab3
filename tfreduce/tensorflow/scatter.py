"""Horovod's collectives that hand each process a part: reducescatter and alltoall.

One tower per process, as in ``tfreduce.tensorflow.ops``: a process's
tensor is one row of a size x 1 K x N list, and the collective is
``tfreduce.reduce_scatter`` / ``tfreduce.all_to_all`` across the processes
(``cluster=``). reducescatter splits rows by tfreduce's one shard rule,
which is Horovod's too: of B rows over P processes, the first B % P ranks
get one row more. alltoall without splits sends each process B / P rows
and, as Horovod, refuses B that P does not divide.

Sources: Horovod's API (horovod.tensorflow: reducescatter and
grouped_reducescatter with op, compression and scale factors, alltoall with
uneven splits and the received splits).
"""

import numpy as np
import tensorflow as tf

from tfreduce.blocks.primitives import scale_by_reciprocal
from tfreduce.buffers.compression import Compression, as_compressor
from tfreduce.doors.collectives import all_gather, all_to_all, reduce_scatter
from tfreduce.tensorflow import mpi_calls
from tfreduce.tensorflow.calls import (agree, differentiable, in_session, one_call, result_spec,
                                       run_cached, session_graph)
from tfreduce.tensorflow.ops import grouped_allgather
from tfreduce.tensorflow.process import cluster, device
from tfreduce.tensorflow.reduce_ops import Average, check_op, check_process_set, global_process_set
from tfreduce.tensorflow.wire import check_dtypes, narrow, scale, widen
from tfreduce.workers.consistency import MessageError

__all__ = ["reducescatter", "grouped_reducescatter", "alltoall", "SplitsError"]


class SplitsError(MessageError, tf.errors.InvalidArgumentError, ValueError):
    """alltoall without splits on a process whose rows the processes cannot share evenly.

    A ``tf.errors.InvalidArgumentError``, the class Horovod raises, and a
    ValueError; raised on every process.
    """


@tf.autograph.experimental.do_not_convert
@one_call("reducescatter")
def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reduce-scatters each tensor over every process: this rank's rows of the mean (sum).

    Example, 2 processes, op=Average (the default), 3 rows::

        rank 0: [[1.], [2.], [3.]]  ->  [[2.], [3.]]    (rows 0-1 of the mean)
        rank 1: [[3.], [4.], [5.]]  ->  [[4.]]          (row 2)

    Args:
      tensors: list of N tf.Tensor of rank >= 1, one shape per n on every
        process.
      device_dense: Horovod's device hint; the collective runs on this
        process's device whatever it says.
      compression: tfreduce.Compression.none, .fp16 or .bf16 (or their
        names): float32/float64 tensors cross in 16 bits, prescaled by
        1/size when averaging so that a mean that fits never overflows.
      op: Average (default) or Sum.
      process_set: global_process_set (the only one).
      prescale_factor: float multiplied in before the reduction.
      postscale_factor: float multiplied in after it.

    Returns:
      list of N tensors: shard ``rank()`` of each reduced tensor along
      axis 0, on this process's device.

    Raises:
      RuntimeError: init() was not called.
      ValueError: an unsupported op or process set, a scalar (named).
    """
    del device_dense
    op = check_op(op, None, "reducescatter")
    check_process_set(process_set, "reducescatter")
    compression = as_compressor(compression)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    check_dtypes(tensors, "reducescatter")
    for n, t in enumerate(tensors):
        if t.shape.rank == 0:
            raise ValueError(f"reducescatter: tensor {n} is a scalar; its rows are scattered, "
                             f"so give tensors of rank >= 1 (tf.reshape(x, [1]))")
    if not tensors:
        return []
    found, place = cluster(), device()

    def build(tensors):
        dtypes = [t.dtype for t in tensors]
        # An integer mean is Horovod's: the sum, scaled by postscale / size in float64.
        integer_mean = op == Average and not any(d.is_floating for d in dtypes)
        with tf.device(place):
            tensors = [widen(scale(t, prescale_factor)) for t in tensors]
            # Compressed, a mean is formed of means: each process scales by
            # 1/size before the cast (Horovod's prescale), the wire only sums.
            prescale = op == Average and compression.compresses and not integer_mean
            if prescale:
                tensors = [scale_by_reciprocal(t, found.num_workers) for t in tensors]
            wire, contexts = zip(*[compression.compress(t) for t in tensors])
            out = reduce_scatter([list(wire)], [place], cluster=found,
                                 average=op == Average and not prescale and not integer_mean)[0]
            out = [narrow(compression.decompress(t, ctx), d)
                   for t, ctx, d in zip(out, contexts, dtypes)]
            post = postscale_factor / found.num_workers if integer_mean else postscale_factor
            out = [scale(t, post) for t in out]
        return out

    def gradient(upstream):
        # Horovod's: every process's rows, joined, scaled as the forward was
        # (times size after a sum, as Horovod's rule has it).
        factor = prescale_factor * postscale_factor * (found.num_workers if op != Average else 1)
        return grouped_allgather([scale(g, factor) for g in upstream])

    def forward(tensors):
        if session_graph():
            return in_session(forward, tensors, [result_spec(t, rows_vary=True) for t in tensors])
        return run_cached(("reducescatter", op, compression.name, prescale_factor,
                           postscale_factor), build, tensors,
                          mpi=None if compression.compresses else over_mpi)

    def over_mpi(mpi, tensors):  # build's steps, the sums over MPI (mpi_calls)
        with tf.device(place):
            out = mpi_calls.reduce_scatter(mpi, [scale(t, prescale_factor) for t in tensors],
                                           op, found.num_workers)
            return [scale(t, postscale_factor / found.num_workers
                          if op == Average and not t.dtype.is_floating else postscale_factor)
                    for t in out]

    return differentiable(forward, gradient, tensors)


@tf.autograph.experimental.do_not_convert
@one_call("reducescatter")
def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce-scatters one tensor: ``grouped_reducescatter([tensor], ...)[0]``.

    Raises:
      As grouped_reducescatter.
    """
    del name, ignore_name_scope
    return grouped_reducescatter([tensor], device_dense, compression, op, process_set,
                                 prescale_factor, postscale_factor)[0]


def _static_splits(splits, size):
    # Horovod's splits (a list, array or tensor of ints in rank order) as
    # Python ints, which tfreduce's all-to-all takes.
    if splits is None:
        return None
    value = tf.get_static_value(splits) if tf.is_tensor(splits) else np.asarray(splits)
    if value is None:
        raise ValueError("alltoall: splits must be known when the graph is built (a list or a "
                         "constant), got a tensor whose value is known only when it runs")
    value = np.asarray(value)
    if value.shape != (size,) or value.dtype.kind not in "iu":
        raise ValueError(f"alltoall: splits must be {size} ints (the rows sent to each "
                         f"process, in rank order), got {value.tolist()!r}")
    return [int(v) for v in value]


def _check_even(rows, found, first=0):
    """Raises SplitsError naming the processes (from rank `first`) whose rows do not divide evenly."""
    size = found.num_workers
    uneven = [f"{found.describe(first + r)} has {n}" for r, n in enumerate(rows) if n % size]
    if uneven:
        raise SplitsError(f"alltoall without splits sends each of the {size} processes the "
                          f"same number of rows, so each process's rows must be a multiple "
                          f"of {size}: {', '.join(uneven)} (give splits=)")


def _checked_splits(tensor, splits, found):
    """alltoall's splits as Python ints (None without), checked against the tensor's rows."""
    if tensor.shape.rank == 0:
        raise ValueError("alltoall: the tensor is a scalar; send tensors of rank >= 1, whose "
                         "rows are split (tf.reshape(x, [1]))")
    counts = _static_splits(splits, found.num_workers)
    rows = tensor.shape[0] if tensor.shape.rank else None
    if counts is not None and rows is not None and sum(counts) != rows:
        raise ValueError(f"alltoall: splits {counts} add up to {sum(counts)}, but the tensor "
                         f"has {rows} rows")
    if counts is None and rows is not None and not tf.executing_eagerly():
        _check_even([rows], found, found.rank)  # eagerly, every process's rows are checked
    return counts


def _alltoall_in_session(tensor, splits, name):
    # The splits may become known only when the session runs the call
    # (eagerly, where they are checked); so do the received splits, which
    # the gradient sends back (evenly split rows may come back unevenly).
    received = []

    def exchange(tensors):
        out, got = _alltoall(tensors[0], None if len(tensors) == 1 else tensors[1], name)
        return [out, tf.constant(got, tf.int32) if isinstance(got, list) else got]

    def forward(tensors):
        given = [] if splits is None else [tf.convert_to_tensor(splits)]
        out = in_session(exchange, [tensors[0]] + given,
                         [result_spec(tensors[0], rows_vary=True),
                          tf.TensorSpec([cluster().num_workers], tf.int32)])
        received[:] = out[1:]
        return out[:1]

    def backward(upstream):
        return [alltoall(upstream[0], splits=received[0])[0]]

    return differentiable(forward, backward, [tensor])[0], received[0]


@tf.autograph.experimental.do_not_convert
@one_call("alltoall")
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Sends rows of a tensor to every process and joins what each receives, in rank order.

    Without ``splits`` each process's rows are split evenly, as Horovod
    does: each process's rows must be a multiple of the processes. With
    B % size ranks get one more). Example, 2 processes, ``splits`` [1, 2]
    on rank 0 and [0, 1] on rank 1::

        rank 0: [[a], [b], [c]]  ->  [[a]]               received splits [1, 0]
        rank 1: [[d]]            ->  [[b], [c], [d]]     received splits [2, 1]

    Args:
      tensor: tf.Tensor of rank >= 1; processes may differ in axis 0.
      splits: None, or ints (list, array or constant tensor) in rank order:
        the rows this process sends to each, adding up to its rows.
      name: accepted for Horovod's signature.
      ignore_name_scope: accepted for Horovod's signature.
      process_set: global_process_set (the only one).

    Returns:
      the received rows, on this process's device; with ``splits``, also
      an int32 tensor of the rows received from each process (Horovod's
      ``(output, received_splits)``).

    Raises:
      RuntimeError: init() was not called.
      ValueError: splits of the wrong length, that do not add up to the
        rows, or (in a tf.function) not known when it traces; a scalar; an
        unsupported process set.
      SplitsError: without splits, a rank's rows are not a multiple of the
        ranks (raised on every rank).
    """
    del ignore_name_scope
    check_process_set(process_set, "alltoall")
    out, received = _alltoall(tensor, splits, name)
    return out if splits is None else (out, received)


def _over_mpi(place, send, receive, splits=False):
    """alltoall's exchange over the MPI transport (``run_cached``'s mpi=): the rows, and with
    `splits` the received splits."""
    def exchange(mpi, tensors):
        with tf.device(place):
            out = [mpi_calls.alltoall(mpi, tensors[0], send, receive)]
            return out + [tf.constant(receive, tf.int32, name="received_splits")] if splits else out
    return exchange


def _alltoall(tensor, splits, name):
    """alltoall's (output, received splits): an int32 tensor, a list of ints, or None (in a
    tf.function without splits)."""
    tensor = tf.convert_to_tensor(tensor)
    check_dtypes([tensor], "alltoall")
    if session_graph():
        return _alltoall_in_session(tensor, splits, name)
    found, place = cluster(), device()
    counts = _checked_splits(tensor, splits, found)

    def build(tensors, received=None):
        # received: the rows from each process, when known (eagerly).
        with tf.device(place):
            out = all_to_all([[widen(t) for t in tensors]], [place],
                             splits=None if counts is None else [counts], cluster=found)[0]
            out = [narrow(t, tensor.dtype) for t in out]
            if counts is None:
                return out
            if received is None:
                sent = tf.constant([counts], tf.int32)
                every = all_gather([[sent]], [place], cluster=found)[0][0]  # [size, size]
                return out + [tf.identity(every[:, found.rank], name="received_splits")]
            return out + [tf.constant(received, tf.int32, name="received_splits")]

    received = []  # the rows from each process (their splits to this one)

    def exchange(tensors):
        if not tf.executing_eagerly():
            out = build(tensors)
            received[:] = [out[1]] if counts is not None else []
            return out[:1]
        # Each process chooses its own splits (or rows): they are gathered
        # with the check that every process makes this call, and each
        # pattern gets its own function, whose collectives then have one
        # shape on every process whenever they run.
        own = counts if counts is not None else [int(tensor.shape[0])]
        every = agree(("alltoall", "splits" if counts is not None else "even"), tensors,
                      rows_vary=True, name=name, values=own)
        if counts is None:
            _check_even([row[0] for row in every], found)
            received[:] = [[row[0] // found.num_workers for row in every]]
            even = [every[found.rank][0] // found.num_workers] * found.num_workers
            return run_cached(("alltoall", every), build, tensors, rows_vary=True, check=False,
                              mpi=_over_mpi(place, even, received[0]))
        received[:] = [[row[found.rank] for row in every]]
        out = run_cached(("alltoall", every), lambda t: build(t, received[0]), tensors,
                         rows_vary=True, check=False,
                         mpi=_over_mpi(place, counts, received[0], splits=True))
        received[:] = out[1:]
        return out[:1]

    def gradient(upstream):
        # Horovod's: the upstream rows sent back to where they came from
        # (evenly split, they come back evenly too).
        if not received:
            return [alltoall(upstream[0])]
        return [alltoall(upstream[0], splits=received[0])[0]]

    out = differentiable(exchange, gradient, [tensor])[0]
    return out, received[0] if received else None
