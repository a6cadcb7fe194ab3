"""One process as a cluster of one worker: the null object of ``tfreduce.Cluster``.

The trainer, the multi-worker broadcast and ``tfreduce.Reduction`` take a
cluster and call the same methods on it whether the run spans several
workers or one process; a ``LocalCluster`` answers them for one process
(rank 0 of one worker, no server, nothing to wait for), so none of them
branches on "is there a cluster".
"""

import contextlib

from tfreduce.basis.devices import normalize_device

__all__ = ["LocalCluster"]


class LocalCluster:
    """This process alone: one worker, rank 0, its own devices, no server.

    Attributes:
      is_local: True; a ``tfreduce.Cluster`` has False (its reductions cross
        workers).
      num_workers: 1.
      rank: 0.
      is_chief: True: this process writes checkpoints and logs.
      watchdog: None: no peer to watch (``tfreduce.workers.watchdog``).
    """

    is_local = True
    num_workers = 1
    rank = 0
    is_chief = True
    watchdog = None

    def __repr__(self):
        return "LocalCluster()"

    def start(self):
        """Nothing to start; returns self."""
        return self

    def finish(self, session=None, linger=0.5):
        """Nothing to wait for: no other worker needs this one's answers."""
        del session, linger

    def detect_lost_workers(self, probe_timeout=5.0):
        """A context that does nothing: no worker can be lost."""
        del probe_timeout
        return contextlib.nullcontext()

    def order_after(self, tensors):
        """[]: one process's collectives wait for no other worker's, in any order."""
        del tensors
        return []

    def agreed(self, summed, here):
        """Whether to act on a flag: raised in the last step, or `here` since (no one to tell)."""
        return summed > 0 or bool(here)

    def describe(self, rank):
        """The process as messages name it."""
        del rank
        return "this process"

    def describe_towers(self, towers_per_worker):
        """The towers as messages name them, e.g. "4 towers"."""
        return f"{towers_per_worker} towers"

    def device(self, device, where="device"):
        """The canonical name of one of this process's devices.

        Raises:
          TypeError, ValueError: as ``devices.normalize_device``.
        """
        return normalize_device(device, where)

    def devices(self, devices):
        """``device`` applied to a list."""
        return [self.device(d, where=f"devices[{k}]") for k, d in enumerate(devices)]

    def batch_slice(self, batch_size, towers_per_worker):
        """The whole global batch: (0, batch_size)."""
        del towers_per_worker
        return 0, batch_size
