"""The Horovod calls' data over the MPI transport: NumPy in, one MPI collective, tensors out.

When the cluster has an ``MpiTransport`` (``Cluster(transport="mpi")``, or
``hvd.init()`` under mpirun with mpi4py), an eager call, once the processes
agreed on it (over MPI too, ``consistency.check_same_call``), moves its
bytes here instead of through a traced TF collective
(``calls.run_cached(..., mpi=)``). Each function takes and returns eager
tensors (on the CPU; a process's tensors are one row of the size x 1
K x N list). Results equal the gRPC path's: the same
widening of narrow dtypes, the mean as ``sum * (1 / size)`` in the sum's
dtype, Horovod's integer mean left to ``wire.finish_mean``.

Fusion (Horovod's tensor fusion): the dense tensors of one grouped
all-reduce cross as one buffer per dtype, of at most
``HOROVOD_FUSION_THRESHOLD`` bytes (default 64 MiB, Horovod's; 0: each
tensor alone), in their order.

Compressed calls and ``tf.IndexedSlices`` keep TF's path (the processes
still run it, after the same agreement). Inside a traced function the
dense all-reduces and broadcasts go over MPI too, each one op
(``py_function``: the step's thread waits in MPI, about 5x faster than
TF's gRPC collective on one host), and every collective call of the graph
runs after the one built before it (``in_graph_order``).

Sources: Horovod's tensor fusion (docs/tensor-fusion.rst: buffers of one
dtype up to the threshold, filled in order); its MPI operations
(horovod/common/ops/mpi_operations.cc).
"""

import math
import os
import weakref

import numpy as np
import tensorflow as tf
# Private but stable since TF 2.2: what tf.experimental.dlpack.from_dlpack calls, after it
# looks the eager context up (once per tensor; here once per fused buffer).
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context

from tfreduce.basis.contract import shard_sizes
from tfreduce.workers.mpi_transport import ALIGNMENT, empty

__all__ = ["DLPACK", "FUSION_ENV", "allgather", "allreduce", "alltoall", "assign_broadcast",
           "broadcast", "fused_layout", "fusion_threshold", "in_graph_order", "py_function",
           "reduce_scatter", "signature"]

#: Horovod's variable: the most bytes one fused buffer holds (0: no fusion).
FUSION_ENV = "HOROVOD_FUSION_THRESHOLD"
_DEFAULT_FUSION = 64 * 2 ** 20


# graph -> the op the next collective call built in it runs after (the MPI transport's).
_LAST_IN_GRAPH = weakref.WeakKeyDictionary()


def in_graph_order(build, tensors):
    """build(tensors) in a graph, after the previous call built there; it is the previous one next."""
    graph = tf.compat.v1.get_default_graph()
    last = _LAST_IN_GRAPH.get(graph)
    with tf.control_dependencies([last] if last is not None else []):
        out = build(tensors)
        _LAST_IN_GRAPH[graph] = tf.group([t for t in tf.nest.flatten(out, expand_composites=True)
                                          if t is not None])
    return out


def py_function(call, tensors):
    """call(*eager tensors) as one op of a graph whose results have the inputs' specs."""
    out = tf.py_function(call, tensors, [t.dtype for t in tensors], name="mpi_transport")
    out = out if isinstance(out, list) else [out]
    for t, like in zip(out, tensors):
        t.set_shape(like.shape)
    return out


def fusion_threshold():
    """int bytes: HOROVOD_FUSION_THRESHOLD, else 64 MiB.

    Raises:
      ValueError: the variable is not a number of bytes >= 0.
    """
    text = os.environ.get(FUSION_ENV, "").strip()
    if not text:
        return _DEFAULT_FUSION
    if not text.isdigit():
        raise ValueError(f"{FUSION_ENV}={text!r}: give a number of bytes >= 0 (0: no fusion)")
    return int(text)


def _fused(sizes, threshold):
    """Runs of consecutive indices whose sizes (bytes) add up to at most threshold (one at least)."""
    runs, run, total = [], [], 0
    for n, size in enumerate(sizes):
        if run and (threshold == 0 or total + size > threshold):
            runs.append(run)
            run, total = [], 0
        run.append(n)
        total += size
    return runs + [run] if run else runs


def _tensor(array, dtype):
    """A transport's result as a tf.Tensor of `dtype`: its memory, without a copy (DLPack),
    where it is aligned and DLPack carries the dtype; else a copy."""
    if array.size and array.ctypes.data % ALIGNMENT == 0 and dtype in DLPACK:
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array, dtype=dtype)


#: The dtypes TF takes over DLPack (bfloat16 is NumPy's only through ml_dtypes, which has none).
DLPACK = frozenset((tf.float16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int16, tf.uint16,
                     tf.int32, tf.int64, tf.bool))


def _array(tensor):
    """A dense eager tensor's values as a NumPy array, without a copy (its memory, on the CPU)."""
    return np.asarray(tensor)


def allreduce(mpi, tensors, op, size, layout=None):
    """N dense eager tensors reduced over the processes, fused per dtype: N tensors.

    A fused run is copied into one buffer (each tensor at an offset aligned
    to ``ALIGNMENT`` bytes, zeros between) and each result is a tensor over
    its own part of the reduced buffer, without a copy: no TF op runs per
    tensor. A tensor alone crosses from and into its own memory.

    Args:
      mpi: the MpiTransport.
      tensors: list of N dense eager tf.Tensor, one signature on every process.
      op: "sum", "average", "min", "max" or "product". A float mean is the
        sum times (1 / size), in the sum's dtype; an integer mean is the sum
        (the caller finishes it: ``wire.finish_mean``).
      size: int W, the processes.
      layout: None, or ``fused_layout`` of the tensors' signature (kept by
        the caller); None: looked up.

    Returns:
      list of N tf.Tensor, the inputs' shapes and dtypes, on the CPU.
    """
    merge = "sum" if op == "average" else op
    out = [None] * len(tensors)
    if layout is None:
        layout = fused_layout(signature(tensors), fusion_threshold())
    for dtype, total, members, fills in layout:
        scale = 1.0 / size if op == "average" and dtype.is_floating else None
        if total is None:  # MPI reads the tensor's own memory
            n = members[0][0]
            out[n] = _tensor(mpi.allreduce(_array(tensors[n]), merge, scale), dtype)
            continue
        flat = empty(total, dtype.as_numpy_dtype)
        np.concatenate([_array(tensors[f]) if type(f) is int else f for f in fills], axis=None,
                       out=flat)
        reduced = mpi.allreduce(flat, merge, scale)
        # Each member starts aligned (fused_layout): one check for the buffer, not one each.
        direct = reduced.ctypes.data % ALIGNMENT == 0 and dtype in DLPACK
        # tf.experimental.dlpack.from_dlpack's own call, its context looked up once per run.
        handle = context.context()._handle
        for n, start, end, shape in members:
            part = reduced[start:end].reshape(shape)
            out[n] = (pywrap_tfe.TFE_FromDlpackCapsule(part.__dlpack__(), handle)
                      if direct and end > start else _tensor(part, dtype))
    return out


def signature(tensors):
    """What a list of eager tensors' layout is kept by: (dtype enum, shape tuple) of each."""
    # EagerTensor's own accessors: a third of the cost of t.dtype and t.shape.
    return tuple((t._datatype_enum(), t._shape_tuple()) for t in tensors)


# (signature, threshold) -> the fused runs of allreduce; bounded (signatures seldom vary).
_LAYOUTS = {}
_MOST_LAYOUTS = 256


def fused_layout(signature, threshold):
    """How allreduce moves tensors of `signature` (``signature(tensors)``): a list of runs.

    Each run is (tf.DType, elements of its buffer or None for a tensor
    alone, members, fills): members a list of (index, first element, end
    element, shape tuple); fills the buffer's contents in order, each a
    tensor's index or an array of zeros (the padding to the next aligned
    offset). The dtypes come in first-seen order (one on every process),
    the runs of a dtype in the tensors' order, at most `threshold` bytes
    each."""
    key = (signature, threshold)
    runs = _LAYOUTS.get(key)
    if runs is not None:
        return runs
    runs, dtypes = [], [tf.as_dtype(enum) for enum, _ in signature]
    for dtype in dict.fromkeys(dtypes):
        picked = [n for n, d in enumerate(dtypes) if d == dtype]
        counts = [math.prod(signature[n][1]) for n in picked]
        per_element = max(1, ALIGNMENT // dtype.size)
        for run in _fused([c * dtype.size for c in counts], threshold):
            if len(run) == 1:
                runs.append((dtype, None, [(picked[run[0]], 0, counts[run[0]], None)], []))
                continue
            members, fills, start = [], [], 0
            for i in run:
                end = start + counts[i]
                members.append((picked[i], start, end, tuple(signature[picked[i]][1])))
                fills.append(picked[i])
                start = -(-end // per_element) * per_element  # the next aligned element
                if start > end:
                    fills.append(np.zeros(start - end, dtype.as_numpy_dtype))
            runs.append((dtype, start, members, fills))
    if len(_LAYOUTS) >= _MOST_LAYOUTS:
        _LAYOUTS.clear()
    _LAYOUTS[key] = runs
    return runs


def allgather(mpi, tensors, counts):
    """Each tensor's rows from every process joined in rank order; counts[r][n]: process r's rows."""
    return [_tensor(mpi.allgather(_array(t), [row[n] for row in counts]), t.dtype)
            for n, t in enumerate(tensors)]


def broadcast(mpi, tensors, root):
    """The root's tensors on every process."""
    return [_tensor(mpi.broadcast(_array(t), root), t.dtype) for t in tensors]


def assign_broadcast(mpi, variables, root):
    """Assigns the root's values to `variables` (their bytes in one buffer)."""
    values = [np.asarray(v.numpy()) for v in variables]
    flat = np.concatenate([a.reshape(-1).view(np.uint8) for a in values]) if values else None
    if flat is None:
        return
    flat = mpi.broadcast(flat, root)
    offsets = np.cumsum([0] + [a.nbytes for a in values])
    for v, a, start, end in zip(variables, values, offsets[:-1], offsets[1:]):
        v.assign(flat[start:end].view(a.dtype).reshape(a.shape))


def reduce_scatter(mpi, tensors, op, size):
    """This process's rows of each tensor's reduction (rows split by ``shard_sizes``).

    op as allreduce's ("sum" or "average": a float mean is scaled by 1 / size)."""
    out = []
    for t in tensors:
        counts = shard_sizes(int(t.shape[0]), size)
        mean = op == "average" and t.dtype.is_floating
        out.append(_tensor(mpi.reduce_scatter(_array(t), counts, "sum",
                                              scale=1.0 / size if mean else None), t.dtype))
    return out


def alltoall(mpi, tensor, send_counts, receive_counts):
    """Rows send_counts[r] of tensor to process r; the rows received, joined in rank order."""
    return _tensor(mpi.alltoall(_array(tensor), send_counts, receive_counts), tensor.dtype)
