"""Checkpoints of a replicated run: tower 0's state and the step counter.

Tower 0's model and optimizer describe the whole run, since the replicas are
equal; the step counter tells `fit` where to continue. Saves never overwrite
the files the index names, so a crash during a save leaves the previous
checkpoint as the latest.
"""

import os
import re

import tensorflow as tf

_CHECKPOINT_NAME = "ckpt"
_CHECKPOINTS_KEPT = 3


class TrainerCheckpoint:
    """The checkpoint of tower 0's model and optimizer and the step counter.

    Args:
      model: keras.Model, tower 0's replica, built.
      optimizer: tower 0's Keras optimizer, built.
      step: the int64 step counter tf.Variable.
    """

    def __init__(self, model, optimizer, step):
        # The explicit variable list adds what Keras does not track for
        # checkpoints (the random state of Dropout layers), which an exact
        # resume needs.
        self._checkpoint = tf.train.Checkpoint(
            model=model,
            optimizer=optimizer,
            model_variables=list(model.variables),
            step=step,
        )

    def save(self, path):
        """Writes checkpoint `ckpt-<n>` under `path` with a fresh n; returns its prefix.

        tf.train.CheckpointManager writes the checkpoint's files and only then
        rewrites the `checkpoint` index file, atomically. The three newest
        checkpoints are kept.

        Args:
          path: str, checkpoint directory (created if missing).
        """
        os.makedirs(path, exist_ok=True)
        manager = tf.train.CheckpointManager(
            self._checkpoint,
            path,
            max_to_keep=_CHECKPOINTS_KEPT,
            checkpoint_name=_CHECKPOINT_NAME,
        )
        used = [
            int(match.group(1))
            for name in os.listdir(path)
            if (match := re.fullmatch(rf"{_CHECKPOINT_NAME}-(\d+)\.index", name))
        ]
        # A fresh number, so the files the index currently names are never
        # overwritten while it still names them.
        return manager.save(checkpoint_number=max(used, default=0) + 1)

    def restore(self, prefix):
        """Reads checkpoint `prefix` into the model, optimizer and step counter.

        Raises:
          ValueError: the checkpoint does not match the objects (another model).
        """
        status = self._checkpoint.restore(prefix)
        try:
            status.assert_existing_objects_matched()
        except AssertionError as error:
            raise ValueError(
                f"restore: checkpoint {prefix!r} does not match this trainer's model: {error}"
            ) from None


def find_prefix(path):
    """The prefix of the latest checkpoint in directory `path`, or `path` itself.

    Raises:
      FileNotFoundError: there is no checkpoint at path.
    """
    prefix = tf.train.latest_checkpoint(path) if os.path.isdir(path) else path
    if prefix is None or not tf.io.gfile.exists(prefix + ".index"):
        raise FileNotFoundError(
            f"restore: no checkpoint at {path!r} (neither a checkpoint directory nor prefix)"
        )
    return prefix
