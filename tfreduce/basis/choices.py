"""The choices the command lines offer, known before TensorFlow is imported.

Standard library only, so that ``--help`` and argument errors of the
example, ``tfreduce-bench`` and ``tfreduce-launch`` answer at once (importing
TensorFlow takes seconds). The modules that implement a choice import it
from here; ``registry`` imports the stage classes ``STAGE_CLASSES`` names.
"""

import re

from tfreduce.basis.collective_rules import COLLECTIVE_RULES

__all__ = ["ALGORITHMS", "BENCH_FAMILIES", "COLLECTIVES", "DEFAULT_PACK_BYTES",
           "GPU_ONLY_ALGORITHMS", "STAGE_CLASSES", "bench_compression"]

#: The algorithms: each name's ``stage.Stage`` class as "module:Class", which
#: ``registry.STAGES`` imports. A new algorithm is its module and a line here.
STAGE_CLASSES = {
    "flat": "tfreduce.algorithms.replicated:FlatStage",
    "hierarchical": "tfreduce.algorithms.hierarchical:HierarchicalStage",
    "ring": "tfreduce.algorithms.ring:RingStage",
    "nccl": "tfreduce.algorithms.nccl_ops:NcclStage",
    "collective": "tfreduce.algorithms.nccl_ops:CollectiveStage",
}

#: Names ``allreduce_grads(algorithm=...)`` accepts: "auto" and one per stage.
ALGORITHMS = ("auto",) + tuple(STAGE_CLASSES)

#: The collectives besides all-reduce (``tfreduce.doors.collectives``; all-reduce
#: is ``tfreduce.allreduce_grads``): one per row of ``COLLECTIVE_RULES``.
COLLECTIVES = tuple(COLLECTIVE_RULES)

#: Algorithms that run on GPUs only.
GPU_ONLY_ALGORITHMS = ("nccl",)

#: The recommended ``pack_bytes``: gradients under 64 KiB are fused. Chosen
#: with ``tfreduce-bench --pack-bytes 16KiB,64KiB,256KiB,1MiB,4MiB`` (K=8
#: logical CPU devices, ResNet50's 214 tensors, mean). At 102 MB per tower it
#: was the fastest size for flat (23% faster than unpacked) and as fast as
#: 256 KiB-1 MiB for hierarchical; 4 MiB and more were no faster than no
#: packing, since packing copies every packed byte twice (concat and split),
#: which pays only for tensors small enough that per-op cost dominates. With
#: the tensors shrunk to 1 MB, every size from 64 KiB up was about 3x faster than
#: unpacked. The ring, whose op count grows as K^2 per buffer, and links
#: between GPUs favour larger buffers: pass ``pack_bytes=`` to choose.
DEFAULT_PACK_BYTES = 64 * 2**10

#: What ``tfreduce-bench --contenders`` selects: tfreduce's algorithms and
#: the peers' (tensorpack, tf.distribute).
BENCH_FAMILIES = ("flat", "hierarchical", "ring", "collective", "nccl", "tensorpack",
                  "tf-hierarchical-copy", "tf-reduction-to-one-device")


def bench_compression(text):
    """A ``tfreduce-bench --compression`` item: "none", "fp16", "bf16" or "powersgdR".

    Returns:
      (name, rank): ("none", None), ("fp16", None), ("bf16", None) or
      ("powersgd", R) with R >= 1.

    Raises:
      ValueError: anything else.
    """
    match = re.fullmatch(r"(none|fp16|bf16)|powersgd([1-9][0-9]*)", text)
    if not match:
        raise ValueError(f"unknown compression {text!r}; use none, fp16, bf16 or powersgdR "
                         "(R the rank, e.g. powersgd4)")
    return (match.group(1), None) if match.group(1) else ("powersgd", int(match.group(2)))
