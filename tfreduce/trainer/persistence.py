"""The checkpoint methods of ReplicatedTrainer: save and restore."""

from tfreduce.trainer.checkpoints import find_prefix, read_counters


class Persistence:
    """The checkpoint methods of ReplicatedTrainer (a base class of it).

    They use the trainer's ``_built(what)``, ``_checkpoint``, ``_steps``,
    ``_step`` and ``_epoch_totals`` counters, ``_cluster`` and
    ``_pending_restore``, which ReplicatedTrainer sets.
    """

    def save(self, path):
        """Writes a checkpoint of tower 0's model, the optimizers' state, the counters.

        `path` is a directory. Each save writes a new checkpoint `ckpt-<n>`
        and only then, atomically, the index file that names the latest
        (tf.train.CheckpointManager), so a crash during a save leaves the
        previous one as the latest. The three newest are kept. The
        optimizers' state is kept in a layout that any number of towers and
        any zero_stage resume from (docs/zero.md); each tower's own state
        (accumulated gradients, PowerSGD's) per tower. In a cluster only
        rank 0 writes; with ZeRO, call it on every worker (as `fit` does):
        every worker's shards are gathered for it.

        Args:
          path: str, checkpoint directory (created if missing).

        Returns:
          str, the prefix of the checkpoint written; None on the other ranks
          of a cluster.

        Raises:
          ValueError: the models are not built yet (no batch seen).
          FloatingPointError: a variable holds NaN or Inf: nothing is written.
        """
        self._built("save")
        return self._checkpoint.save(path)

    def restore(self, path):
        """Restores a checkpoint written by `save` and broadcasts it to all towers.

        `fit` with the same data and arguments then continues the run
        exactly. In a cluster, call it on every worker: rank 0 reads the
        checkpoint and broadcasts it (with ZeRO, each tower keeps its ranges).

        Args:
          path: str, a checkpoint directory (its newest intact checkpoint is
            used: each is read whole first, and a damaged one is passed over
            with a line on stderr) or the prefix of one ("dir/ckpt-3").

        Returns:
          str, the prefix restored; None on the other ranks of a cluster.

        Raises:
          FileNotFoundError: there is no checkpoint at path (rank 0).
          ValueError: every checkpoint at path is damaged (each named), or it
            does not match this trainer's model.
        """
        # The other ranks ("") receive rank 0's values with the broadcast.
        return self._restore_prefix(find_prefix(path) if self.is_chief else "")

    def _restore_prefix(self, prefix):
        """restore of checkpoint `prefix` on rank 0 ("" on the others, and on rank 0 for none)."""
        if self._steps is None:
            # The counters now, for fit; the rest once a batch builds the models.
            read_counters(prefix, self._step, self._epoch_totals, self._cluster)
            self._pending_restore = prefix
            return prefix or None
        self._checkpoint.restore(prefix)
        self._steps.broadcast()
        self._checkpoint.finish_restore()
        return prefix or None
