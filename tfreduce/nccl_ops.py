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

from tfreduce.collective import CollectiveChain, CollectiveKeys, CollectiveOptions
from tfreduce.devices import is_gpu
from tfreduce.frame import Stage, run_stage
from tfreduce.packing import DEFAULT_PACK_BYTES
from tfreduce.primitives import accumulation_dtype, finish_sum, scale_by_reciprocal

__all__ = ["NcclStage", "CollectiveStage", "allreduce_grads_nccl", "allreduce_grads_collective"]


def allreduce_grads_nccl(all_grads, average=False, devices=None, pack_bytes=DEFAULT_PACK_BYTES,
                         sparse_as_dense=False, compression=None):
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
      compression: None, "fp16" or "bf16" (NCCL has no bfloat16: a TypeError): float32/float64 gradients are
        cast to that 16-bit dtype on their tower before crossing devices and
        cast back on each tower after (``frame.COMPRESSIONS``).

    Returns:
      list[list[tf.Tensor]], K x N; ``out[k][n]`` on ``devices[k]``.

    Raises:
      ValueError: at build time if any device is not a GPU (naming them), or
        bad input (see ``contract.validate_grads``).
    """
    return run_stage(NcclStage(), all_grads, devices, average, pack_bytes, sparse_as_dense,
                     compression)


class NcclStage(Stage):
    """Per entry: one ``NcclAllReduce`` per device (``nccl_ops.all_sum``), GPUs only."""

    name = "nccl"
    collective = True
    # NcclAllReduce's kernels; it sums in the input dtype, so no bfloat16.
    dtypes = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)

    def bind(self, devices):
        others = [d for d in devices if not is_gpu(d)]
        if others:
            raise ValueError(
                f"NCCL runs only on GPUs, but devices {others} are not GPUs: use "
                f"algorithm='collective', 'flat' or 'hierarchical' there")
        return self

    def reduce(self, buffers, ctx):
        num_towers = len(ctx.devices)
        columns = []  # M x K
        for m in range(len(buffers[0])):
            placed = []
            for k, d in enumerate(ctx.devices):
                with tf.device(d):
                    g = buffers[k][m]
                    if ctx.average:
                        # NCCL sums in the input dtype: prescale (Horovod's
                        # prescale), so a float16 sum cannot overflow.
                        g = scale_by_reciprocal(g, num_towers)
                    placed.append(tf.identity(g, name=f"entry{m}_dev{k}_in"))
            columns.append(_tf_nccl.all_sum(placed))
        return [list(row) for row in zip(*columns)]  # K x M


def allreduce_grads_collective(all_grads, devices=None, average=False, communication="auto",
                               pack_bytes=DEFAULT_PACK_BYTES, sparse_as_dense=False, keys=None,
                               timeout=None, compression=None):
    """All-reduces K x N gradients with TF collective ops (``CollectiveReduceV2``).

    One ``CollectiveReduceV2`` per device and gradient (after packing); TF's
    collective runtime runs the reduction (a ring on CPUs, ring or NCCL on
    GPUs). Runs on CPUs and GPUs, eagerly (wrapped in a ``tf.function``
    here), in a ``tf.function`` or in a ``tf.compat.v1`` graph.

    The K ops of a reduction wait for each other, so the whole group must run
    together. A ``tf.function`` runs every collective it holds; in a
    ``tf.compat.v1.Session``, fetch or depend on all K outputs of a call,
    never some of them, or the step waits until ``timeout`` and fails. On
    each device the reductions are chained in one fixed order
    (``collective.CollectiveChain``), so hundreds of them cannot deadlock on
    a few CPU threads.

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
      compression: None, "fp16" or "bf16": float32/float64 gradients are
        cast to that 16-bit dtype on their tower before crossing devices and
        cast back on each tower after; the collective then sums in 16 bits,
        each input prescaled by 1/K when averaging (Horovod's prescale).
      keys: CollectiveKeys or None (``CollectiveKeys.for_call`` of this
        call's graph, scope, devices and shapes).
      timeout: float seconds > 0 before a reduction whose peers do not
        arrive fails with DeadlineExceededError, or None to wait forever
        (``collective.check_timeout``: 0 is refused).

    Returns:
      list[list[tf.Tensor]], K x N; ``out[k][n]`` on ``devices[k]``.
      float16/bfloat16 are cast to float32 on each device before the
      reduction (twice the bytes, one rounding) and back after.

    Raises:
      ValueError: unknown communication, a timeout that is neither None nor
        > 0, or bad input (see ``contract.validate_grads``).
    """
    # The options are checked before the input, as the stage is built first.
    return run_stage(CollectiveStage(communication, keys, timeout), all_grads, devices,
                     average, pack_bytes, sparse_as_dense, compression)


class CollectiveStage(Stage):
    """Per entry: one ``CollectiveReduceV2`` per device, chained per device.

    Args:
      communication: "auto", "ring" or "nccl", TF's communication hint.
      keys: CollectiveKeys, or None for ``CollectiveKeys.for_call`` of the
        call's graph, scope, devices and entry shapes.
      timeout: float seconds > 0, or None to wait forever.

    Raises:
      ValueError: unknown communication, or a timeout that is not None or > 0.
      TypeError: keys that are not a CollectiveKeys.
    """

    name = "collective"
    collective = True
    needs_function = True
    # CollectiveReduceV2's kernels, after half types go up to float32.
    dtypes = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)

    def __init__(self, communication="auto", keys=None, timeout=None):
        self.options = CollectiveOptions(communication, timeout)
        if keys is not None and not isinstance(keys, CollectiveKeys):
            raise TypeError(f"keys must be a tfreduce.CollectiveKeys or None, got "
                            f"{type(keys).__name__} {keys!r}")
        self.keys = keys

    def reduce(self, buffers, ctx):
        devices = ctx.devices
        num_towers = len(devices)
        keys = self.keys
        if keys is None:
            # The graph object too: two tf.functions of one name, scope and
            # layout (unknown shapes print alike) must not share keys, since
            # TF remembers each key's shape for the life of the process. The
            # K members of this group are all in this process, so keys need
            # not agree with any other process.
            graph = tf.compat.v1.get_default_graph()
            layout = [(t.dtype.name, str(t.shape)) for t in buffers[0]]
            keys = CollectiveKeys.for_call(
                f"{getattr(graph, 'name', '')}|{id(graph)}|{graph.get_name_scope()}|"
                f"{devices}|{layout}")
        group_key = keys.group_key(devices)
        chain = CollectiveChain(self.options)
        for k, d in enumerate(devices):
            chain.token(d, f"tfreduce_order_{group_key}_{k}", f"dev{k}_order")
        out = [[None] * len(buffers[0]) for _ in range(num_towers)]  # K x M
        for m in range(len(buffers[0])):
            instance_key = keys.instance_key()  # one per entry, shared by its K ops
            for k, d in enumerate(devices):
                g = buffers[k][m]
                # Compressed (ctx.wire_sum): 16 bits cross, prescaled by 1/K
                # (Horovod's prescale), so the sum is of means and cannot
                # overflow where the mean does not. Otherwise half types go
                # up to float32 first and the sum is scaled once.
                in_wire = ctx.wire_sum and g.dtype != accumulation_dtype(g.dtype)
                acc = g.dtype if in_wire else accumulation_dtype(g.dtype)
                with chain.after_previous(d):
                    if in_wire and ctx.average:
                        x = scale_by_reciprocal(g, num_towers)
                    else:
                        x = tf.cast(g, acc) if acc != g.dtype else tf.identity(g)
                    r = chain.all_reduce(x, d, num_towers, group_key, instance_key,
                                         name=f"entry{m}_dev{k}_allreduce")
                name = f"entry{m}_dev{k}_out"
                out[k][m] = (finish_sum(r, ctx.dtypes[m], num_towers, False, d, name) if in_wire
                             else ctx.finish(r, m, num_towers, d, name=name))
        return out
