"""The all-reduce implementations under test and the ones that cannot run here.

tfreduce's algorithms (unpacked and packed), tensorpack's
``allreduce_grads_hierarchical`` and tf.distribute's cross-device ops, each
behind one ``build(grads, devices, average) -> K x N`` callable.
"""

import tensorflow as tf

import tfreduce
from tfreduce.bench.units import format_bytes

__all__ = ["Contender", "contenders", "tfreduce_builder"]


class Contender:
    """One all-reduce implementation under test.

    Args:
      name: str, the row label.
      family: str, one of ``choices.BENCH_FAMILIES`` (what ``--contenders`` selects).
      description: str, what it builds.
      build: callable ``(grads, devices, average) -> K x N outputs``.
    """

    def __init__(self, name, family, description, build):
        self.name = name
        self.family = family
        self.description = description
        self.build = build


def tfreduce_builder(algorithm, pack_bytes):
    """A contender's build callable for ``tfreduce.allreduce_grads``.

    Args:
      algorithm: str, one of ``tfreduce.ALGORITHMS``.
      pack_bytes: int bytes, or None for no packing.

    Returns:
      callable ``(grads, devices, average) -> out``: grads K x N tensors,
      devices K strings, average bool; out[k][n] is the sum (mean) over k of
      grads[k][n], placed on devices[k].
    """
    def build(grads, devices, average):
        return tfreduce.allreduce_grads(grads, devices, average=average, algorithm=algorithm,
                                        pack_bytes=pack_bytes)
    return build


def _tensorpack_build(grads, devices, average):
    from tensorpack.graph_builder.utils import allreduce_grads_hierarchical
    return [list(row) for row in allreduce_grads_hierarchical(grads, devices, average=average)]


def _tf_distribute_builder(make_ops):
    def build(grads, devices, average):
        from tensorflow.python.distribute import values as values_lib
        per_variable = [values_lib.PerReplica([grads[k][n] for k in range(len(devices))])
                        for n in range(len(grads[0]))]
        op = tf.distribute.ReduceOp.MEAN if average else tf.distribute.ReduceOp.SUM
        # Destinations = the values themselves: an all-reduce, every device
        # gets the result, as MirroredStrategy reduces gradients.
        mirrored = make_ops().batch_reduce(op, [(v, v) for v in per_variable])
        return [[m.values[k] for m in mirrored] for k in range(len(devices))]
    return build


def contenders(num_devices, device_type, pack_sizes, packing="both"):
    """The contenders that can run here, and the others with the reason.

    Args:
      num_devices: int K.
      device_type: "cpu" or "gpu".
      pack_sizes: list of int, pack_bytes of the packed variants.
      packing: "both", "on" (packed variants only) or "off".

    Returns:
      (list of Contender, dict name -> reason skipped).
    """
    algorithms = ["flat", "hierarchical", "ring", "collective"]
    if device_type == "gpu":
        algorithms.append("nccl")
    out, skipped = [], {}
    for algorithm in algorithms:
        if packing in ("both", "off"):
            out.append(Contender(algorithm, algorithm, f"tfreduce {algorithm}, unpacked",
                                 tfreduce_builder(algorithm, None)))
        if packing in ("both", "on"):
            for size in pack_sizes:
                out.append(Contender(
                    f"{algorithm}+pack{format_bytes(size)}", algorithm,
                    f"tfreduce {algorithm}, pack_bytes={size}",
                    tfreduce_builder(algorithm, size)))
    try:
        import tensorpack.graph_builder.utils  # noqa: F401
    except ImportError as error:
        skipped["tensorpack"] = f"tensorpack is not installed ({error})"
    else:
        if num_devices == 8:
            out.append(Contender("tensorpack", "tensorpack",
                                 "tensorpack.graph_builder.utils.allreduce_grads_hierarchical",
                                 _tensorpack_build))
        else:
            skipped["tensorpack"] = f"asserts K == 8, here K = {num_devices}"
    if num_devices % 2 == 0:
        out.append(Contender(
            "tf-hierarchical-copy", "tf-hierarchical-copy",
            "tf.distribute.HierarchicalCopyAllReduce().batch_reduce (num_packs=1)",
            _tf_distribute_builder(tf.distribute.HierarchicalCopyAllReduce)))
    else:
        skipped["tf-hierarchical-copy"] = (
            f"splits the devices into two equal groups; with odd K = {num_devices} it "
            f"leaves one device out of the sum")
    out.append(Contender(
        "tf-reduction-to-one-device", "tf-reduction-to-one-device",
        "tf.distribute.ReductionToOneDevice().batch_reduce (sum on device 0)",
        _tf_distribute_builder(tf.distribute.ReductionToOneDevice)))
    return out, skipped
