"""The two all-reduce engines TensorFlow ships: NCCL and collective ops.

- NCCL (``tensorflow.python.ops.nccl_ops.all_sum``): one ``NcclAllReduce``
  op per device, GPUs only. The engine of tf_cnn_benchmarks'
  ``--all_reduce_spec=nccl`` and of MirroredStrategy's NcclAllReduce.
- TF collective ops (``CollectiveReduceV2``): a group of K ops, one per
  device, that meet in TF's collective runtime; it runs a ring on CPUs and
  GPUs, or NCCL on GPUs, and spans hosts over TF's gRPC cluster. The engine of
  MultiWorkerMirroredStrategy.

Both form the sum on every device, so ``average=True`` divides on every
device; there is no single place where the sum exists.
"""

import tensorflow as tf
from tensorflow.python.ops import nccl_ops as _tf_nccl

from tfreduce.collective import COMMUNICATIONS, CollectiveKeys
from tfreduce.contract import is_gpu
from tfreduce.driver import run_allreduce
from tfreduce.packing import DEFAULT_PACK_BYTES
from tfreduce.primitives import accumulation_dtype, scale_by_reciprocal

__all__ = ["allreduce_grads_nccl", "allreduce_grads_collective"]

def _require_gpus(devices):
    others = [d for d in devices if not is_gpu(d)]
    if others:
        raise ValueError(
            f"NCCL runs only on GPUs, but devices {others} are not GPUs: use "
            f"algorithm='collective', 'flat' or 'hierarchical' there")


def allreduce_grads_nccl(all_grads, average=False, devices=None, pack_bytes=DEFAULT_PACK_BYTES,
                         sparse_as_dense=False):
    """All-reduces K x N gradients with NCCL ``all_sum`` (GPUs only).

    One ``NcclAllReduce`` per device and gradient (after packing); NCCL picks
    rings/trees over NVLink or PCIe itself (NVIDIA NCCL). ``tf.IndexedSlices``
    are gathered on one GPU and broadcast, since NCCL has no sparse form.

    K x N contract, K=2, N=2, sum::

        [[A, B],      ->   [[A+C, B+D],    # on devices[0]
         [C, D]]            [A+C, B+D]]    # on devices[1]

    The argument order follows tensorpack's ``allreduce_grads(all_grads,
    average)``, so positional calls written for it keep working.

    Args:
      all_grads: list of K lists of N gradients on K GPUs.
      average: bool. NCCL sums in the gradients' dtype, so with average=True
        each tower first multiplies its gradient by 1/K (Horovod's prescale):
        float16 sums cannot overflow where their mean does not.
      devices: list of K GPU device strings, or None for the tensors' devices.
      pack_bytes: int bytes or None; gradients under this size are packed
        into buffers of about this size (packing.PackPlan); default
        ``packing.DEFAULT_PACK_BYTES`` (64 KiB); None or 0 packs nothing.
      sparse_as_dense: bool; reduce IndexedSlices densely with NCCL.

    Returns:
      list[list[tf.Tensor]], K x N; ``out[k][n]`` on ``devices[k]``.

    Raises:
      ValueError: at build time if any device is not a GPU (naming them), or
        bad input (see ``contract.validate_grads``).
    """
    def reduce_dense(columns, devs):
        out = []
        num_towers = len(devs)
        for m, column in enumerate(columns):
            placed = []
            for k, (g, d) in enumerate(zip(column, devs)):
                with tf.device(d):
                    if average:
                        g = scale_by_reciprocal(g, num_towers)
                    placed.append(tf.identity(g, name=f"entry{m}_dev{k}_in"))
            out.append(list(_tf_nccl.all_sum(placed)))
        return out

    return run_allreduce(all_grads, devices, average, reduce_dense, scope="allreduce_nccl",
                         pack_bytes=pack_bytes, sparse_as_dense=sparse_as_dense,
                         check_devices=_require_gpus)


def allreduce_grads_collective(all_grads, devices=None, average=False, communication="auto",
                               pack_bytes=DEFAULT_PACK_BYTES, sparse_as_dense=False, keys=None,
                               timeout=None):
    """All-reduces K x N gradients with TF collective ops (``CollectiveReduceV2``).

    One ``CollectiveReduceV2`` per device and gradient (after packing); TF's
    collective runtime runs the reduction (a ring on CPUs, ring or NCCL on
    GPUs). Runs on CPUs and GPUs, eagerly (wrapped in a ``tf.function``
    here), in a ``tf.function`` or in a ``tf.compat.v1`` graph.

    The K ops of a reduction wait for each other, so the whole group must run
    together. A ``tf.function`` runs every collective it holds; in a
    ``tf.compat.v1.Session``, fetch or depend on all K outputs of a call,
    never some of them, or the step waits until ``timeout`` and fails. On each device the reductions are
    chained with control dependencies in one fixed order (and, in a
    ``tf.function``, through one ordering token per device), so all devices
    launch them in the same order and hundreds of them cannot deadlock on a
    few CPU threads.

    K x N contract, K=2, N=2, sum::

        [[A, B],      ->   [[A+C, B+D],    # on devices[0]
         [C, D]]            [A+C, B+D]]    # on devices[1]

    Args:
      all_grads: list of K lists of N gradients.
      devices: list of K device strings, or None for the tensors' devices.
      average: bool; each device multiplies its sum by 1/K (every device
        forms the sum, so there is no single place to do it once).
      communication: "auto", "ring" or "nccl" (TF's communication hint).
      pack_bytes: int bytes or None; gradients under this size are packed
        into buffers of about this size (packing.PackPlan); default
        ``packing.DEFAULT_PACK_BYTES`` (64 KiB); None or 0 packs nothing.
      sparse_as_dense: bool; reduce IndexedSlices densely.
      keys: CollectiveKeys or None (``CollectiveKeys.for_call`` of this
        call's graph, scope, devices and shapes).
      timeout: float seconds or None (wait forever) before a reduction whose
        peers do not arrive fails with DeadlineExceededError.

    Returns:
      list[list[tf.Tensor]], K x N; ``out[k][n]`` on ``devices[k]``.
      float16/bfloat16 are cast to float32 on each device before the
      reduction (twice the bytes, one rounding) and back after.

    Raises:
      ValueError: unknown communication, negative timeout, or bad input (see
        ``contract.validate_grads``).
    """
    if communication not in COMMUNICATIONS:
        raise ValueError(
            f"communication must be one of {COMMUNICATIONS}, got {communication!r}")
    if timeout is not None and timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {timeout}")

    def build():
        return run_allreduce(
            all_grads, devices, average,
            lambda columns, devs: _collective_columns(columns, devs, average, communication,
                                                      keys, timeout),
            scope="allreduce_collective", pack_bytes=pack_bytes,
            sparse_as_dense=sparse_as_dense)

    if tf.executing_eagerly():
        # Eagerly the op on device 0 would block before device 1's is issued.
        return tf.function(build, autograph=False)()
    return build()


def _collective_columns(columns, devices, average, communication, keys, timeout):
    num_towers = len(devices)
    if keys is None:
        # tf.function graphs have names; a v1 Graph (one Session) has none.
        graph = getattr(tf.compat.v1.get_default_graph(), "name", "")
        scope = tf.compat.v1.get_default_graph().get_name_scope()
        layout = [(c[0].dtype.name, str(c[0].shape)) for c in columns]
        keys = CollectiveKeys.for_call(f"{graph}|{scope}|{devices}|{layout}")
    group_key = keys.group_key(devices)
    tokens = []
    for k, d in enumerate(devices):
        with tf.device(d):
            # A resource handle per device: in a tf.function, automatic control
            # dependencies then order the collectives per device, not across
            # devices (which would serialise the group and deadlock).
            tokens.append(tf.raw_ops.VarHandleOp(
                dtype=tf.float32, shape=[], shared_name=f"tfreduce_order_{group_key}_{k}",
                name=f"dev{k}_order"))
    previous = [None] * num_towers
    out = []
    for m, column in enumerate(columns):
        instance_key = keys.instance_key()
        dtype = column[0].dtype
        acc = accumulation_dtype(dtype)
        result = []
        for k, (g, d) in enumerate(zip(column, devices)):
            deps = [] if previous[k] is None else [previous[k]]
            with tf.device(d), tf.control_dependencies(deps):
                x = tf.cast(g, acc) if acc != dtype else tf.identity(g)
                r = tf.raw_ops.CollectiveReduceV2(
                    input=x, group_size=num_towers, group_key=group_key,
                    instance_key=instance_key, ordering_token=[tokens[k]],
                    merge_op="Add", final_op="Id",
                    communication_hint=communication, timeout_seconds=timeout or 0,
                    name=f"entry{m}_dev{k}_allreduce")
                previous[k] = r
                if average:
                    r = scale_by_reciprocal(r, num_towers)
                result.append(tf.identity(tf.cast(r, dtype) if acc != dtype else r,
                                          name=f"entry{m}_dev{k}_out"))
        out.append(result)
    return out
