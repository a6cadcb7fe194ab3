"""The all-reduce implementations under test and the ones that cannot run here.

tfreduce's algorithms (unpacked and packed, uncompressed or with wire
compression or PowerSGD), tensorpack's ``allreduce_grads_hierarchical`` and
tf.distribute's cross-device ops, each behind one
``build(grads, devices, average) -> K x N`` callable.
"""

import tensorflow as tf

from tfreduce.algorithms.powersgd import PowerSGD, PowerSGDState, powersgd_allreduce
from tfreduce.basis.choices import bench_compression
from tfreduce.bench.units import format_bytes
from tfreduce.buffers.compression import Compression, as_compressor
from tfreduce.choice.reduction import Reduction

__all__ = ["COMPRESSION_ROUNDOFF", "Contender", "contenders", "parse_compression",
           "tfreduce_builder"]

#: Compressor name -> the relative rounding it adds to the result (the unit
#: roundoff of the wire dtype, for an input and for the result); PowerSGD
#: ("powersgdR", rank R) approximates and is not checked against NumPy.
COMPRESSION_ROUNDOFF = {Compression.none.name: 0.0, Compression.fp16.name: 2.0**-11,
                        Compression.bf16.name: 2.0**-8}


class Contender:
    """One all-reduce implementation under test.

    Args:
      name: str, the row label.
      family: str, one of ``choices.BENCH_FAMILIES`` (what ``--contenders`` selects).
      description: str, what it builds.
      build: callable ``(grads, devices, average) -> K x N outputs``.
      roundoff: float, the relative rounding the contender adds beyond the
        dtype's (0: exact up to the dtype), or None: an approximation, whose
        relative error is reported instead of checked.
      base: the name of the uncompressed contender it compresses, or None.
    """

    def __init__(self, name, family, description, build, roundoff=0.0, base=None):
        self.name = name
        self.family = family
        self.description = description
        self.build = build
        self.roundoff = roundoff
        self.base = base


def parse_compression(text):
    """A --compression item (``choices.bench_compression``) as the setting it names.

    Returns:
      a tfreduce.Compressor (Compression.none, .fp16, .bf16) or a
      tfreduce.PowerSGD; its ``name`` is the item.

    Raises:
      ValueError: an unknown item.
    """
    name, rank = bench_compression(text)
    return as_compressor(name) if rank is None else PowerSGD(rank=rank)


def tfreduce_builder(algorithm, pack_bytes, compression=Compression.none):
    """A contender's build callable for a ``tfreduce.Reduction``.

    Args:
      algorithm: str, one of ``tfreduce.ALGORITHMS``.
      pack_bytes: int bytes, or None for no packing.
      compression: a tfreduce.Compressor (wire compression) or a
        tfreduce.PowerSGD (its state made per build, starting from its seed).

    Returns:
      callable ``(grads, devices, average) -> out``: grads K x N tensors,
      devices K strings, average bool; out[k][n] is the sum (mean) over k of
      grads[k][n], placed on devices[k].
    """
    powersgd = compression if isinstance(compression, PowerSGD) else None
    reduction = Reduction(algorithm, pack_bytes=pack_bytes,
                          compression=None if powersgd else compression)

    def build(grads, devices, average):
        def allreduce(all_grads, mean):
            return reduction(all_grads, devices, average=mean)
        if powersgd is None:
            return allreduce(grads, average)
        state = PowerSGDState(powersgd, devices, grads[0])
        return powersgd_allreduce(grads, state, allreduce, average, len(devices))
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


def contenders(num_devices, device_type, pack_sizes, packing="both", compressions=("none",)):
    """The contenders that can run here, and the others with the reason.

    Args:
      num_devices: int K.
      device_type: "cpu" or "gpu".
      pack_sizes: list of int, pack_bytes of the packed variants.
      packing: "both", "on" (packed variants only) or "off".
      compressions: --compression items; every tfreduce variant runs with
        each ("none": uncompressed, named without a suffix).

    Returns:
      (list of Contender, dict name -> reason skipped).
    """
    algorithms = ["flat", "hierarchical", "ring", "collective"]
    if device_type == "gpu":
        algorithms.append("nccl")
    out, skipped = [], {}
    for algorithm in algorithms:
        variants = []
        if packing in ("both", "off"):
            variants.append((algorithm, f"tfreduce {algorithm}, unpacked", None))
        if packing in ("both", "on"):
            variants += [(f"{algorithm}+pack{format_bytes(size)}",
                          f"tfreduce {algorithm}, pack_bytes={size}", size) for size in pack_sizes]
        for name, description, size in variants:
            for text in compressions:
                setting = parse_compression(text)
                if setting is Compression.none:
                    out.append(Contender(name, algorithm, description,
                                         tfreduce_builder(algorithm, size)))
                    continue
                out.append(Contender(
                    f"{name}+{setting.name}", algorithm,
                    f"{description}, compression={setting!r}",
                    tfreduce_builder(algorithm, size, setting),
                    roundoff=COMPRESSION_ROUNDOFF.get(setting.name), base=name))
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
