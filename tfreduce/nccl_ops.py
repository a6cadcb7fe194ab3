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

from tfreduce.collective import CollectiveChain, CollectiveKeys, CollectiveOptions, check_keys
from tfreduce.devices import is_gpu
from tfreduce.stage import Stage
from tfreduce.primitives import accumulation_dtype, scale_by_reciprocal

__all__ = ["NcclStage", "CollectiveStage"]


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
        self.keys = check_keys(keys)

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
                # Compressed (ctx.wire_sum): 16 bits cross (means when
                # averaging: the frame prescaled the inputs). Otherwise half
                # types go up to float32 first and the sum is scaled once.
                in_wire = ctx.wire_sum and g.dtype != accumulation_dtype(g.dtype)
                acc = g.dtype if in_wire else accumulation_dtype(g.dtype)
                with chain.after_previous(d):
                    x = tf.cast(g, acc) if acc != g.dtype else tf.identity(g)
                    r = chain.all_reduce(x, d, num_towers, group_key, instance_key,
                                         name=f"entry{m}_dev{k}_allreduce")
                out[k][m] = ctx.finish(r, m, num_towers, d, name=f"entry{m}_dev{k}_out")
        return out
