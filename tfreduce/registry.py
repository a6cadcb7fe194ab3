"""The algorithm registry: name -> Stage class, the options each takes, the default rule.

Every algorithm is a ``stage.Stage``; ``STAGES`` registers each once, by
name. The options an algorithm takes are its stage's constructor arguments
(``stage_options``), so no table repeats a signature; ``tfreduce.Reduction``
adds the frame's options, which every algorithm takes.
"""

import inspect

from tfreduce.choices import ALGORITHMS
from tfreduce.devices import is_gpu
from tfreduce.hierarchical import HierarchicalStage
from tfreduce.nccl_ops import CollectiveStage, NcclStage
from tfreduce.replicated import FlatStage
from tfreduce.ring import RingStage

__all__ = ["ALGORITHMS", "STAGES", "choose_algorithm", "make_stage", "stage_options"]

#: Algorithm name -> its Stage class.
STAGES = {stage.name: stage for stage in (FlatStage, HierarchicalStage, RingStage, NcclStage,
                                          CollectiveStage)}

# ALGORITHMS, the names ``allreduce_grads(algorithm=...)`` accepts, is
# spelled out in choices (the command lines need it before TensorFlow).
if ALGORITHMS != ("auto",) + tuple(STAGES):
    raise ImportError(f"choices.ALGORITHMS {ALGORITHMS} does not list the stages {tuple(STAGES)}")

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


def stage_options(algorithm):
    """The names of the options an algorithm's stage takes; () for "auto".

    Args:
      algorithm: a name in ALGORITHMS.

    Returns:
      tuple of str, e.g. ("groups",) for "hierarchical".
    """
    if algorithm == "auto":
        return ()
    return tuple(inspect.signature(STAGES[algorithm]).parameters)


def make_stage(algorithm, options):
    """The stage of a named algorithm (not "auto") with its own options.

    Args:
      algorithm: a name in STAGES.
      options: dict of the stage's constructor arguments (names from
        ``stage_options``), e.g. ``{"groups": [[0, 1], [2, 3]]}``.

    Returns:
      stage.Stage.

    Raises:
      ValueError, TypeError: a bad option value (the stage's constructor
        checks them).
    """
    return STAGES[algorithm](**options)
