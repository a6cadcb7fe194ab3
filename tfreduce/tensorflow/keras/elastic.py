"""Horovod's elastic Keras API (``horovod.tensorflow.keras.elastic``): KerasState and its callbacks.

``KerasState`` keeps a model, its optimizer and values such as the epoch
and batch; the callbacks keep them current while ``fit`` runs and commit
them, so that ``hvd.elastic.run`` resumes ``fit`` where the last commit
was, after a lost or added worker (``tfreduce.tensorflow.elastic``)::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(x, y, epochs=epochs - state.epoch, callbacks=callbacks)

The callbacks are of the Keras ``tf.keras`` is, as the others of
``tfreduce.tensorflow.keras.callbacks``.

Source: Horovod's horovod/_keras/elastic.py (the same callbacks and semantics).
"""

from tfreduce.tensorflow.elastic import (HostsUpdatedInterrupt, ObjectState, State,
                                         TensorFlowKerasState, TensorFlowState, run)
from tfreduce.tensorflow.keras.callbacks import Callback

__all__ = ["CommitStateCallback", "HostsUpdatedInterrupt", "KerasState", "ObjectState", "State",
           "TensorFlowKerasState", "TensorFlowState", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]


class KerasState(TensorFlowKerasState):
    """A Keras model, its optimizer (default: the model's) and values (TensorFlowKerasState)."""


class CommitStateCallback(Callback):
    """Commits `state` every `batches_per_commit` batches and at each epoch's end.

    A commit copies the model and optimizer (a few ms for a small model):
    commit less often than every batch for a large one; a failure loses the
    batches since the last commit.

    Args:
      state: a State.
      batches_per_commit: int >= 1.

    Raises:
      ValueError: batches_per_commit < 1.
    """

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(
                batches_per_commit, int) or batches_per_commit < 1:
            raise ValueError(f"CommitStateCallback: batches_per_commit must be an int >= 1, "
                             f"got {batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._left = batches_per_commit

    def on_train_begin(self, logs=None):
        self._left = self.batches_per_commit  # the same count on every worker after a sync

    def on_train_batch_end(self, batch, logs=None):
        self._left -= 1
        if self._left == 0:
            self._left = self.batches_per_commit
            self.commit()

    def on_epoch_end(self, epoch, logs=None):
        self.commit()

    def commit(self):
        """Commits the state (Horovod's hook: a subclass may count or time its commits)."""
        self.state.commit()


class UpdateBatchStateCallback(Callback):
    """Keeps ``state.batch`` at the last batch done (its index, as Horovod's).

    At each epoch's start it sets ``params["steps"]`` to the steps the
    epoch has left, as Horovod's does. Keras 3's ``fit`` does not read its
    steps back from there, so under Keras 3 the first epoch after a
    re-forming runs whole: pass ``steps_per_epoch`` less ``state.batch``
    to that ``fit`` to resume inside the epoch.
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._steps = None

    def on_train_begin(self, logs=None):
        self._steps = None

    def on_epoch_begin(self, epoch, logs=None):
        steps = self.params.get("steps") if self.params else None
        if steps:
            self._steps = self._steps or steps
            self.params["steps"] = self._steps - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(Callback):
    """Keeps ``state.epoch`` at the epochs done over the whole job, re-formings included.

    ``fit`` counts its epochs from 0 at every call; this adds the epochs
    done before, so ``epochs - state.epoch`` is what is left.
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._start = state.epoch

    def on_train_begin(self, logs=None):
        self._start = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._start + epoch + 1
