"""Checkpoints of a replicated run: tower 0's model, the optimizers' state, the step counter.

Tower 0's model describes the whole run, since the replicas are equal; the
optimizers' state is written in a layout of its own that any number of
towers and any ZeRO stage read back; the step counter tells `fit` where to
continue. A checkpoint is never
half-written, never non-finite and never trusted unread:

- saves never overwrite the files the index names, so a crash during a save
  leaves the previous checkpoint as the latest, and the temporary folders a
  killed save leaves behind are removed by the next one;
- a save of NaN or Inf weights is refused, so a diverged run cannot rotate
  the good checkpoints out;
- a restore reads every tensor of a checkpoint before loading it, and falls
  back to the newest intact one when the latest is damaged (truncated, a
  shard missing, an index naming nothing).
"""

import os
import re
import shutil
import sys

import tensorflow as tf

from tfreduce.doors.multiworker import broadcast_variables_multiworker

_CHECKPOINT_NAME = "ckpt"
_CHECKPOINTS_KEPT = 3


class TrainerCheckpoint:
    """The checkpoint of tower 0's model, the optimizers' state and the counters.

    The optimizers' state is written in a layout that depends on neither the
    number of towers nor the ZeRO stage (trainer.optimizer_state), with the
    run's layout (towers of all workers, zero_stage) beside it: a restore at
    another K or stage says what changed on stderr.

    Args:
      towers: step's Towers, built (with their ZeRO pieces, if any).
      step: the int64 step counter tf.Variable.
      epoch_totals: the float64 [3] tf.Variable of the epoch's running totals.
      tower_state: the trainer's update.TowerState, whose per-tower
        variables (accumulated gradients, PowerSGD's Q and error feedback)
        are saved for every tower, or None.
      options: the trainer's StepOptions (towers of all workers, zero_stage,
        cluster). With ZeRO across workers, a save gathers every worker's
        shards for rank 0 to write, and a restore scatters rank 0's read.
    """

    def __init__(self, towers, step, epoch_totals, tower_state, options):
        model, sharding = towers.models[0], towers.sharding
        self._options = options
        optimizer_state = sharding.optimizer_state(towers.optimizers, towers.trainable,
                                                   options.cluster)
        self._across = optimizer_state.across
        self._optimizer_state = optimizer_state
        self._layout_now = (options.total_towers, options.zero_stage)
        with tf.device("/device:CPU:0"):
            self._run_layout = tf.Variable(self._layout_now, dtype=tf.int64,
                                           trainable=False, name="run_layout")
        # The explicit variable list adds what Keras does not track for
        # checkpoints (the random state of Dropout layers), which an exact
        # resume needs.
        self._parts = dict(model=model, optimizer_state=optimizer_state,
                           model_variables=list(model.variables), step=step,
                           epoch_totals=epoch_totals, run_layout=self._run_layout)
        self._own_parts = tower_state.checkpointed() if tower_state is not None else {}
        self._checkpoint = tf.train.Checkpoint(**self._parts, **self._own_parts)
        self._legacy_optimizer = sharding.whole_optimizer(towers.optimizers)
        self._tower_state = tower_state
        self._epoch_totals = epoch_totals
        # Every variable a checkpoint holds is checked before a save.
        own = [v for k in range(len(tower_state.devices)) for v in tower_state.tower_variables(k)
               ] if tower_state is not None else []
        pieces = [v for k in range(len(towers.devices)) for v in sharding.variables(k)]
        self._variables = (list(model.variables) + optimizer_state.variables_held() + pieces
                           + own + [step, epoch_totals])

    def _restart_own_state(self):
        """The towers' own state from its start; a restore then reads the checkpoint's, if kept."""
        if self._tower_state is not None:
            self._tower_state.reset()

    def save(self, path, every_worker=False):
        """Writes checkpoint `ckpt-<n>` under `path` with a fresh n; returns its prefix.

        tf.train.CheckpointManager writes the checkpoint's files and only then
        rewrites the `checkpoint` index file, atomically. The three newest
        checkpoints are kept.

        Args:
          path: str, checkpoint directory (created if missing).
          every_worker: bool, every worker of a cluster writes (an elastic
            commit, each to its own path); False: rank 0 only.

        Returns:
          str, the prefix written; None on the other workers of a cluster
          unless every_worker (with ZeRO they take part: their shards are
          gathered).

        Raises:
          FloatingPointError: a variable the checkpoint holds (model,
            optimizer, a tower's accumulated gradients or PowerSGD state, the
            epoch's running totals) holds NaN or Inf; nothing is written and
            the checkpoints in `path` stay.
        """
        if self._across:
            self._optimizer_state.gather(self._options.devices, self._options.exact_reduction,
                                         self._options.cluster)
        try:
            writes = every_worker or self._options.cluster.is_chief
            return self._write(path) if writes else None
        finally:
            self._optimizer_state.release()

    def _write(self, path):
        """save's writing, on rank 0."""
        bad = _first_non_finite(self._variables)
        if bad is not None:
            raise FloatingPointError(
                f"save: {bad} holds NaN or Inf values, so no checkpoint is written and the "
                f"ones in {path!r} stay; the run diverged: resume from the last checkpoint "
                f"with a lower learning rate")
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(path):
            # A save killed midway leaves its temporary shard folder behind.
            if re.fullmatch(rf"{_CHECKPOINT_NAME}-\d+_temp", name):
                shutil.rmtree(os.path.join(path, name), ignore_errors=True)
        manager = tf.train.CheckpointManager(
            self._checkpoint,
            path,
            max_to_keep=_CHECKPOINTS_KEPT,
            checkpoint_name=_CHECKPOINT_NAME,
        )
        used = [n for n, _ in _numbered(path)]
        # A fresh number, so the files the index currently names are never
        # overwritten while it still names them.
        return manager.save(checkpoint_number=max(used, default=0) + 1)

    def restore(self, prefix):
        """Reads checkpoint `prefix` into the model, optimizers and step counter.

        A checkpoint of another number of towers or zero_stage is read into
        this run's layout, and a line on stderr says what changed. The
        towers' own state (accumulated gradients, PowerSGD's) is kept only
        at the same number of towers and with the accumulation sums sharded
        alike (zero_stage 2 or not); otherwise the run restarts it.

        Args:
          prefix: str, the checkpoint; "" on the workers of a cluster other
            than rank 0, which receive its values (``finish_restore``).

        Raises:
          ValueError: the checkpoint does not match the objects (another
            model or optimizer); it was saved midway through an
            accumulation cycle at another number of towers, or sharded
            otherwise (zero_stage 2 or not); it predates the
            layout and this run shards its optimizer state.
        """
        if not prefix:
            self._restart_own_state()  # rank 0's alone is in the checkpoint
            return
        reader = tf.train.load_checkpoint(prefix)
        names = reader.get_variable_to_shape_map()
        saved = _saved_run(reader, names)
        parts = {name: part for name, part in self._parts.items()
                 if name != "epoch_totals" or any(n.startswith("epoch_totals/") for n in names)}
        if "epoch_totals" not in parts:
            self._epoch_totals.assign(tf.zeros([3], tf.float64))
        if not any(n.startswith("optimizer_state/") for n in names):
            parts.pop("optimizer_state")
            if self._legacy_optimizer is None:
                raise ValueError(f"restore: checkpoint {prefix!r} keeps the optimizer in Keras' "
                                 f"layout; resume it with zero_stage=0 and save once")
            parts["optimizer"] = self._legacy_optimizer
        if "run_layout" not in {n.split("/")[0] for n in names}:
            parts.pop("run_layout")
        # The towers' own state is per tower, and sharded at stage 2: kept
        # only in the layout it was saved in.
        same_layout = saved is None or (saved[0] == self._layout_now[0]
                                        and (saved[1] == 2) == (self._layout_now[1] == 2))
        dropped = bool(self._own_parts) and not same_layout
        if dropped:
            _check_cycle_boundary(reader, names, prefix, saved)
        else:
            parts.update(self._own_parts)
        # After the checks: a restore that refuses the checkpoint changes nothing.
        self._restart_own_state()
        try:
            status = tf.train.Checkpoint(**parts).restore(prefix)
            status.assert_existing_objects_matched()
            if self._across and "optimizer_state" in parts:
                self._optimizer_state.read_whole(prefix)
        # Another model: objects left unmatched (AssertionError), entries
        # missing (NotFoundError), shapes (ValueError) or dtypes
        # (InvalidArgumentError) that differ.
        except (AssertionError, ValueError, tf.errors.NotFoundError,
                tf.errors.InvalidArgumentError) as error:
            raise ValueError(
                f"restore: checkpoint {prefix!r} does not match this trainer's model: "
                f"{str(error).strip()}") from None
        if dropped:
            # The saved towers' own state is left out on purpose (the line
            # below says so); TensorFlow would report its values as lost.
            status.expect_partial()
        self._run_layout.assign(self._layout_now)
        if saved is not None and tuple(saved) != self._layout_now:
            restart = "; the towers' own state (accumulated gradients, PowerSGD's) restarts" \
                if dropped else ""
            print(f"restore: {prefix} was saved at {saved[0]} towers with zero_stage "
                  f"{saved[1]}; resuming at {self._layout_now[0]} towers with zero_stage "
                  f"{self._layout_now[1]}{restart}", file=sys.stderr)
        if self._tower_state is not None:
            # A skip of the resumed cycle goes back to the restored state.
            self._tower_state.save_forward(always=True)

    def finish_restore(self):
        """After a restore's broadcast: with ZeRO across workers, every tower takes its ranges.

        Called on every worker; the others do nothing.
        """
        if self._across:
            self._optimizer_state.scatter(self._options.devices, self._options.exact_reduction,
                                          self._options.cluster)


def _saved_run(reader, names):
    """(towers, zero_stage) a checkpoint was saved with, or None (saved before it was kept)."""
    key = "run_layout/.ATTRIBUTES/VARIABLE_VALUE"
    return tuple(int(v) for v in reader.get_tensor(key)) if key in names else None


def _check_cycle_boundary(reader, names, prefix, saved):
    """Raises ValueError if the checkpoint holds gradients accumulated in run layout `saved`."""
    key = "accumulated_examples/.ATTRIBUTES/VARIABLE_VALUE"
    if key in names and float(reader.get_tensor(key)) != 0.0:
        towers, stage = saved
        raise ValueError(
            f"restore: {prefix} was saved midway through an accumulation cycle at {towers} "
            f"towers with zero_stage {stage}, whose sums are per tower (sharded at stage 2); "
            f"resume it at {towers} towers with zero_stage {stage}, or from a checkpoint "
            f"saved when the cycle ended")


def _first_non_finite(variables):
    """The path of the first floating-point variable with a NaN or Inf, or None."""
    for v in variables:
        value = tf.convert_to_tensor(v)
        if value.dtype.is_floating and not bool(tf.reduce_all(tf.math.is_finite(value))):
            return getattr(v, "path", None) or v.name
    return None


def _damage(prefix):
    """What is wrong with a checkpoint, or None if every tensor of it reads back."""
    try:
        reader = tf.train.load_checkpoint(prefix)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except (tf.errors.OpError, ValueError, IndexError, OSError, RuntimeError) as error:
        reason = str(error).strip().splitlines()
        return f"{type(error).__name__}: {reason[0] if reason else ''}"
    return None


def _numbered(path):
    """(n, prefix) of each checkpoint `ckpt-<n>` with an index file in `path`, by n."""
    return sorted(
        (int(m.group(1)), os.path.join(path, m.group(0)[: -len(".index")]))
        for name in os.listdir(path)
        if (m := re.fullmatch(rf"{_CHECKPOINT_NAME}-(\d+)\.index", name))
    )


def _candidates(path):
    """The checkpoints of directory `path`, newest first: the index's, then the files'."""
    try:
        state = tf.train.get_checkpoint_state(path)
    except (tf.errors.OpError, ValueError):
        state = None  # a damaged index file: the files on disk still count
    listed = list(reversed(state.all_model_checkpoint_paths)) if state else []
    listed = [p if os.path.isabs(p) else os.path.join(path, p) for p in listed]
    out = []
    for prefix in listed + [p for _, p in reversed(_numbered(path))]:
        if prefix not in out:
            out.append(prefix)
    return out


def find_prefix(path):
    """The prefix of the newest intact checkpoint in directory `path`, or `path` itself.

    Every tensor of a candidate is read before it is chosen, so a damaged
    checkpoint is never loaded; each one passed over is reported on stderr.

    Raises:
      FileNotFoundError: there is no checkpoint at path.
      ValueError: every checkpoint at path is damaged (each named with why).
    """
    if not os.path.isdir(path):
        if not tf.io.gfile.exists(path + ".index"):
            raise FileNotFoundError(
                f"restore: no checkpoint at {path!r} (neither a checkpoint directory nor prefix)"
            )
        candidates = [path]
    else:
        candidates = _candidates(path)
        if not candidates:
            raise FileNotFoundError(f"restore: no checkpoint at {path!r} (an empty directory)")
    damaged = []
    for prefix in candidates:
        why = _damage(prefix)
        if why is None:
            if damaged:
                print(f"restore: {'; '.join(damaged)}; using {prefix}", file=sys.stderr)
            return prefix
        damaged.append(f"{prefix} is damaged ({why})")
    raise ValueError(f"restore: no intact checkpoint at {path!r}: {'; '.join(damaged)}")


def read_counters(prefix, step, epoch_totals, cluster):
    """Restores only the step counter and epoch totals of checkpoint `prefix`, on every worker.

    ``fit`` picks its first epoch and batch from the step counter before the
    first batch has built a model whose variables appear on its first call;
    the rest of the checkpoint waits for that build. Rank 0 reads, then
    broadcasts both counters to every worker (call it at the same point on
    every worker).

    Args:
      prefix: str, the checkpoint ("" on the workers other than rank 0).
      step: the int64 step counter tf.Variable.
      epoch_totals: the float64 [3] tf.Variable of the epoch's running totals
        (left as it is by a checkpoint that predates them).
      cluster: the trainer's started Cluster or LocalCluster.
    """
    if prefix:
        tf.train.Checkpoint(step=step, epoch_totals=epoch_totals).read(prefix).expect_partial()
    broadcast_variables_multiworker([[step, epoch_totals]], cluster)
