"""How a Horovod-style call runs eagerly and differentiates: one traced function per signature.

Eagerly, each collective call runs inside a ``tf.function`` kept per
(what it does, its input signature), so that a call like an earlier one
reuses its function and its instance keys, as a training step does.
Each collective has Horovod's gradient rule (``differentiable``). Every
public call takes part in the processes' agreement (``one_call``), even
one that fails its own checks on one process, so no later call can pair
with another process's.

In a ``tf.compat.v1`` graph of a run of several processes, a call becomes
a ``tf.py_function`` that makes the same call eagerly when the session
runs it (``in_session``): the user's session, local to its process, never
sees the other processes, but the eager context it calls into does.

Sources: Horovod's API (horovod.tensorflow.mpi_ops: the gradients
registered for each collective; its TF1 graph mode, where each collective
is an op run by the user's session).
"""

import contextlib
import functools
import os
import sys
import threading

import keras
import tensorflow as tf
# Private but long-standing: whether any GradientTape (or forward accumulator) watches.
from tensorflow.python.eager import record
# Private but long-standing: whether the graph being built is compiled by XLA (TF's own test).
from tensorflow.python.ops import control_flow_util

import tfreduce

from tfreduce.blocks.collective import CollectiveKeys
from tfreduce.tensorflow import mpi_calls
from tfreduce.tensorflow.process import cluster, eager_functions, is_initialized
from tfreduce.tensorflow.signatures import describe_call, input_spec
from tfreduce.workers.consistency import CallMismatchError, check_same_call, join_round
from tfreduce.workers.failures import WorkerLostError
from tfreduce.workers.progress import IN_JOIN, progress

__all__ = ["agree", "differentiable", "in_session", "one_call", "result_spec", "run_cached",
           "session_graph", "tensor_or_slices", "wait_in_join"]


def one_call(kind):
    """Makes a public collective take part in the agreement even when its own checks fail.

    Eagerly, in a run of several processes, an error that the call raises
    before its first agreement (``agree``: bad splits, a root rank out of
    range, a scalar to gather, an unknown op) is first agreed as a failed
    `kind` call (``consistency.check_same_call`` with ``failed=``), then
    raised: where the others make the same collective, all raise; where
    they make another, theirs pairs with this process's next call. Without
    it a call that fails on one process alone would shift the pairing of
    every call after it (a silent wrong sum). Which call a failed one
    stands for is told by where the program made it (``call_site``).

    Args:
      kind: str, the collective as the calls' keys name it ("allreduce",
        "alltoall", ...).

    Returns:
      a decorator.
    """
    def wrap(function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            if not tf.executing_eagerly():
                refuse_xla(function.__name__)
            if _JOINED_CALL or not tf.executing_eagerly():
                return function(*args, **kwargs)
            state = [False]  # set by agree(): this call has taken part
            _CALLS.append(state)
            try:
                return function(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - any error of its own checks
                if (state[0] or isinstance(error, (CallMismatchError, WorkerLostError))
                        or not is_initialized() or cluster().is_local):
                    raise
                for outer in _CALLS:  # the calls this one is part of have taken part too
                    outer[0] = True
                # After the round, check_same_call raises `error` itself.
                with progress.within(f"{kind} (failed its own checks)"):
                    check_same_call(cluster(), _error_line(error), eager_functions(),
                                    kind=kind, failed=error, site=call_site())
            finally:
                _CALLS.pop()
        return call
    return wrap


def refuse_xla(name):
    """Raises ValueError when the graph being built is compiled by XLA (or inside one that is).

    XLA compiles a function for one device: a collective across processes
    (TF's over gRPC, or the MPI transport's py_function) has no XLA kernel
    on a CPU, and the step would fail at its first run, or not be ours.
    """
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(
            f"hvd.{name} inside an XLA-compiled function (tf.function(jit_compile=True), or "
            f"Keras' compile(jit_compile=True)): XLA cannot compile a collective across "
            f"processes. Compile the forward and backward pass only, a "
            f"tf.function(jit_compile=True) that returns the loss and the gradients, and make "
            f"the collective outside it (docs/horovod.md#xla); in Keras, pass "
            f"jit_compile=False to compile")


# The public calls in progress on this thread's eager path, innermost last.
_CALLS = []
# The libraries whose frames stand between a program and its collective call.
_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep for m in (tfreduce, tf, keras))


def call_site():
    """Where the program made the current collective call: its frames' "file:line", innermost first.

    The frames outside tfreduce, TensorFlow and Keras (a Keras optimizer's
    call is Keras's), so that a helper called from two places makes two
    sites; the same text on every process that runs the same program,
    whichever its rank."""
    frame, lines = sys._getframe(1), []
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_LIBRARIES):
            lines.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(lines)


def _error_line(error):
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def tensor_or_slices(tensor):
    """tensor as a tf.Tensor, or as it is if it is tf.IndexedSlices."""
    if isinstance(tensor, (tf.Tensor, tf.IndexedSlices)):
        return tensor
    return tf.convert_to_tensor(tensor)


def differentiable(forward, backward, tensors):
    """forward(tensors), whose gradient is backward(upstream gradients): a collective's rule.

    Horovod registers a gradient for each collective (an all-reduce's is the
    same all-reduce of the upstream gradients; an all-gather's, this
    process's rows of their mean; a broadcast's, their mean on the root and
    zeros elsewhere). IndexedSlices and tensors that are not floats have
    none: forward runs alone.

    Args:
      forward: function (list of N tensors) -> list of N tensors.
      backward: function (list of N upstream gradients) -> list of N
        gradients of the inputs.
      tensors: list of N tf.Tensor or tf.IndexedSlices.

    Returns:
      forward(tensors).
    """
    tensors = [tensor_or_slices(t) for t in tensors]
    if not tensors or any(isinstance(t, tf.IndexedSlices) or not t.dtype.is_floating
                          for t in tensors):
        return forward(tensors)
    if tf.executing_eagerly() and not record.could_possibly_record():
        return forward(tensors)  # no tape watches: nothing to record (a tenth of the eager call)

    @tf.custom_gradient
    def call(*inputs):
        # The tape must not look into the collectives (they have no gradient
        # of their own): the rule below stands for them.
        out = forward([tf.stop_gradient(t) for t in inputs])

        def gradient(*upstream):
            return backward([tf.zeros_like(o) if g is None else g
                             for o, g in zip(out, upstream)])

        return out, gradient

    return list(call(*tensors))


def agree(key, tensors, rows_vary=False, name=None, values=None, recipe=None,
          description=None):
    """Eagerly: raises CallMismatchError on every process unless all make this call.

    See ``consistency.check_same_call``; the call is described by its key,
    the user's name and its inputs' dtypes and shapes (rows as None where
    they may differ between processes). In a graph, nothing is checked.

    Args:
      key: tuple, what the call does (its first item the collective's name).
      tensors: list of tf.Tensor or tf.IndexedSlices, the call's inputs.
      rows_vary: bool, processes may differ in axis 0.
      name: str or None, the user's name for the call.
      values: None, or L ints this process chooses for itself (its row
        counts, its splits); L must follow from the key and the inputs.
      recipe: None, or a function () -> bytes from which a process waiting
        in join() makes the same call with zeros (``functions.join``);
        without one, this call raises on every process while one waits there.
      description: None, or the call's ``describe_call`` text, when the
        caller kept it (``prepared_calls``).

    Returns:
      Eagerly with `values`: tuple of tuples of int, row r worker r's values
      (the same on every process, to build the data's collectives from).
      Otherwise None.
    """
    if not tf.executing_eagerly():
        return None
    for state in _CALLS:  # every call in progress has taken part now
        state[0] = True
    functions = eager_functions()
    if description is None:
        description = describe_call(key, tensors, rows_vary, name)
    if _SESSION_OP:  # the TF1 op making this call: the same op on every process
        description += f" in op {_SESSION_OP[0]!r}"
    if _JOINED_CALL:  # made by join() for the others: already agreed
        every = None
    else:
        # A collective too: the cluster's timeout bounds its wait (tfreduce.workers.watchdog).
        with progress.within(description):
            every = check_same_call(cluster(), description, functions, values, recipe,
                                    site=call_site())
    functions[_LAST_CALL] = description
    number = functions.get(_AGREED, -1) + 1
    functions[_AGREED] = number
    # The keys of the functions this call traces (one block per call).
    functions[_CALL_KEYS] = CollectiveKeys(
        first_instance_key=_EAGER_KEYS + (number % _BLOCKS) * _KEYS_PER_CALL)
    return None if every is None else tuple(tuple(int(v) for v in row) for row in every)


# Eager calls trace their functions with keys of their own: a function first
# traced at agreed call n draws its instance keys from _EAGER_KEYS + n *
# _KEYS_PER_CALL (n counted alike on every process, by agree), so a process
# whose earlier traces drew more keys than its peers' (an error raised
# midway on one process, splits of its own) cannot shift any later call's
# keys. The block sits above the cluster's own counter (from 2**30 + 1) and
# below 2**31 (TF's keys are int32); after 2**21 calls the blocks come round.
_AGREED = "agreed_calls"
_LAST_CALL = "last_call"
_CALL_KEYS = "call_keys"
_EAGER_KEYS = 3 * 2 ** 29
_KEYS_PER_CALL = 256
_BLOCKS = 2 ** 21


@contextlib.contextmanager
def _keys_of_call(found, keys):
    """The cluster hands out `keys` (the last agreed call's) while a function traces."""
    if found.is_local or keys is None:
        yield
        return
    own = found.keys
    found.keys = keys
    try:
        yield
    finally:
        found.keys = own


def run_cached(key, build, tensors, rows_vary=False, name=None, check=True, recipe=None,
               mpi=None, same_specs=False, description=None):
    """build(tensors): directly in a graph; eagerly, in a tf.function kept per key and signature.

    The collectives' instance keys are drawn as a function traces, the same
    on every process when all make the same calls in the same order (as
    Horovod requires); a call like an earlier one reuses its function and
    keys, as a training step does, instead of tracing again. Eagerly, the
    processes first check that they all make this call
    (``consistency.check_same_call``: the key, the user's `name` and the
    input signature), so a mismatch raises on every process before any
    data moves.

    check=False leaves that to the caller (``agree``); `recipe` and `description` are agree's.
    `mpi`: None, or a function (MpiTransport, tensors) -> build's results:
    eagerly on a cluster with the MPI transport, it moves the data instead
    (``mpi_calls``); in a graph too, as a ``tf.py_function``, when
    `same_specs` (its results have the inputs' shapes and dtypes). In a
    graph on that transport each call runs after the one built before it
    (``mpi_calls.in_graph_order``): no two processes wait in another order.

    Raises:
      CallMismatchError: eagerly, the processes' calls differ (each one named).
    """
    if not tf.executing_eagerly():
        over = getattr(cluster(), "mpi", None)
        if over is None:
            return build(tensors)
        if mpi is None or not same_specs:
            return mpi_calls.in_graph_order(build, tensors)
        return mpi_calls.in_graph_order(
            lambda ts: mpi_calls.py_function(lambda *xs: mpi(over, list(xs)), ts), tensors)
    if check:
        agree(key, tensors, rows_vary, name, recipe=recipe, description=description)
    functions = eager_functions()
    over = getattr(cluster(), "mpi", None) if mpi is not None else None
    if over is not None:
        with progress.within(functions.get(_LAST_CALL, key[0])):
            return mpi(over, tensors)
    specs = [input_spec(t, rows_vary) for t in tensors]
    full = (key, tuple(specs))  # the functions by what they do and their input signature
    if full not in functions:
        functions[full] = tf.function(build, input_signature=[specs], autograph=False)
    # What this process's heartbeats tell the others (tfreduce.workers.watchdog).
    with _keys_of_call(cluster(), functions.get(_CALL_KEYS)), \
            progress.within(functions.get(_LAST_CALL, key[0])):
        return functions[full](tensors)


def session_graph():
    """bool: building a tf.compat.v1 graph (not eager, not a tf.function) with several processes."""
    return (not tf.executing_eagerly() and not tf.inside_function()
            and not cluster().is_local)


def result_spec(t, dtype=None, rows_vary=False):
    """The spec of a collective's result like t (a graph tensor or tf.IndexedSlices).

    Args:
      t: tf.Tensor or tf.IndexedSlices.
      dtype: the result's dtype (its values'), if not t's.
      rows_vary: the result's axis 0 is not t's (a gather, a scatter).

    Returns:
      tf.TensorSpec or tf.IndexedSlicesSpec.
    """
    if isinstance(t, tf.IndexedSlices):
        shape = tf.TensorShape([None]).concatenate(t.values.shape[1:])
        return tf.IndexedSlicesSpec(
            shape, dtype or t.values.dtype, t.indices.dtype,
            None if t.dense_shape is None else t.dense_shape.dtype, [None])
    shape = t.shape
    if rows_vary and shape.rank:
        shape = tf.TensorShape([None]).concatenate(shape[1:])
    return tf.TensorSpec(shape, dtype or t.dtype)


# One collective call at a time per process: a session runs independent ops
# side by side, and two calls in flight at once would draw keys in an order
# the other processes cannot know. The name of the op making the call is
# part of what the processes compare, so that two calls alike made by
# different ops (in another order on another process) raise instead of
# pairing one process's tensor with another's.
_SESSION_CALLS = threading.Lock()
_SESSION_OP = []


def wait_in_join(make):
    """Horovod's join(), eagerly: makes the others' calls with zeros until every process has joined.

    Each round, the processes still working make a call (``agree`` with a
    recipe) and this one receives its recipe, then ``make(recipe)`` makes
    the same call with zeros; the call counter and the instance keys advance
    alike on every process.

    Args:
      make: function (recipe bytes) -> anything, the call with zeros.

    Returns:
      int, the rank of the process that joined last (the highest on a tie;
      this one's on a single process).

    Raises:
      CallMismatchError: on every process, the others' call cannot go on
        without this one (see ``consistency.check_same_call``).
    """
    found, functions = cluster(), eager_functions()
    if found.is_local:
        return found.rank
    joined_at = functions.get(_AGREED, -1) + 1
    while True:
        with progress.within(IN_JOIN):
            recipe, last = join_round(found, functions, joined_at)
        if recipe is None:
            return last
        if not recipe:
            continue  # the others' call failed: nothing to make this round
        _JOINED_CALL.append(True)  # agreed already, in join_round
        try:
            make(recipe)
        finally:
            _JOINED_CALL.pop()


_JOINED_CALL = []


def in_session(call, tensors, outputs):
    """call(tensors) as one op of a tf.compat.v1 graph, made eagerly when a session runs it.

    The op is a ``tf.py_function``: at run time its inputs arrive as eager
    tensors and `call` runs the eager collective (checked against the other
    processes, in a traced function, with its gradient rule). One call runs
    at a time per process. Ops that one ``session.run`` may run side by side
    (neither depends on the other) run in the order the session's executor
    reaches them, which may differ between processes: then every process
    raises the mismatch error (the op's name is part of the call compared,
    so two calls alike are never paired across different ops); make one
    depend on the other (``tf.control_dependencies``) or use a grouped
    collective.

    Args:
      call: function (list of eager tf.Tensor or tf.IndexedSlices) -> list
        of them.
      tensors: list of graph tf.Tensor or tf.IndexedSlices.
      outputs: list of tf.TensorSpec or tf.IndexedSlicesSpec, call's results.

    Returns:
      list of graph tensors (or tf.IndexedSlices) shaped by `outputs`.

    Raises (when the session runs the op):
      tf.errors.InvalidArgumentError: carrying the eager call's ValueError or
        TypeError (a mismatch between processes too: TF's py_function maps
        every ValueError to this class).
    """
    flat = tf.nest.flatten(tensors, expand_composites=True)
    specs = tf.nest.flatten(outputs, expand_composites=True)

    made = []  # the op's name, once built

    def run(*values):
        with _SESSION_CALLS:
            _SESSION_OP[:] = made
            try:
                result = call(tf.nest.pack_sequence_as(tensors, list(values),
                                                       expand_composites=True))
            finally:
                _SESSION_OP[:] = []
        return tf.nest.flatten(result, expand_composites=True)

    out = tf.py_function(run, flat, [spec.dtype for spec in specs], name="hvd_in_session")
    out = out if isinstance(out, list) else [out]
    made.append(out[0].op.name)
    for t, spec in zip(out, specs):
        t.set_shape(spec.shape)
    return tf.nest.pack_sequence_as(outputs, out, expand_composites=True)
