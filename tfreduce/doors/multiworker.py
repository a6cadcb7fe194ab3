"""All-reduce across workers: local reduction, cross-worker collective, local broadcast.

Each of W workers holds K towers (devices). One multi-worker all-reduce of
the W*K towers' gradients is three stages, as in Caffe2's data_parallel_model
rendezvous and Horovod's hierarchical all-reduce:

1. local: the K towers of each worker are summed with any tfreduce
   algorithm (flat, hierarchical, collective, NCCL), on the worker's own
   devices, where bandwidth is high;
2. cross-worker: for each (packed) gradient, one device per worker runs a TF
   collective all-reduce (``CollectiveReduceV2``) of the local sums over the
   gRPC cluster of ``tfreduce.workers.cluster.Cluster``, so only one copy of each
   gradient leaves each worker. The gradients are spread over the local
   devices by bytes, so the K devices of a worker each carry about 1/K of the
   cross-worker traffic;
3. local broadcast: that device divides by W*K once (``average=True``),
   casts back once and copies the result to the worker's other devices.

The reduction is written as data, the stage list ``[<local stage>,
CrossWorkerStage]`` (stages 2 and 3 are the ``CrossWorkerStage``), run by
the same frame as every single-host algorithm (``frame.run_stages``): the
input is validated and packed once, every sum is formed in float32 for half
types, and the result is unpacked once.

No transport of tfreduce's own: TF's collective runtime moves the bytes (a
ring over gRPC on CPUs), as under MultiWorkerMirroredStrategy.
"""

import tensorflow as tf

from tfreduce.algorithms.replicated import broadcast_variables
from tfreduce.basis.contract import check_flag, check_root_rank, check_variables, validate_grads
from tfreduce.basis.devices import local_name, normalize_devices
from tfreduce.blocks.collective import (CollectiveOptions, broadcast_recv, broadcast_send,
                                        check_keys, in_function)
from tfreduce.choice.reduction import as_reduction
from tfreduce.workers.cluster import Cluster
from tfreduce.workers.crossworker import (CROSS_WORKER_PACK_BYTES, CrossWorkerStage,
                                          cross_worker_options)
from tfreduce.workers.localcluster import LocalCluster

__all__ = ["allreduce_grads_multiworker", "broadcast_variables_multiworker",
           "check_local_options", "CROSS_WORKER_PACK_BYTES", "CrossWorkerStage"]

# Options of the local algorithm that this function decides itself.
_OWN_OPTIONS = ("pack_bytes", "sparse_as_dense", "devices", "average")


def check_local_options(local_options):
    """A copy of the local algorithm's options, without those set here.

    Raises:
      ValueError: an option ``allreduce_grads_multiworker`` sets itself,
        ``compression``, which it takes itself (for the cross-worker step),
        or ``topology`` (plans are for one process).
    """
    local_options = dict(local_options or {})
    if local_options.get("compression") is not None:
        raise ValueError(
            f"local_options compression={local_options['compression']!r}: pass "
            f"compression= to allreduce_grads_multiworker itself, which compresses the "
            f"cross-worker step (the local sums stay float32)")
    if local_options.get("topology") is not None:
        raise ValueError(
            f"local_options topology={local_options['topology']!r}: a plan is for the devices of "
            f"one process; across workers pass its choice as local_algorithm and "
            f"local_options (tfreduce.plan_allreduce(...).kwargs())")
    own = sorted(set(local_options) & set(_OWN_OPTIONS))
    if own:
        raise ValueError(
            f"local_options {own} are set by allreduce_grads_multiworker itself: "
            f"pass pack_bytes to it directly; IndexedSlices are gathered across "
            f"workers (sparse_as_dense is not taken there)")
    return local_options


def sum_over_workers(columns, devices, cluster, allreduce):
    """Per-tower scalars summed over the towers of every worker (a step's metrics).

    Args:
      columns: C lists of K scalars, ``columns[c][k]`` on devices[k]; a None
        entry counts as 0, a column of None stays None.
      devices: list of K device names, this worker's towers.
      cluster: a started tfreduce.Cluster, or a LocalCluster.
      allreduce: fn(K x N, average) -> K x N over every tower of the
        cluster (the trainer's uncompressed all-reduce).

    Returns:
      C lists whose ``tf.add_n`` is the column's total over every tower of
      the run: across workers one float64 scalar each (exact for counts
      below 2**53), from one all-reduce of all columns; with a LocalCluster
      the column's given values, in their dtype (no collective). A column
      of None gives [None].
    """
    if cluster.is_local:
        return [[v for v in column if v is not None] or [None] for column in columns]
    present = [c for c, column in enumerate(columns) if any(v is not None for v in column)]
    rows = []
    for k, device in enumerate(devices):
        with tf.device(device):
            rows.append([tf.zeros([], tf.float64) if columns[c][k] is None
                         else tf.cast(columns[c][k], tf.float64) for c in present])
    with tf.name_scope("metrics"):
        summed = allreduce(rows, average=False)[0]
    out = [[None] for _ in columns]
    for c, total in zip(present, summed):
        out[c] = [total]
    return out


def _check_cluster(cluster, local_too=False):
    if not isinstance(cluster, (Cluster, LocalCluster) if local_too else Cluster):
        local = " or a LocalCluster" if local_too else ""
        raise TypeError(
            f"cluster must be a tfreduce.Cluster (e.g. Cluster.from_tf_config(), "
            f"then cluster.start()){local}, got {type(cluster).__name__} {cluster!r}")


@tf.autograph.experimental.do_not_convert
def allreduce_grads_multiworker(all_grads, devices=None, average=False, cluster=None,
                                local_algorithm="auto", local_options=None,
                                pack_bytes=CROSS_WORKER_PACK_BYTES, communication="auto",
                                keys=None, timeout=None, compression=None, *, reduction=None):
    """All-reduces the gradients of every tower of every worker.

    Every worker of ``cluster`` calls this with its own K towers' gradients,
    the same K, N, shapes and dtypes on every worker, and builds the same
    reductions in the same order (it runs the same program). The result on
    each worker is the sum (or mean) over all T = W * K towers, on every one
    of the worker's devices.

    Stages (after packing, per gradient): local sum with ``local_algorithm``
    (``add_n`` for "flat"); ``entry{m}_cross_worker``, a
    ``CollectiveReduceV2`` over one device of each worker (the devices are
    spread by bytes, largest gradients first); ``entry{m}_total``, the one
    multiplication by 1/T and cast back; ``entry{m}_dev{k}_out``, the copy to
    device k. float16/bfloat16 are cast to float32 on each tower first, so
    the local and cross-worker sums are both float32 and the result is
    rounded once. ``tf.IndexedSlices`` stay IndexedSlices: each worker
    gathers its towers' rows on one device, those rows are all-gathered
    across workers (``CollectiveGatherV2``, padded to the longest), scaled
    once by 1/T and copied to the worker's devices.

    K x N contract on each worker; here W=2 workers of K=2 towers, N=2, sum::

        worker 0: [[A, B],    ->  [[A+C+E+G, B+D+F+H],   # on devices[0]
                   [C, D]]         [A+C+E+G, B+D+F+H]]   # on devices[1]
        worker 1: [[E, F],    ->  [[A+C+E+G, B+D+F+H],   # on its devices[0]
                   [G, H]]         [A+C+E+G, B+D+F+H]]   # on its devices[1]

    Sources: Caffe2 data_parallel_model (local reduce, cross-host all-reduce
    of the local roots, local broadcast); Horovod's hierarchical all-reduce;
    TF's collective ops as the cross-host engine of MultiWorkerMirroredStrategy.

    Args:
      all_grads: list of K lists of N gradients of this worker's towers;
        ``all_grads[k][n]`` is a ``tf.Tensor`` (float or int, any static
        shape), a ``tf.IndexedSlices`` or None.
      devices: list of K devices of this worker ("/gpu:0" or full
        "/job:worker/replica:0/task:1/device:GPU:0"), or None for the
        tensors' devices. The same local names on every worker.
      average: bool; mean over all T = W * K towers instead of the sum.
      cluster: tfreduce.Cluster of this worker, started (``start()`` in TF2,
        ``start_server()`` for a tf.compat.v1 Session).
      local_algorithm: a name in ``tfreduce.ALGORITHMS``, the reduction
        among the worker's K devices; "auto" uses ``tfreduce.choose_algorithm``.
      local_options: dict of the local algorithm's own options (fields of
        ``tfreduce.Reduction``), e.g. ``{"groups": [[0, 1], [2, 3]]}`` for
        "hierarchical".
      pack_bytes: see ``tfreduce.Reduction``; 4 MiB by default here, since
        each collective between hosts pays a network round trip.
      communication: "auto", "ring" or "nccl", TF's hint for the
        cross-worker collectives.
      keys: CollectiveKeys of the cross-worker collectives, or None for
        ``cluster.keys``. Whatever is used must hand out the same keys on
        every worker, which the cluster's does for the same program.
      timeout: float seconds or None (``cluster.timeout``, enforced by the
        cluster's watchdog) a cross-worker collective waits for its peers
        before failing; given here, each op carries it (a thread per op
        execution, ``Cluster.op_timeout``). Run steps inside
        ``cluster.detect_lost_workers()`` to name the worker that was lost.
      compression: see ``tfreduce.Reduction``; across workers only the
        cross-worker hop is compressed: each worker's float32 local sum,
        prescaled by 1/T when averaging, is summed across workers in the
        wire dtype; IndexedSlices and 16-bit gradients are not compressed.
      reduction: a ``tfreduce.Reduction`` (not "auto" with a topology)
        instead of local_algorithm, local_options, pack_bytes and
        compression; its pack_bytes "auto" is 4 MiB here.

    Returns:
      list[list[tf.Tensor]], K x N; ``out[k][n]`` is placed on ``devices[k]``
      (named in full, with this worker's job and task), with the shape and
      dtype of ``all_grads[k][n]`` (IndexedSlices stay IndexedSlices); None where
      every tower's gradient is None.

    Raises:
      TypeError: cluster is not a Cluster, keys not CollectiveKeys, bad
        gradients (see ``contract.validate_grads``).
      ValueError: unknown local_algorithm or communication, a local option
        this function sets itself, a bad timeout, a device of another
        worker, or bad gradients or devices.
    """
    _check_cluster(cluster)
    own = {} if pack_bytes == CROSS_WORKER_PACK_BYTES else {"pack_bytes": pack_bytes}
    if compression is not None:
        own["compression"] = compression
    reduction = as_reduction(local_algorithm, reduction,
                             {**check_local_options(local_options), **own})
    check_flag(average, "average")
    options, keys = cross_worker_options(cluster, communication, timeout, keys)
    grads = validate_grads(all_grads, devices)
    # Full names: the ops stay on this worker, and a local collective
    # algorithm gets a group key of its own on each worker.
    grads.devices = cluster.devices(grads.devices)
    # The reduction as data: the local stage sums this worker's towers, the
    # cross-worker stage sums across workers and copies back.
    return reduction.reduce(grads, average, [
        CrossWorkerStage(cluster, options, keys, reduction.compression,
                         reduction.deterministic)])


@tf.autograph.experimental.do_not_convert
def broadcast_variables_multiworker(all_vars, cluster, keys=None, timeout=None,
                                    communication="auto", root_rank=0):
    """Copies tower 0 of rank 0 (the chief; or of root_rank) to every tower of every worker.

    The root sends its tower 0's values, packed into one buffer per dtype, with
    ``CollectiveBcastSendV2`` from tower 0's device; every other worker
    receives them (``CollectiveBcastRecvV2``) on its tower 0's device; then
    each worker assigns the values to its towers, each assignment on its
    tower's device (that of the tower's first variable). Every worker calls it at the same point
    of the program (at start, after rank 0 restored a checkpoint).

    K x N contract on each worker, W=2, K=2, N=1 (X is rank 0's tower 0)::

        worker 0: [[X], [Y]]  ->  [[X], [X]]
        worker 1: [[Z], [U]]  ->  [[X], [X]]

    Args:
      all_vars: list of K lists of N ``tf.Variable``, this worker's towers'
        copies (fully defined shapes; the same K, N, shapes and dtypes on
        every worker).
      cluster: tfreduce.Cluster, started; or a LocalCluster (one process:
        ``tfreduce.broadcast_variables`` from tower 0, the other arguments
        unused).
      keys: CollectiveKeys or None (``cluster.keys``).
      timeout: float seconds or None (``cluster.timeout``); as in
        ``allreduce_grads_multiworker``.
      communication: "auto", "ring" or "nccl".
      root_rank: int, the rank whose tower 0 is copied (0, the chief, by default).

    Returns:
      list of ops in graph mode, the assignments and the collectives (run
      them all, on every worker); in eager mode the copies are done and None
      is returned.

    Raises:
      TypeError: all_vars not K lists of variables, bad cluster or keys.
      ValueError: towers with different variables, a bad timeout or
        communication, a variable on another worker's device, a root_rank
        outside 0..W-1.
    """
    _check_cluster(cluster, local_too=True)
    check_root_rank(root_rank, cluster.num_workers)
    if cluster.is_local:
        # One process: the local broadcast; the collective options are
        # checked all the same, so a mistake shows before a cluster runs.
        CollectiveOptions(communication, timeout, none_means="the cluster's")
        check_keys(keys)
        ops = broadcast_variables(all_vars, root=0)
        return None if tf.executing_eagerly() else ops
    check_variables(all_vars, fully_defined=True)
    options, keys = cross_worker_options(cluster, communication, timeout, keys)
    devices = normalize_devices([cluster.device(t[0].device or "/device:CPU:0",
                                                where=f"tower {k}'s device")
                                 for k, t in enumerate(all_vars)])

    def build():
        with tf.name_scope("broadcast_variables_multiworker"):
            return _broadcast_build(all_vars, devices, cluster, keys, options, root_rank)

    if not tf.executing_eagerly():
        return build()

    def run():
        # Operations cannot be returned from a tf.function: depend on them.
        with tf.control_dependencies(build()):
            return tf.constant(0)

    in_function(run)
    return None


def _broadcast_build(all_vars, devices, cluster, keys, options, root_rank):
    root = devices[0]
    sends = cluster.rank == root_rank
    group_key = cluster.group_key([local_name(root)])
    by_dtype = {}
    for n, v in enumerate(all_vars[0]):
        by_dtype.setdefault(v.dtype, []).append(n)
    values = [None] * len(all_vars[0])
    previous = []
    buffers = []
    for dtype, members in by_dtype.items():
        shapes = [all_vars[0][n].shape for n in members]
        sizes = [s.num_elements() for s in shapes]
        if not sum(sizes):
            # Only empty variables: nothing to send (TF's kernels crash on it).
            for n, shape in zip(members, shapes):
                values[n] = (tf.zeros(shape, dtype), shape)
            continue
        with tf.device(root), tf.control_dependencies(previous):
            if sends:
                flat = [tf.reshape(all_vars[0][n].read_value(), [-1]) for n in members]
                buffer = tf.concat(flat, axis=0, name=f"{dtype.name}_send_buffer")
                # Read the values from the send's output: in a tf.function an
                # unread CollectiveBcastSendV2 would be pruned.
                buffer = broadcast_send(buffer, cluster.num_workers, group_key,
                                        keys.instance_key(), options, name=f"{dtype.name}_send")
            else:
                buffer = broadcast_recv([sum(sizes)], dtype, cluster.num_workers, group_key,
                                        keys.instance_key(), options, name=f"{dtype.name}_recv")
            previous = [buffer]
            buffers.append(buffer)
            parts = tf.split(buffer, sizes, name=f"{dtype.name}_unpack")
        for n, part, shape in zip(members, parts, shapes):
            values[n] = (part, shape)
    ops = []
    for k, tower in enumerate(all_vars):
        # The root's tower 0 takes back the values it sent: inside a user's
        # tf.function, whose return value drops these ops, a send that feeds
        # no assignment is pruned and every receiver waits forever.
        for n, v in enumerate(tower):
            part, shape = values[n]
            with tf.device(devices[k]):
                ops.append(v.assign(tf.reshape(part, shape), read_value=False,
                                    name=f"dev{k}_var{n}_assign"))
    return ops + [b.op for b in buffers]
