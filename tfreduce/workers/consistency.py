"""Before the first step: do all workers run the same thing?

Workers with different device counts, variables or all-reduce settings
would build collectives that never meet: one worker fails on a shape
mismatch while another waits out the whole cluster timeout and then blames
a "lost" worker that is alive. DDP verifies the model across ranks before
its first step (``_verify_model_across_ranks``) for the same reason.

``check_workers_agree`` all-gathers a fingerprint of each worker's facts
over one device per worker: the numbers themselves (towers, variables) and
a 63-bit hash of each fact. When the rows differ, the first differing
variable (or the differing settings) is gathered in full as text, so every
worker raises the same ValueError naming the workers and the difference,
within seconds.
"""

import functools
import hashlib

import numpy as np
import tensorflow as tf

from tfreduce.basis.kerases import variable_name
from tfreduce.blocks.collective import CollectiveOptions, all_gather, in_function

__all__ = ["CallMismatchError", "MessageError", "check_workers_agree", "check_same_call",
           "join_round"]

# Bytes of one fact's text sent when it differs (longer texts are cut).
_TEXT_BYTES = 240
_DEVICE = "/device:CPU:0"


@functools.lru_cache(maxsize=4096)  # a call made again hashes its description once
def _hash(text):
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def _gather(cluster, values):
    """Every worker's int64 vector `values` (one length on all), as a W x L array."""
    values = np.asarray(values, np.int64)
    if cluster.mpi is not None:
        return _gather_over_mpi(cluster, values)
    group_key = cluster.group_key([_DEVICE])
    options = CollectiveOptions(timeout=cluster.op_timeout)
    instance_key = cluster.keys.instance_key()

    def build():
        with tf.name_scope("workers_agree"), tf.device(cluster.task_name() + _DEVICE):
            return all_gather(tf.constant(values), cluster.num_workers, group_key,
                              instance_key, options, name="gather")

    with cluster.detect_lost_workers():
        gathered = in_function(build)
    return np.asarray(gathered).reshape(cluster.num_workers, len(values))


def _gather_over_mpi(cluster, values):
    """_gather over the cluster's MPI transport: a hundredth of TF's cost between processes."""
    with cluster.detect_lost_workers():
        return cluster.mpi.allgather(values.reshape(1, -1)).reshape(cluster.num_workers, -1)


def _gather_text(cluster, text):
    """Every worker's `text` (cut to _TEXT_BYTES bytes), in rank order."""
    data = text.encode()[:_TEXT_BYTES]
    rows = _gather(cluster, list(data) + [0] * (_TEXT_BYTES - len(data)))
    return [bytes(int(b) for b in row if b).decode(errors="replace") for row in rows]


def describe_variables(variables):
    """(name, "shape dtype") of each variable: what the workers of a cluster compare."""
    return [(variable_name(v), f"{tuple(v.shape)} {tf.as_dtype(v.dtype).name}")
            for v in variables]


def check_workers_agree(cluster, towers, settings, variables):
    """Raises on every worker unless all workers have the same towers, settings, variables.

    Every worker of the cluster must call it at the same point (it runs
    collectives), before the first collective of training.

    Args:
      cluster: tfreduce.Cluster, started; or a LocalCluster (one worker:
        nothing to compare).
      towers: int K, this worker's towers.
      settings: str, everything else that shapes the collectives (the
        algorithm and its options, average), the same text on every worker
        that runs the same program.
      variables: list of (name, description) pairs, one per variable in
        order; the descriptions (shape and dtype) are compared, the names
        (which Keras numbers per process) only shown.

    Raises:
      ValueError: the workers differ; the message names the workers and the
        first difference (tower counts, variable counts, the settings, or
        the first variable that differs, with each worker's version).
      WorkerLostError: a worker is lost or does not arrive in time.
    """
    if cluster.is_local:
        return  # one process agrees with itself
    described = [description for _, description in variables]
    row = [towers, len(variables), _hash(settings), _hash("\n".join(described))]
    rows = _gather(cluster, row)
    if (rows == rows[0]).all():
        return
    names = [cluster.describe(r) for r in range(cluster.num_workers)]
    here = f"{names[cluster.rank]}: the workers do not run the same training"
    for column, what in ((0, "towers (devices)"), (1, "variables")):
        if len(set(rows[:, column])) > 1:
            counts = ", ".join(f"{names[r]} has {rows[r, column]}" for r in range(len(rows)))
            raise ValueError(f"{here}: their numbers of {what} differ: {counts}")
    if len(set(rows[:, 2])) > 1:
        texts = _gather_text(cluster, settings)
        raise ValueError(f"{here}: their all-reduce settings differ: " + "; ".join(
            f"{name}: {text}" for name, text in zip(names, texts)))
    hashes = _gather(cluster, [_hash(d) for d in described])
    first = int(np.argmax((hashes != hashes[0]).any(axis=0)))
    texts = _gather_text(cluster, " ".join(variables[first]))
    raise ValueError(f"{here}: variable {first} differs: " + "; ".join(
        f"{name} has {text}" for name, text in zip(names, texts)))


class MessageError:
    """Base (first) of an error that is also a ``tf.errors.OpError``: raised with a message alone.

    TF re-raises an OpError as ``type(e)(node_def, op, message)``; both forms work.
    """

    def __init__(self, *args):
        node_def, op, message = (None, None) + args if len(args) == 1 else args[:3]
        super().__init__(node_def, op, message)


class CallMismatchError(MessageError, tf.errors.FailedPreconditionError, ValueError):
    """The processes made different collective calls; raised on every process.

    A ``tf.errors.FailedPreconditionError``, the class Horovod raises for a
    mismatch between ranks, and a ValueError.
    """


# What a process waiting in join() says in place of a call's description.
_JOINED = "join"
# What each worker says of its call in a round: the call, a call that failed
# its own checks before any data moved (with its collective), or join().
_CALL, _FAILED, _IN_JOIN = 0, 1, 2


def check_same_call(cluster, description, functions, values=None, recipe=None, kind=None,
                    failed=None, site=""):
    """Raises on every worker, before any data moves, unless all make the same collective call.

    Horovod negotiates every collective by name before it runs; TF's
    runtime matches collectives by instance key alone, so processes that
    call different collectives (or the same with other shapes, dtypes, root
    ranks or ops) would pair the wrong tensors, wait forever, or abort the
    runtime for good ("Collective ops is aborted ... Restart your program").
    One small all-gather of each worker's word on its call comes first
    (what it is, its collective, a hash of its description); when the calls
    differ every worker raises the same ValueError naming each worker's
    call, and the runtime stays usable for the next call.

    A call that failed its own checks on one worker (splits that do not add
    up, a root rank out of range) takes part too (`failed`), so that no
    later call pairs with another's: when the others make the same
    collective from the same place in the program (`site`), every worker
    raises (the failing one its own error, the others a CallMismatchError
    naming it and its error); otherwise the failed call was that worker's
    alone: it raises its error and the others' call pairs with its next one.

    When the calls agree, `values` (what each worker may choose for itself:
    its row counts, its all-to-all splits) are all-gathered next, so that
    every worker builds the data's collectives from the same numbers.

    Workers waiting in Horovod's ``join()`` (``join_round``) take part:
    the others' call goes on with them when it has a `recipe` (the bytes
    from which a joined worker makes the same call, with zeros); otherwise
    every worker raises.

    Args:
      cluster: tfreduce.Cluster, started; or a LocalCluster (nothing to compare).
      description: str, what the call does: the collective, its name, the
        shapes and dtypes, the root rank or op. Its text fixes the length
        of `values`. For a failed call, what this worker's error says.
      functions: dict where the traced all-gathers are kept between calls
        (the run's ``process.eager_functions()``).
      values: None, or a sequence of L ints (int64).
      recipe: None, or a function () -> bytes: how a joined worker makes
        this call (called only when one waits).
      kind: str, the collective ("allreduce", "alltoall", ...); None: the
        description's first word.
      failed: None, or the exception this worker's call raised in its own
        checks (raised again here, after the round).
      site: str, where the program made the call (its frames' "file:line",
        ``calls.call_site``; the same text on every worker running the same
        program): a failed call is the others' only if made where theirs was.

    Returns:
      None without `values`; else an int64 array [workers, L]: row r is
      worker r's values (on a LocalCluster, [1, L]: this worker's).

    Raises:
      CallMismatchError: the workers' calls differ (each worker's description
        named), another worker's same call failed its checks (named with
        its error), or some wait in join() and this call cannot go on
        without them.
      WorkerLostError: a worker is lost or does not arrive in time.
      `failed`, when given.
    """
    if cluster.is_local:
        if failed is not None:
            raise failed
        return None if values is None else np.asarray([values], np.int64).reshape(1, -1)
    kind = kind or description.split()[0]
    word = [_FAILED if failed is not None else _CALL, _hash(f"{kind} at {site}"),
            _hash(description)]
    while True:
        rows = _gather_cached(cluster, functions, word)
        outcome = _resolve(rows)
        if outcome == "retry" and failed is None:
            continue  # the failed calls were their workers' own: pair with their next
        if outcome in ("mismatch", "failed"):
            texts = _gather_text(cluster, description if failed is None
                                 else f"failed {kind}: {description}")
        if failed is not None:
            raise failed
        if outcome == "mismatch":
            _raise_mismatch(cluster, texts)
        if outcome == "failed":
            _raise_failed(cluster, texts, rows)
        break
    if outcome == "joined":
        _recipe_for_joined(cluster, functions, description, rows, recipe)
    if values is None:
        return None
    if len(values) == 0:  # TF's all-gather fails on an empty tensor
        return np.zeros([cluster.num_workers, 0], np.int64)
    return _gather_cached(cluster, functions, values)


def _resolve(rows):
    """What a round of words (W x 3: status, hash of the collective and its
    site, hash of the description) comes to, alike on every worker.

    "agreed" (every worker makes the same call), "mismatch" (the calls
    differ), "failed" (a worker's call of the same collective, from the same
    site, failed its checks), "retry" (only other calls failed: those
    workers' own), "joined" (some wait in join(), the others agree),
    "ended" (every worker waits in join()), "none" (no worker made a call:
    failed calls and joins only)."""
    if rows[0, 0] == _CALL and (rows == rows[0]).all():
        return "agreed"  # the common case, at a tenth of the cost of the tests below
    status, kinds, hashes = rows[:, 0], rows[:, 1], rows[:, 2]
    calls, failed = status == _CALL, status == _FAILED
    if not calls.any():
        return "none" if failed.any() else "ended"
    if len(set(hashes[calls].tolist())) > 1:
        return "mismatch"
    if failed.any():
        return "failed" if (kinds[failed] == kinds[calls][0]).any() else "retry"
    return "joined" if (status == _IN_JOIN).any() else "agreed"


def join_round(cluster, functions, joined_at):
    """One round of a worker waiting in join(): the next call to make with zeros, or the end.

    Every worker waiting in join() calls it in a loop; each round pairs with
    one ``check_same_call`` of the workers still working. A round in which
    the working workers' calls failed (or paired with a failed one) is
    nothing to make: (b"", None).

    Args:
      cluster: tfreduce.Cluster, started (several workers).
      functions: as in check_same_call.
      joined_at: int, how many calls this worker had made when it joined.

    Returns:
      (recipe, None): bytes, the call the working workers make (to make
      with zeros), or b"" when there is none this round; or (None, last):
      every worker has joined, `last` the rank that joined last (the
      highest such rank on a tie).

    Raises:
      CallMismatchError: the working workers' call cannot go on without
        this one (no recipe), or their calls differ.
    """
    rows = _gather_cached(cluster, functions, [_IN_JOIN, _hash(_JOINED), _hash(_JOINED)])
    outcome = _resolve(rows)
    if outcome == "ended":
        at = _gather_cached(cluster, functions, [joined_at])[:, 0]
        return None, int(np.flatnonzero(at == at.max())[-1])
    if outcome in ("mismatch", "failed"):
        texts = _gather_text(cluster, _JOINED)
        if outcome == "mismatch":
            _raise_mismatch(cluster, texts)
    if outcome in ("failed", "retry", "none"):
        return b"", None
    return _recipe_for_joined(cluster, functions, _JOINED, rows, None), None


def _recipe_for_joined(cluster, functions, description, rows, recipe):
    """The first working worker's recipe, on every worker, once the working ones agree."""
    joined = rows[:, 0] == _IN_JOIN
    working = np.flatnonzero(~joined)
    recipe = recipe() if recipe else b""
    lengths = _gather_cached(cluster, functions, [len(recipe)])[:, 0]
    first = int(working[0])
    if lengths[working].min() == 0:
        texts = _gather_text(cluster, description)
        waiting = ", ".join(cluster.describe(int(r)) for r in np.flatnonzero(joined))
        raise CallMismatchError(
            f"{cluster.describe(cluster.rank)}: the call of the workers still working, "
            f"{texts[first]}, cannot go on while these wait in join() (their data ended): "
            f"{waiting}. After a join(), the others may only all-reduce dense tensors with op "
            "Sum or Average, eagerly (as in Horovod); call join() after the last other call")
    words = -(-int(lengths.max()) // 8)
    mine = np.frombuffer(recipe.ljust(8 * words, b"\0"), np.int64)
    gathered = _gather_cached(cluster, functions, mine)
    return gathered[first].tobytes()[:int(lengths[first])]


def _raise_mismatch(cluster, texts):
    calls = "; ".join(f"{cluster.describe(r)}: {text}" for r, text in enumerate(texts))
    raise CallMismatchError(f"{cluster.describe(cluster.rank)}: the processes made "
                            f"different collective calls, which must be the same, in the "
                            f"same order, on every process: {calls} (when a process's data "
                            "ends before the others', it calls join(), which lets them finish)")


def _raise_failed(cluster, texts, rows):
    failed = [r for r in range(len(rows)) if rows[r, 0] == _FAILED]
    which = "; ".join(f"{cluster.describe(r)}: {texts[r]}" for r in failed)
    raise CallMismatchError(f"{cluster.describe(cluster.rank)}: the same collective call "
                            f"failed its own checks on another process, so it raises on "
                            f"every process (nothing was sent; the next call pairs as "
                            f"before): {which}")


def _gather_cached(cluster, functions, values):
    """_gather(cluster, values) through one traced all-gather per length, kept in `functions`.

    Every worker must call it with the same length at the same point: the
    first call of a length draws its instance key then."""
    values = np.asarray(values, np.int64).reshape(-1)
    if cluster.mpi is not None:
        return _gather_over_mpi(cluster, values)
    key = ("check_same_call", len(values))
    gather = functions.get(key)
    if gather is None:
        group_key = cluster.group_key([_DEVICE])
        options = CollectiveOptions(timeout=cluster.op_timeout)
        instance_key = cluster.keys.instance_key()

        def build(value):
            with tf.name_scope("same_call"), tf.device(cluster.task_name() + _DEVICE):
                return all_gather(value, cluster.num_workers, group_key, instance_key, options,
                                  name="gather")

        gather = functions[key] = tf.function(
            build, input_signature=[tf.TensorSpec([len(values)], tf.int64)], autograph=False)
    with cluster.detect_lost_workers():
        gathered = gather(tf.constant(values)).numpy()
    return gathered.reshape(cluster.num_workers, len(values))
