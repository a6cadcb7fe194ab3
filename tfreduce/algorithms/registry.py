"""The algorithm registry: name -> Stage class, the options each takes, the default rule.

Every algorithm is a ``stage.Stage``; ``STAGES`` registers each once, by
name, importing the class ``choices.STAGE_CLASSES`` names (the command
lines read the names there before TensorFlow is imported). The options an
algorithm takes are its stage's constructor arguments (``stage_options``),
so no table repeats a signature; ``tfreduce.Reduction`` adds the frame's
options, which every algorithm takes.
"""

import importlib
import inspect

from tfreduce.basis.choices import ALGORITHMS, STAGE_CLASSES
from tfreduce.basis.devices import is_gpu

__all__ = ["ALGORITHMS", "STAGES", "choose_algorithm", "make_stage", "stage_options"]


def _stage_class(name, path):
    """The Stage class "module:Class" names; ImportError unless its ``name`` is `name`."""
    module, attribute = path.split(":")
    cls = getattr(importlib.import_module(module), attribute)
    if cls.name != name:
        raise ImportError(f"choices.STAGE_CLASSES[{name!r}] is {path}, whose name is "
                          f"{cls.name!r}")
    return cls


#: Algorithm name -> its Stage class, in the order of ``ALGORITHMS``.
STAGES = {name: _stage_class(name, path) for name, path in STAGE_CLASSES.items()}


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
