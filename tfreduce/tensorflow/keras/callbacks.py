"""Horovod's Keras callbacks: the first broadcast, averaged metrics, learning-rate warmup.

One more of tfreduce's own: WorkerTimesCallback writes each worker's time
inside its batches to TensorBoard, so a straggler shows there too.

They are callbacks of the Keras ``tf.keras`` is when this module is
imported (``basis.kerases.tf_keras``: Keras 2 under
``TF_USE_LEGACY_KERAS=1``), as Horovod's were: each Keras' ``fit`` calls
hooks that only its own ``Callback`` class has.

Sources: Horovod's horovod.tensorflow.keras.callbacks; the warmup of Goyal et
al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (2017):
the learning rate rises linearly from initial_lr / size to initial_lr.
"""

import os
import time
import warnings

import tensorflow as tf

from tfreduce.basis import kerases
from tfreduce.tensorflow.keras.data import follow_fit_epoch
from tfreduce.tensorflow.keras.optimizer import describe_optimizer, own_sums
from tfreduce.tensorflow.ops import allgather, broadcast, broadcast_variables, grouped_allreduce
from tfreduce.tensorflow.process import cluster, rank, size
from tfreduce.workers.consistency import check_workers_agree, describe_variables
from tfreduce.workers.progress import progress

# The base of every callback here (see the module docstring).
Callback = kerases.tf_keras().callbacks.Callback

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "WorkerTimesCallback"]


class BroadcastGlobalVariablesCallback(Callback):
    """Makes every process start from root_rank's model and optimizer state.

    The variables of the model and of its optimizer are broadcast from
    root_rank twice in the first ``fit``: at its start when the model is
    built by then (so even the first update equals a single process's), and
    after its first batch, as Horovod does (so a model built on its first
    batch, a Sequential without ``keras.Input`` or a subclassed model, and a
    restore by a callback placed after this one are covered too). Before
    the first broadcast every process checks that all have the same
    variables and optimizer settings: a process that built another model
    fails on every process with a ValueError naming the ranks and the first
    difference, instead of hanging in a collective.

    A run resumed on root_rank only (Keras' ``BackupAndRestore`` on that
    rank, placed before this callback) resumes on every process: the epoch
    it restored is broadcast at the start of ``fit``. If the processes still
    start ``fit`` at different epochs (a restore placed after this callback
    on some ranks only), every process raises a ValueError naming each
    rank's epoch before the first batch, instead of hanging. While ``fit``
    runs, ``DistributedBatches`` follow its epoch.

    Args:
      root_rank: int, the rank whose values every process takes.
      device: Horovod's device hint (unused).
      local_variables: variables left out of the broadcast (a variable or a
        list of them).
    """

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        del device
        self.root_rank = root_rank
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, (list, tuple)):
            local_variables = [local_variables]
        self._local = {id(v) for v in local_variables}
        self.broadcast_done = False
        self._first_epoch = False  # the next on_epoch_begin is fit's first
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        if self._first_epoch:
            self._first_epoch = False
            _check_same_epoch(epoch)
        follow_fit_epoch(epoch)
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        # What this process's heartbeats tell the others (tfreduce.workers.watchdog).
        progress.doing = f"fit, epoch {self._epoch + 1}, batch {batch + 1}"
        self._batch_start = time.monotonic()

    def on_train_end(self, logs=None):
        follow_fit_epoch(None)

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        self._first_epoch = True
        # The epoch a BackupAndRestore on the root restored (Keras keeps it
        # in the model's _initial_epoch for fit's loop, read after this).
        start = getattr(self.model, "_initial_epoch", None)
        start = int(broadcast(tf.constant(-1 if start is None else start, tf.int64),
                              self.root_rank))
        self.model._initial_epoch = None if start < 0 else start
        if self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        # The batch's time from this callback's begin to its end: the
        # straggler report compares it (tfreduce.workers.watchdog.progress.timed).
        progress.durations.append(time.monotonic() - self._batch_start)
        progress.advance()
        progress.doing = None
        if not self.broadcast_done:
            # The model and optimizer exist now, and every callback's restore is done.
            self._broadcast(mid_cycle=True)
            self.broadcast_done = True

    def _broadcast(self, mid_cycle=False):
        variables = list(self.model.variables)
        optimizer = self.model.optimizer
        local = set(self._local)
        if optimizer is not None:
            # Its slots too, made now: a root that restored them sends them.
            variables += kerases.optimizer_variables(optimizer, self.model.trainable_variables)
            if mid_cycle:
                # After a batch, each process's own gradient sums of
                # backward_passes_per_step hold its own batches: they stay.
                local.update(id(v) for v in own_sums(optimizer))
        variables = [v for v in variables if id(v) not in local]
        check_workers_agree(cluster(), 1, describe_optimizer(optimizer),
                            describe_variables(variables))
        broadcast_variables(variables, self.root_rank)


def _check_same_epoch(epoch):
    """Raises ValueError on every process unless all begin fit at `epoch`."""
    epochs = allgather(tf.constant([epoch], tf.int64)).numpy().tolist()
    if len(set(epochs)) > 1:
        starts = ", ".join(f"rank {r} at epoch {e + 1}" for r, e in enumerate(epochs))
        raise ValueError(
            f"fit begins {starts}: a callback restored a checkpoint on some ranks only, after "
            "BroadcastGlobalVariablesCallback sent the first epoch; put BackupAndRestore "
            "before BroadcastGlobalVariablesCallback, or give it to every rank")


class MetricAverageCallback(Callback):
    """Averages every epoch's logs over the processes, so every rank logs the same.

    At each epoch's end the numbers in ``logs`` (loss, metrics, validation
    ones) are replaced by their mean over processes, in one all-reduce
    (float64). Put it before the callbacks that read them
    (ModelCheckpoint, ReduceLROnPlateau, TensorBoard, EarlyStopping).

    Args:
      device: Horovod's device hint (unused).
    """

    def __init__(self, device=""):
        super().__init__()
        del device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(name for name, value in logs.items()
                       if isinstance(value, (int, float)) or (
                           hasattr(value, "shape") and not value.shape))
        means = grouped_allreduce([tf.constant(float(logs[name]), tf.float64)
                                   for name in names])
        for name, mean in zip(names, means):
            logs[name] = float(mean)


class WorkerTimesCallback(Callback):
    """On rank 0: each worker's median ms inside its last fit batches, as TensorBoard scalars.

    The worker the others wait for (a straggler: slow input, a busy host)
    spends the least time inside its batches, because the others wait for
    it inside theirs; the chief's watchdog names it in its log
    (``tfreduce.workers.stragglers``), and this callback draws every
    worker's curve: ``workers/ms_inside_step/worker_<r>``, the tag
    ``ReplicatedTrainer.fit(logdir=)`` writes, in ``log_dir/train`` (where
    ``keras.callbacks.TensorBoard(log_dir)`` writes fit's curves), against
    the batches done. The batches are timed by
    BroadcastGlobalVariablesCallback, which must be among the callbacks,
    before this one; each worker's median (over the last
    ``tfreduce.workers.stragglers.STRAGGLER_STEPS`` batches) comes with its
    heartbeat, once a second. Other ranks, a single process and a run
    without the watchdog (``stall_seconds=0``) write nothing.

    Args:
      log_dir: str, TensorBoard's log directory.
      update_freq: "epoch" (at each epoch's end), "batch" (every batch) or
        int N > 0 (every N batches, counted across epochs, as Keras'
        TensorBoard counts them).

    Raises:
      ValueError: a bad update_freq.
    """

    def __init__(self, log_dir, update_freq="epoch"):
        super().__init__()
        if update_freq == "batch":
            update_freq = 1
        if update_freq != "epoch" and (isinstance(update_freq, bool)
                                       or not isinstance(update_freq, int) or update_freq < 1):
            raise ValueError(f"WorkerTimesCallback: update_freq must be 'epoch', 'batch' or an "
                             f"int number of batches > 0, got {update_freq!r}")
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self._writer = None
        self._batches = 0  # across epochs and fits

    def on_train_begin(self, logs=None):
        if rank() == 0 and cluster().watchdog is not None:
            self._writer = tf.summary.create_file_writer(os.path.join(self.log_dir, "train"))

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self.update_freq != "epoch" and self._batches % self.update_freq == 0:
            self._write()

    def on_epoch_end(self, epoch, logs=None):
        if self.update_freq == "epoch":
            self._write()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write(self):
        if self._writer is None:
            return
        with self._writer.as_default(step=progress.step):
            cluster().watchdog.write_scalars()
        self._writer.flush()


class LearningRateScheduleCallback(Callback):
    """Sets the learning rate to initial_lr * multiplier(epoch) between two epochs.

    Args:
      initial_lr: float, the learning rate the multiplier scales.
      multiplier: float m (the rate is m ** (epoch - start_epoch)) or a
        function of the epoch (a float with staircase=False).
      start_epoch: int, the first epoch it applies to.
      end_epoch: int or None, the epoch it no longer applies to.
      staircase: bool: True sets it at each epoch's start; False at every
        batch, with the epoch counted in fractions (epoch + batch /
        steps_per_epoch).
      momentum_correction: Horovod scales SGD's momentum by the change of
        rate for one batch; Keras 3 compiles the momentum into the step, so
        tfreduce cannot: True warns once if the optimizer has momentum.
      steps_per_epoch: int, or None to read it from fit's parameters.

    Raises:
      ValueError: initial_lr is None.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("initial_lr must be given: the learning rate at multiplier 1")
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _applies(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ValueError("steps_per_epoch is unknown (fit of a dataset of unknown length): "
                             "pass steps_per_epoch= to the callback")
        momentum = getattr(self.model.optimizer, "momentum", 0)
        if self.momentum_correction and momentum:
            warnings.warn("momentum_correction: Keras 3 compiles the momentum into the train "
                          "step, so it is not corrected when the learning rate changes",
                          stacklevel=2)

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if not self._applies(epoch) or (self.staircase and batch != 0):
            return
        at = epoch if self.staircase else epoch + batch / self.steps_per_epoch
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(at)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = float(tf.convert_to_tensor(
                self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Raises the learning rate linearly from initial_lr / size to initial_lr over warmup_epochs.

    At batch b of epoch e, with x = e + (b + 1) / steps_per_epoch, the rate
    is initial_lr / size * (x * (size - 1) / warmup_epochs + 1), reaching
    initial_lr at the end of epoch warmup_epochs - 1 (Goyal et al., 2017).

    Args:
      initial_lr: float, the rate after warmup (usually the single-process
        rate times size).
      warmup_epochs: int, the epochs of the warmup.
      momentum_correction: see LearningRateScheduleCallback.
      steps_per_epoch: int, or None to read it from fit's parameters.
      verbose: int, 1: rank 0 prints when the warmup ends.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            # Shifted by one batch so that an epoch ends on a round value.
            x = epoch + 1.0 / self.steps_per_epoch
            return 1.0 / size() * (x * (size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0:
            if rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                      f"{self.initial_lr:g}.")
