"""The algorithm registry: name -> Stage class, the options each takes, the default rule.

Every algorithm is a ``frame.Stage``; ``STAGES`` registers each once, by
name. The options an algorithm takes are its stage's constructor arguments
plus the frame's (``pack_bytes``, ``sparse_as_dense``, ``compression``), so
no table repeats a signature.
"""

import inspect

from tfreduce.choices import ALGORITHMS, DEFAULT_PACK_BYTES
from tfreduce.devices import is_gpu
from tfreduce.hierarchical import HierarchicalStage
from tfreduce.nccl_ops import CollectiveStage, NcclStage
from tfreduce.replicated import FlatStage
from tfreduce.ring import RingStage

__all__ = ["ALGORITHMS", "STAGES", "FRAME_OPTIONS", "choose_algorithm", "frame_options",
           "make_stage"]

#: Algorithm name -> its Stage class.
STAGES = {stage.name: stage for stage in (FlatStage, HierarchicalStage, RingStage, NcclStage,
                                          CollectiveStage)}

# ALGORITHMS, the names ``allreduce_grads(algorithm=...)`` accepts, is
# spelled out in choices (the command lines need it before TensorFlow).
if ALGORITHMS != ("auto",) + tuple(STAGES):
    raise ImportError(f"choices.ALGORITHMS {ALGORITHMS} does not list the stages {tuple(STAGES)}")

#: Options of the frame, which every algorithm takes.
FRAME_OPTIONS = ("pack_bytes", "sparse_as_dense", "compression")


def choose_algorithm(devices):
    """The algorithm ``"auto"`` picks for these (canonical) devices.

    - K == 1: "flat" (an identity per gradient);
    - every device a GPU: "nccl", which uses NVLink/PCIe topology itself
      (tf.distribute's MirroredStrategy makes the same default);
    - otherwise (CPUs, or a mix): "flat". Logical CPU devices share one
      memory, where a reduction costs memory passes, and reducing each
      gradient once on one device makes the fewest (see the benchmark).

    Args:
      devices: list of K canonical device strings.

    Returns:
      str, a name in ALGORITHMS other than "auto".
    """
    if len(devices) > 1 and all(is_gpu(d) for d in devices):
        return "nccl"
    return "flat"


def make_stage(algorithm, options):
    """The stage of a named algorithm (not "auto") with its options.

    Args:
      algorithm: a name in STAGES.
      options: dict of the stage's constructor arguments, e.g.
        ``{"groups": [[0, 1], [2, 3]]}``; frame options are ignored here.

    Returns:
      frame.Stage.

    Raises:
      TypeError: an option neither the stage nor the frame takes.
      ValueError: a bad option value (from the stage's constructor).
    """
    stage = STAGES[algorithm]
    own = set(inspect.signature(stage).parameters)
    unknown = sorted(set(options) - own - set(FRAME_OPTIONS))
    if unknown:
        raise TypeError(
            f"algorithm {algorithm!r} takes no option {unknown}; it takes "
            f"{sorted(own | set(FRAME_OPTIONS))}")
    return stage(**{name: value for name, value in options.items() if name in own})


def frame_options(options):
    """The frame's keyword arguments (``frame.run_stages``) from an algorithm's options.

    Args:
      options: dict of allreduce_grads options; a missing ``pack_bytes`` is
        DEFAULT_PACK_BYTES (None packs nothing).

    Returns:
      dict with pack_bytes, sparse_as_dense and compression.
    """
    return {"pack_bytes": options.get("pack_bytes", DEFAULT_PACK_BYTES),
            "sparse_as_dense": options.get("sparse_as_dense", False),
            "compression": options.get("compression")}
