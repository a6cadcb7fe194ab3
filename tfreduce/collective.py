"""TF collective ops: the one place tfreduce builds them.

TF's collective ops (``CollectiveReduceV2``, ``CollectiveBcastSendV2`` /
``RecvV2``) are groups of ops, one per member device, that meet in TF's
collective runtime: a ring on CPUs, ring or NCCL on GPUs, over TF's gRPC
cluster between hosts. They are the engine of MultiWorkerMirroredStrategy.
"""

import zlib

__all__ = ["COMMUNICATIONS", "CollectiveKeys"]

#: TF's communication hints for collective ops.
COMMUNICATIONS = ("auto", "ring", "nccl")


class CollectiveKeys:
    """Group and instance keys of TF collective ops, owned by the caller.

    Every collective op carries a group key (which devices take part) and an
    instance key (which of the group's reductions this is); the K ops of one
    reduction share both. TF's runtime remembers each instance key's shape
    and dtype for the life of the process, and two reductions with one key in
    the same step would meet each other, so a program that builds several
    collective reductions passes one ``CollectiveKeys`` to all of them (a
    trainer owns one) and gets keys unique for the process. Group keys are
    derived from the device list, so the same devices always get the same
    group.

    Args:
      first_instance_key: int >= 1, the first instance key handed out.
    """

    def __init__(self, first_instance_key=1):
        if first_instance_key < 1:
            raise ValueError(f"first_instance_key must be >= 1, got {first_instance_key}")
        self._next = first_instance_key

    @staticmethod
    def group_key(devices):
        """A positive int32 key determined by the ordered device list."""
        return zlib.crc32("|".join(devices).encode()) & 0x3FFFFFFF or 1

    @classmethod
    def for_call(cls, text):
        """Keys for one call made without a ``CollectiveKeys``.

        The first key is a hash of ``text`` (graph, scope, devices and entry
        shapes), so the same program builds the same keys on every worker,
        and calls that differ in any of those draw their keys from unrelated
        places in a 2**30 range (two calls of M keys collide with probability
        about 2M / 2**30).
        """
        return cls(first_instance_key=(zlib.crc32(text.encode()) & 0x3FFFFFFF) + 1)

    def instance_key(self):
        """A new instance key."""
        key = self._next
        self._next += 1
        return key
