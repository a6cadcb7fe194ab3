"""Eager all-reduces on the MPI transport, prepared once per call signature.

A Horovod script makes the same eager ``allreduce`` / ``grouped_allreduce``
step after step (its metrics, its gradients in a custom loop). Over MPI
the data of 64 tensors of 4 KiB crosses in about 0.1 ms, while the general
path (``ops.grouped_allreduce``) checks the call, describes it, lays out
its fused buffer and finishes each result every time, about ten times
that. Here the call is looked up by its settings, its process count and
its inputs' dtypes and shapes; what follows from them is kept
(``_Prepared``: the checks passed, the description the processes compare,
the fused layout, the join recipe), and each call does only the
agreement (``calls.agree``: a call that differs on any process still
raises on every process, the watchdog still names a frozen one) and the
data's fused MPI all-reduce (``mpi_calls.allreduce``).

Taken when the call runs eagerly on the MPI transport with no gradient
tape watching, every input is an eager dense tensor of a dtype DLPack
carries, the op is Sum (or Average of floats), without compression and
with scale factors of 1. Any other call takes the general path, whose
results these equal bit for bit (the same MPI sums, the same 1 / size).

Sources: Horovod's response cache (horovod/common/response_cache.cc: a
call seen before skips the coordinator's full negotiation) and tensor
fusion (docs/tensor-fusion.rst).
"""

import pickle

import tensorflow as tf
# Private but long-standing: whether any GradientTape (or forward accumulator) watches;
# the class of eager tensors, whose own accessors (_datatype_enum, _shape_tuple) cost a
# third of t.dtype and t.shape.
from tensorflow.python.eager import record
from tensorflow.python.framework.ops import EagerTensor

from tfreduce.buffers.compression import as_compressor
from tfreduce.tensorflow import mpi_calls
from tfreduce.tensorflow.calls import run_cached
from tfreduce.tensorflow.process import cluster, eager_functions, is_initialized
from tfreduce.tensorflow.reduce_ops import Average, Sum, check_op, check_process_set
from tfreduce.tensorflow.signatures import describe_call
from tfreduce.tensorflow.wire import check_dtypes

__all__ = ["allreduce", "allreduce_recipe"]

# The key of the run's eager_functions() under which the prepared calls are kept.
_PREPARED = "prepared_allreduces"
# At most this many signatures are kept (a program whose shapes vary call by call).
_MOST_PREPARED = 1024


def allreduce_recipe(op, compression_name, prescale_factor, postscale_factor, name, tensors):
    """How a process waiting in join() makes this all-reduce with zeros: a function () -> bytes.

    Args:
      op: Sum or Average; compression_name: str; the factors: floats;
      name: str or None; tensors: the call's dense tensors (their shapes
        and dtypes are kept, not the tensors).
    """
    inputs = [(t.shape.as_list(), t.dtype.name) for t in tensors]
    return lambda: pickle.dumps((op, compression_name, prescale_factor, postscale_factor, name,
                                 inputs))


class _Prepared:
    """What a call of one signature needs each time: its key, description, recipe and layout."""

    def __init__(self, op, compression_name, factors, name, tensors, size, layout):
        # The general path's key and description, factors as given (1 and 1.0 read apart).
        self.key = ("allreduce", op, compression_name) + factors
        self.name = name
        self.description = describe_call(self.key, tensors, False, name)
        self.recipe = allreduce_recipe(op, compression_name, *factors, name, tensors)
        self.run = lambda mpi, given: mpi_calls.allreduce(mpi, given, op, size, layout)


def allreduce(tensors, average, compression, op, prescale_factor, postscale_factor, process_set,
              name, where):
    """The call's results when it can take the prepared path; else None (take the general one).

    Args:
      tensors: the call's inputs as given (a list or tuple).
      average, compression, op, prescale_factor, postscale_factor,
        process_set, name: the call's arguments, as ``ops.grouped_allreduce``'s.
      where: str, the public function ("allreduce" or "grouped_allreduce").

    Returns:
      list of N tf.Tensor on the CPU, the inputs' shapes and dtypes; or None.

    Raises:
      As ``ops.grouped_allreduce`` after its checks: CallMismatchError,
      WorkerLostError, tf.errors.UnavailableError (the watchdog's message).
      A call whose own checks fail is never prepared: the general path raises.
    """
    if (not tf.executing_eagerly() or record.could_possibly_record() or not is_initialized()
            or not isinstance(tensors, (list, tuple))
            or not all(type(t) is EagerTensor for t in tensors)):
        return None
    found = cluster()
    if getattr(found, "mpi", None) is None:
        return None
    try:
        threshold, signature = mpi_calls.fusion_threshold(), mpi_calls.signature(tensors)
        key = (average, compression, op, prescale_factor, postscale_factor, process_set, name,
               found.num_workers, threshold, signature)
        kept = eager_functions().setdefault(_PREPARED, {})
        prepared = kept.get(key)
    except (TypeError, ValueError):  # an argument that is not hashable; a bad threshold
        return None
    if prepared is None:
        prepared = _prepare(tensors, average, compression, op, prescale_factor,
                            postscale_factor, process_set, name, where, found.num_workers,
                            mpi_calls.fused_layout(signature, threshold))
        if prepared is None:
            return None
        if len(kept) >= _MOST_PREPARED:
            kept.clear()
        kept[key] = prepared
    if prepared is False:
        return None
    return run_cached(prepared.key, None, tensors, name=prepared.name, recipe=prepared.recipe,
                      mpi=prepared.run, same_specs=True, description=prepared.description)


def _prepare(tensors, average, compression, op, prescale_factor, postscale_factor, process_set,
             name, where, size, layout):
    """A _Prepared for the call; False: it takes the general path always; None: its checks
    fail (the general path raises their error, after its agreement)."""
    try:
        op = check_op(op, average, where)
        check_process_set(process_set, where)
        check_dtypes(tensors, where)
        compression = as_compressor(compression)
    except Exception:  # noqa: BLE001 - the general path raises it, after its agreement
        return None
    if (not tensors or op not in (Sum, Average) or compression.compresses
            or prescale_factor != 1.0 or postscale_factor != 1.0
            or any(t.dtype not in mpi_calls.DLPACK or t.dtype == tf.bool
                   or (op == Average and not t.dtype.is_floating) for t in tensors)):
        return False
    return _Prepared(op, compression.name, (prescale_factor, postscale_factor), name, tensors,
                     size, layout)
