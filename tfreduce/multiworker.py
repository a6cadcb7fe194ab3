"""All-reduce across workers: local reduction, cross-worker collective, local broadcast.

Each of W workers holds K towers (devices). One multi-worker all-reduce of
the W*K towers' gradients is three stages, as in Caffe2's data_parallel_model
rendezvous and Horovod's hierarchical all-reduce:

1. local: the K towers of each worker are summed with any tfreduce
   algorithm (flat, hierarchical, collective, NCCL), on the worker's own
   devices, where bandwidth is high;
2. cross-worker: for each (packed) gradient, one device per worker runs a TF
   collective all-reduce (``CollectiveReduceV2``) of the local sums over the
   gRPC cluster of ``tfreduce.cluster.Cluster``, so only one copy of each
   gradient leaves each worker. The gradients are spread over the local
   devices by bytes, so the K devices of a worker each carry about 1/K of the
   cross-worker traffic;
3. local broadcast: that device divides by W*K once (``average=True``),
   casts back once and copies the result to the worker's other devices.

No transport of tfreduce's own: TF's collective runtime moves the bytes (a
ring over gRPC on CPUs), as under MultiWorkerMirroredStrategy.
"""

import tensorflow as tf

from tfreduce.allreduce import ALGORITHMS, allreduce_grads, choose_algorithm
from tfreduce.cluster import Cluster
from tfreduce.contract import check_variables, nbytes, normalize_devices, validate_grads
from tfreduce.driver import run_allreduce
from tfreduce.collective import COMMUNICATIONS, CollectiveKeys
from tfreduce.primitives import (RootBalancer, accumulation_dtype, broadcast, finish_sum,
                                 sum_order)

__all__ = ["allreduce_grads_multiworker", "broadcast_variables_multiworker",
           "CROSS_WORKER_PACK_BYTES"]

#: Default buffer size for packing before the cross-worker all-reduce. Each
#: collective between hosts pays a network round trip or more, so small
#: gradients are fused into buffers of this size (see packing.PackPlan).
CROSS_WORKER_PACK_BYTES = 4 * 1024 * 1024

# Options of the local algorithm that this function decides itself.
_OWN_OPTIONS = ("pack_bytes", "sparse_as_dense", "devices", "average")


def _check_cluster(cluster):
    if not isinstance(cluster, Cluster):
        raise TypeError(
            f"cluster must be a tfreduce.Cluster (e.g. Cluster.from_tf_config(), "
            f"then cluster.start()), got {type(cluster).__name__} {cluster!r}")


def _check_timeout(timeout, cluster):
    if timeout is None:
        return cluster.timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0 or None (the "
                         f"cluster's {cluster.timeout:g}s), got {timeout!r}")
    return float(timeout)


def _check_keys(keys, cluster):
    if keys is None:
        return cluster.keys
    if not isinstance(keys, CollectiveKeys):
        raise TypeError(f"keys must be a tfreduce.CollectiveKeys or None (the "
                        f"cluster's), got {type(keys).__name__}")
    return keys


def _local_name(device):
    """"/job:worker/replica:0/task:1/device:CPU:0" -> "/device:CPU:0"."""
    spec = tf.DeviceSpec.from_string(device)
    return f"/device:{spec.device_type}:{spec.device_index}"


def _ordering_token(device, group_key):
    # One resource per device and group: in a tf.function, automatic control
    # dependencies then order the collectives per device only; ordering them
    # across devices would serialise the group and deadlock.
    with tf.device(device):
        return tf.raw_ops.VarHandleOp(
            dtype=tf.float32, shape=[], shared_name=f"tfreduce_cross_order_{group_key}",
            name="cross_worker_order")


def allreduce_grads_multiworker(all_grads, devices=None, average=False, cluster=None,
                                local_algorithm="auto", local_options=None,
                                pack_bytes=CROSS_WORKER_PACK_BYTES, communication="auto",
                                keys=None, timeout=None):
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
    rounded once. ``tf.IndexedSlices`` are reduced densely: the cross-worker
    stage has no sparse form.

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
      local_options: dict of options of the local algorithm, e.g.
        ``{"groups": [[0, 1], [2, 3]]}`` for "hierarchical".
      pack_bytes: int bytes or None; buffers of about this size are reduced
        instead of many small gradients (see packing.PackPlan).
      communication: "auto", "ring" or "nccl", TF's hint for the
        cross-worker collectives.
      keys: CollectiveKeys of the cross-worker collectives, or None for
        ``cluster.keys``. Whatever is used must hand out the same keys on
        every worker, which the cluster's does for the same program.
      timeout: float seconds or None (``cluster.timeout``) a cross-worker
        collective waits for its peers before failing; run steps inside
        ``cluster.detect_lost_workers()`` to name the worker that was lost.

    Returns:
      list[list[tf.Tensor]], K x N; ``out[k][n]`` is placed on ``devices[k]``
      (named in full, with this worker's job and task), with the shape and
      dtype of ``all_grads[k][n]`` (dense for IndexedSlices); None where
      every tower's gradient is None.

    Raises:
      TypeError: cluster is not a Cluster, keys not CollectiveKeys, bad
        gradients (see ``contract.validate_grads``).
      ValueError: unknown local_algorithm or communication, a local option
        this function sets itself, a bad timeout, a device of another
        worker, or bad gradients or devices.
    """
    _check_cluster(cluster)
    if local_algorithm not in ALGORITHMS:
        raise ValueError(f"local_algorithm must be one of {ALGORITHMS}, got "
                         f"{local_algorithm!r}")
    if communication not in COMMUNICATIONS:
        raise ValueError(f"communication must be one of {COMMUNICATIONS}, got "
                         f"{communication!r}")
    local_options = dict(local_options or {})
    own = sorted(set(local_options) & set(_OWN_OPTIONS))
    if own:
        raise ValueError(
            f"local_options {own} are set by allreduce_grads_multiworker itself; "
            f"pass pack_bytes to it directly")
    timeout = _check_timeout(timeout, cluster)
    keys = _check_keys(keys, cluster)
    # Full names: the ops stay on this worker, and a local collective
    # algorithm gets a group key of its own on each worker.
    devices = cluster.devices(validate_grads(all_grads, devices).devices)
    if local_algorithm == "auto":
        local_algorithm = choose_algorithm(devices)

    def local_reduce(grads, devs):
        # The entries arrive packed by this call's own plan: no second packing.
        return allreduce_grads(grads, devs, average=False, algorithm=local_algorithm,
                               pack_bytes=None, **local_options)

    # Only one device's copy of each local sum is used. Outputs of the other
    # devices are pruned, which is right for reductions built from copies,
    # but the K ops of a collective or NCCL reduction wait for each other:
    # all K must run, or a tf.compat.v1 session hangs.
    run_all_local = local_algorithm in ("collective", "nccl")

    def reduce_dense(columns, devs):
        return _multiworker_columns(columns, devs, average, cluster, local_reduce,
                                    run_all_local, communication, keys, timeout)

    def build():
        return run_allreduce(all_grads, devices, average, reduce_dense,
                             scope="allreduce_multiworker", pack_bytes=pack_bytes,
                             sparse_as_dense=True)

    if tf.executing_eagerly():
        # Collectives must be issued together; eagerly each would block.
        return tf.function(build, autograph=False)()
    return build()


def _multiworker_columns(columns, devices, average, cluster, local_reduce, run_all_local,
                         communication, keys, timeout):
    num_local = len(devices)
    num_entries = len(columns)
    total_towers = num_local * cluster.num_workers
    # Half types go up to float32 on each tower, before the first sum, so
    # that both sums are float32 and the result is rounded once.
    local_in = [[None] * num_entries for _ in range(num_local)]
    for m, column in enumerate(columns):
        acc = accumulation_dtype(column[0].dtype)
        for k, (g, d) in enumerate(zip(column, devices)):
            if acc != g.dtype:
                with tf.device(d):
                    g = tf.cast(g, acc, name=f"entry{m}_dev{k}_to_{acc.name}")
            local_in[k][m] = g
    local_sums = local_reduce(local_in, devices)

    group_keys = [cluster.group_key([_local_name(d)]) for d in devices]
    tokens = {}
    previous = {}
    balancer = RootBalancer(num_local)
    sizes = [nbytes(c[0]) for c in columns]
    out = [None] * num_entries
    for m in sum_order(sizes):
        r = balancer.pick(range(num_local), sizes[m])
        if r not in tokens:
            tokens[r] = _ordering_token(devices[r], group_keys[r])
        deps = [previous[r]] if r in previous else []
        if run_all_local:
            deps += [local_sums[k][m] for k in range(num_local) if k != r]
        with tf.device(devices[r]), tf.control_dependencies(deps):
            summed = tf.raw_ops.CollectiveReduceV2(
                input=local_sums[r][m], group_size=cluster.num_workers,
                group_key=group_keys[r], instance_key=keys.instance_key(),
                ordering_token=[tokens[r]], merge_op="Add", final_op="Id",
                communication_hint=communication, timeout_seconds=timeout,
                name=f"entry{m}_cross_worker")
        previous[r] = summed
        total = finish_sum(summed, columns[m][0].dtype, total_towers, average,
                           devices[r], name=f"entry{m}_total")
        out[m] = broadcast(total, devices, name_fmt=f"entry{m}_dev{{}}_out")
    return out


def broadcast_variables_multiworker(all_vars, cluster, keys=None, timeout=None,
                                    communication="auto"):
    """Copies tower 0 of rank 0 (the chief) to every tower of every worker.

    Rank 0 sends its tower 0's values, packed into one buffer per dtype, with
    ``CollectiveBcastSendV2`` from tower 0's device; every other worker
    receives them (``CollectiveBcastRecvV2``) on its tower 0's device; then
    each worker assigns the values to its towers, each assignment on the
    device of the variable it writes. Every worker calls it at the same point
    of the program (at start, after rank 0 restored a checkpoint).

    K x N contract on each worker, W=2, K=2, N=1 (X is rank 0's tower 0)::

        worker 0: [[X], [Y]]  ->  [[X], [X]]
        worker 1: [[Z], [U]]  ->  [[X], [X]]

    Args:
      all_vars: list of K lists of N ``tf.Variable``, this worker's towers'
        copies (fully defined shapes; the same K, N, shapes and dtypes on
        every worker).
      cluster: tfreduce.Cluster, started.
      keys: CollectiveKeys or None (``cluster.keys``).
      timeout: float seconds or None (``cluster.timeout``).
      communication: "auto", "ring" or "nccl".

    Returns:
      list of ops in graph mode, the assignments and the collectives (run
      them all, on every worker); in eager mode the copies are done and None
      is returned.

    Raises:
      TypeError: all_vars not K lists of variables, bad cluster or keys.
      ValueError: towers with different variables, a bad timeout or
        communication, a variable on another worker's device.
    """
    _check_cluster(cluster)
    check_variables(all_vars, fully_defined=True)
    if communication not in COMMUNICATIONS:
        raise ValueError(f"communication must be one of {COMMUNICATIONS}, got "
                         f"{communication!r}")
    timeout = _check_timeout(timeout, cluster)
    keys = _check_keys(keys, cluster)
    devices = normalize_devices([cluster.device(t[0].device or "/device:CPU:0",
                                                where=f"tower {k}'s device")
                                 for k, t in enumerate(all_vars)])

    def build():
        with tf.name_scope("broadcast_variables_multiworker"):
            return _broadcast_build(all_vars, devices, cluster, keys, timeout, communication)

    if tf.executing_eagerly():
        def run():
            with tf.control_dependencies(build()):
                return tf.constant(0)

        tf.function(run, autograph=False)()
        return None
    return build()


def _broadcast_build(all_vars, devices, cluster, keys, timeout, communication):
    root = devices[0]
    group_key = cluster.group_key([_local_name(root)])
    by_dtype = {}
    for n, v in enumerate(all_vars[0]):
        by_dtype.setdefault(v.dtype, []).append(n)
    values = [None] * len(all_vars[0])
    previous = []
    buffers = []
    for dtype, members in by_dtype.items():
        shapes = [all_vars[0][n].shape for n in members]
        sizes = [s.num_elements() for s in shapes]
        with tf.device(root), tf.control_dependencies(previous):
            if cluster.is_chief:
                flat = [tf.reshape(all_vars[0][n].read_value(), [-1]) for n in members]
                buffer = tf.concat(flat, axis=0, name=f"{dtype.name}_send_buffer")
                # Read the values from the send's output: in a tf.function an
                # unread CollectiveBcastSendV2 would be pruned.
                buffer = tf.raw_ops.CollectiveBcastSendV2(
                    input=buffer, group_size=cluster.num_workers, group_key=group_key,
                    instance_key=keys.instance_key(), communication_hint=communication,
                    timeout_seconds=timeout, name=f"{dtype.name}_send")
            else:
                buffer = tf.raw_ops.CollectiveBcastRecvV2(
                    group_size=cluster.num_workers, group_key=group_key,
                    instance_key=keys.instance_key(), shape=[sum(sizes)], T=dtype,
                    communication_hint=communication, timeout_seconds=timeout,
                    name=f"{dtype.name}_recv")
            previous = [buffer]
            buffers.append(buffer)
            parts = tf.split(buffer, sizes, name=f"{dtype.name}_unpack")
        for n, part, shape in zip(members, parts, shapes):
            values[n] = (part, shape)
    ops = []
    for k, tower in enumerate(all_vars):
        if k == 0 and cluster.is_chief:
            continue
        for n, v in enumerate(tower):
            part, shape = values[n]
            with tf.device(devices[k]):
                ops.append(v.assign(tf.reshape(part, shape), read_value=False,
                                    name=f"dev{k}_var{n}_assign"))
    # The chief with one tower assigns nothing: its sends must be run anyway.
    return ops + [b.op for b in buffers]
