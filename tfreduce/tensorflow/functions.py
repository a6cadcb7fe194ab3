"""Horovod's helper functions over the collectives: objects, in-place broadcast, rank ops.

Built on ``tfreduce.tensorflow.ops`` (one engine): an object crosses as the
bytes of its pickle (a uint8 tensor, widened on the wire), a variable list
by ``broadcast_variables``.

Sources: Horovod's API (horovod.tensorflow.functions: allgather_object,
broadcast_object; horovod.tensorflow.mpi_ops: broadcast_, join, rank_op, size_op,
local_rank_op, local_size_op; broadcast_global_variables of TF1 graphs).
"""

import pickle

import numpy as np
import tensorflow as tf

from tfreduce.tensorflow.calls import in_session, one_call, session_graph, wait_in_join
from tfreduce.tensorflow.ops import allgather, broadcast, broadcast_variables, grouped_allreduce
from tfreduce.tensorflow.process import local_rank, local_size, rank, size
from tfreduce.tensorflow.reduce_ops import check_process_set, global_process_set

__all__ = ["allgather_object", "broadcast_object", "broadcast_", "broadcast_global_variables",
           "join", "rank_op", "local_rank_op", "size_op", "local_size_op"]


def _as_bytes(obj):
    return tf.constant(np.frombuffer(pickle.dumps(obj), np.uint8))


@one_call("broadcast")
def broadcast_object(obj, root_rank=0, session=None, name=None,
                     process_set=global_process_set):
    """root_rank's Python object on every process (pickled; call it on every process).

    Args:
      obj: any picklable object (only root_rank's is used).
      root_rank: int in 0..size-1.
      session: in a tf.compat.v1 graph, the session that runs the exchange
        (None: the default session); eagerly, unused.
      name: accepted for Horovod's signature.
      process_set: global_process_set (the only one).

    Returns:
      root_rank's object, unpickled.

    Raises:
      ValueError: a bad root_rank or process set; in a tf.compat.v1 graph,
        no session and no default session.
      RuntimeError: called inside a tf.function.
    """
    del name
    run = _runner(session, "broadcast_object")
    check_process_set(process_set, "broadcast_object")
    data = _as_bytes(obj) if rank() == root_rank else tf.zeros([0], tf.uint8)
    length = run(broadcast(tf.constant([int(data.shape[0])], tf.int64), root_rank))
    if rank() != root_rank:
        data = tf.zeros([int(length[0])], tf.uint8)
    return pickle.loads(run(broadcast(data, root_rank)).tobytes())


@one_call("allgather")
def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every process's Python object, in rank order (pickled; call it on every process).

    Returns:
      list of size() objects; item r is rank r's.

    Raises:
      ValueError: an unsupported process set; in a tf.compat.v1 graph, no
        session and no default session.
      RuntimeError: called inside a tf.function.
    """
    del name
    run = _runner(session, "allgather_object")
    check_process_set(process_set, "allgather_object")
    data = _as_bytes(obj)
    lengths = run(allgather(tf.constant([int(data.shape[0])], tf.int64)))
    joined = run(allgather(data)).tobytes()
    ends = np.cumsum(lengths)
    return [pickle.loads(joined[end - length:end]) for end, length in zip(ends, lengths)]


def _runner(session, where):
    """A function tensor -> NumPy value: eagerly its value, in a TF1 graph the session's run.

    Checked before anything is built: a process that built half of the
    exchange in a tf.function would draw collective keys its peers do not."""
    if tf.executing_eagerly():
        return lambda t: t.numpy()
    if tf.inside_function():
        raise RuntimeError(f"{where} runs eagerly or in a tf.compat.v1 session (a Python "
                           "object crosses as its pickle): call it outside tf.function")
    session = session or tf.compat.v1.get_default_session()
    if session is None:
        raise ValueError(f"{where}: in a tf.compat.v1 graph, pass session= or call it under "
                         "a default session (with session.as_default())")
    return session.run


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Assigns root_rank's values to the variables in place; returns the variables.

    In a tf.compat.v1 graph of several processes, returns the assignments'
    values instead (running one in a session broadcasts and assigns).

    Raises:
      As ``broadcast_variables``.
    """
    del name
    assigned = broadcast_variables(variables, root_rank, process_set=process_set)
    return assigned if session_graph() else variables


def broadcast_global_variables(root_rank):
    """Broadcasts a TF1 graph's global variables from root_rank (``tf.compat.v1`` graphs only).

    Returns:
      the op that assigns them (run it on every process).

    Raises:
      RuntimeError: in eager mode (TF2 has no global variables).
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables works in tf.compat.v1 graphs only: in TF2 call "
            "broadcast_variables(model.variables, root_rank) (and the optimizer's variables)")
    return tf.group(*(broadcast_variables(tf.compat.v1.global_variables(), root_rank) or []))


def join():
    """Horovod's join(): this process's data has ended; the others' all-reduces go on without it.

    Until every process has called join(), this one takes part in each
    all-reduce the others make, with zeros of its shapes and dtypes: a Sum
    is the others' sum, an Average their sum divided by size() (as in
    Horovod). Then every process's join() returns. Example, 2 processes
    with 3 and 2 batches: rank 1 calls join() after its 2nd step, rank 0
    makes its 3rd all-reduce alone (rank 1's join() adds zeros), then calls
    join(); both return 0, the rank that joined last.

    Horovod's limits hold: while a process waits here, the others may only
    all-reduce dense tensors with op Sum or Average. It pairs eager calls
    (a custom loop's ``DistributedGradientTape`` outside ``tf.function``)
    and TF1 session calls; a collective traced in a ``tf.function`` is not
    seen by join().

    Returns:
      int32 scalar tensor, the rank of the process that joined last (the
      highest such rank when several joined in the same round). In a
      tf.compat.v1 graph of several processes, an op that returns it.

    Raises:
      CallMismatchError: on every process, when a process still working
        makes another kind of call (an allgather, a broadcast, a Min) while
        others wait in join().
      RuntimeError: inside a tf.function.
    """
    if session_graph():
        return in_session(lambda _: [join()], [], [tf.TensorSpec([], tf.int32)])[0]
    if not tf.executing_eagerly():
        raise RuntimeError("join() runs eagerly (or in a tf.compat.v1 session): inside a "
                           "tf.function the collectives are traced, and a process waiting in "
                           "join() cannot make them; call it after the tf.function returns")
    return tf.constant(wait_in_join(_allreduce_zeros), tf.int32)


def _allreduce_zeros(recipe):
    """The all-reduce another process made (recipe from ops), with zeros."""
    op, compression, prescale_factor, postscale_factor, name, specs = pickle.loads(recipe)
    grouped_allreduce([tf.zeros(shape, dtype) for shape, dtype in specs], op=op,
                      compression=compression, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor, name=name)


def rank_op(name=None):
    """int32 scalar tensor, this process's rank."""
    return tf.constant(rank(), tf.int32, name=name)


def local_rank_op(name=None):
    """int32 scalar tensor, this process's rank on its machine."""
    return tf.constant(local_rank(), tf.int32, name=name)


def size_op(process_set_id=0, name=None):
    """int32 scalar tensor, the number of processes.

    Raises:
      ValueError: a process_set_id other than 0 (the global set, the only one).
    """
    if process_set_id != 0:
        raise ValueError(f"size_op: process_set_id={process_set_id!r}: only 0 (every "
                         "process) is supported")
    return tf.constant(size(), tf.int32, name=name)


def local_size_op(name=None):
    """int32 scalar tensor, the number of processes on this process's machine."""
    return tf.constant(local_size(), tf.int32, name=name)
