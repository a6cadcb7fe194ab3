"""The loops over batches: fit (epochs, progress, TensorBoard, Ctrl-C), evaluate, predict.

The fit loop drives a trainer through its public face (step, is_chief,
optimizers, skipped_steps, evaluate, save) and `FitHooks`, the few things
of the trainer's own that fit needs and nobody else does. Evaluate and
predict loop over batches with the step functions they are given.
"""

import dataclasses
import math
import sys
import time
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from tfreduce.trainer.batching import (batch_size_of, check_batch, check_fit_arguments,
                                       dataset_batches, fit_data, is_batches, numpy_batches)
from tfreduce.trainer.losses import regularization
from tfreduce.trainer.profiling import ProfiledSteps, check_profile_steps
from tfreduce.trainer.signals import Terminated


@dataclasses.dataclass(frozen=True)
class FitHooks:
    """What the fit loop needs of a trainer beyond its public face.

    Attributes:
      run_step: fn(x, y) -> (float mean loss, int correct count or None,
        bool stopping): trains on one global batch; stopping is True once
        a stop was asked for (SIGTERM), on every worker after the same step.
      stop: signals.StopRequest, the SIGTERM handling while fit runs.
      epoch_totals: the float64 [3] tf.Variable of the epoch's running loss
        sum, correct count and examples (checkpointed: a resume mid-epoch
        logs the epoch's means).
      reports_skipped: bool, every epoch's logs count the skipped steps
        (on_nonfinite="skip"), not only those with a skipped step.
      finish: fn(), waits for every worker (``Cluster.finish``; nothing in
        one process).
      graphs: fn() -> list of the traced step graphs (a timeline places
        the profiled ops with them).
      rank: int, this worker's rank (0 in one process).
      tower_medians: fn() -> dict tower -> median ms from the split to its
        gradients over the last steps, or None before they are known
        (towertimes.TowerTimes.medians).
      watchdog: this worker's tfreduce.workers.watchdog.Watchdog, or None (one
        process, or stall_seconds=0).
      commit: fn(), the elastic commit at each epoch's end (trainer.elastic;
        nothing outside the elastic launcher).
    """

    run_step: Callable
    stop: object
    epoch_totals: object
    reports_skipped: bool
    finish: Callable
    graphs: Callable
    rank: int
    tower_medians: Callable
    watchdog: object
    commit: Callable


@dataclasses.dataclass(frozen=True)
class Epochs:
    """What every epoch of one fit call shares.

    Attributes:
      x, y: np.ndarray [examples, ...] of inputs and targets, or a
        tf.data.Dataset of (x, y) global batches as x and None as y.
      epochs: int, the epoch to train up to.
      batch_size: int, global batch size for array input.
      shuffle: bool, reshuffle array input every epoch.
      seed: int, seed of the shuffling.
      steps_per_epoch: int, global batches in one epoch.
      total_towers: int T, the towers of all workers; an array batch smaller
        than T is skipped.
      writer: tf.summary writer of TensorBoard summaries, or None.
      verbose: 0 silent, 1 a progress bar per epoch, 2 one line per epoch.
      profiled: ProfiledSteps, runs each step (profiled in its window).
    """

    x: object
    y: object
    epochs: int
    batch_size: int
    shuffle: bool
    seed: int
    steps_per_epoch: int
    total_towers: int
    writer: object
    verbose: int
    profiled: ProfiledSteps


def fit_loop(
    trainer,
    hooks,
    x,
    y,
    sample_weight,
    total_towers,
    *,
    epochs,
    batch_size,
    shuffle,
    seed,
    validation_data,
    logdir,
    checkpoint_dir,
    callbacks,
    verbose,
    profile_steps=None,
):
    """The body of `ReplicatedTrainer.fit`, whose docstring says what it does.

    Args:
      trainer: the ReplicatedTrainer.
      hooks: FitHooks of that trainer.
      total_towers: int T, the towers of all workers.
      the others: as `ReplicatedTrainer.fit`.

    Returns:
      dict of lists, one entry per epoch run.
    """
    x, y, steps_per_epoch = fit_data(x, y, batch_size, total_towers, sample_weight)
    # Every worker profiles its own towers, into the one logdir.
    profiled = ProfiledSteps(check_profile_steps(profile_steps, logdir), logdir,
                             trainer.devices, hooks.graphs, trainer.models, hooks.rank)
    profiled.check_window(trainer.step + 1, epochs * steps_per_epoch)
    if not trainer.is_chief:
        # Rank 0 writes and reports for the whole cluster; the others' saves
        # write nothing (with ZeRO their shards are gathered for rank 0's).
        logdir, verbose = None, 0
    check_fit_arguments(epochs, validation_data, checkpoint_dir if trainer.is_chief else None,
                        verbose, logdir)
    if verbose == 1 and not sys.stdout.isatty():
        # A bar redrawn with \r and ANSI codes is noise in a file or a pipe
        # (a log, the launcher's prefixed lines): one line per epoch there.
        verbose = 2
    writer = tf.summary.create_file_writer(logdir) if logdir else None
    run = Epochs(x, y, epochs, batch_size, shuffle, seed, steps_per_epoch, total_towers,
                 writer, verbose, profiled)
    history = {}
    try:
        with hooks.stop.handling():
            _fit_epochs(trainer, hooks, run, validation_data, checkpoint_dir, callbacks, history)
            # A signal after the last step's flag was read: the run is done
            # and saved, but the caller asked to stop.
            late = hooks.stop.signum
    except KeyboardInterrupt as stop:
        _save_on_interrupt(trainer, hooks, checkpoint_dir, stop)
        raise
    except BaseException:
        profiled.close(failed=True)
        raise
    finally:
        profiled.close()  # a window beyond the last step: what was profiled
        if writer is not None:
            writer.close()
    # No worker leaves while a peer still needs its answers. Not in a
    # finally: after a failure the peers may never get here.
    hooks.finish()
    if late is not None:
        raise Terminated(late, trainer.step)
    return history


def _fit_epochs(trainer, hooks, run, validation_data, checkpoint_dir, callbacks, history):
    """The epochs of fit from the trainer's step on; adds each epoch's logs to history."""
    first_epoch, skip = divmod(trainer.step, run.steps_per_epoch)
    for epoch in range(first_epoch, run.epochs):
        logs, stopping = fit_epoch(trainer, hooks, run, epoch, skip)
        skip = 0
        if hasattr(run.x, "on_epoch_end"):  # a keras.utils.PyDataset's own hook
            run.x.on_epoch_end()
        stop = Terminated(hooks.stop.signum, trainer.step) if stopping else None
        if stop is not None and trainer.step % run.steps_per_epoch:
            raise stop  # mid-epoch: the resume finishes this epoch
        logs = _end_epoch(trainer, run, epoch, logs, validation_data)
        logs = {"epoch": epoch + 1, **logs}
        for name, value in logs.items():
            history.setdefault(name, []).append(value)
        # The callbacks before the checkpoint: what they record (a history
        # file) never lags the checkpoint a resume starts from, wherever a
        # kill lands; an epoch recorded but not saved is run and recorded again.
        for callback in callbacks:
            callback(epoch + 1, logs)
        hooks.commit()
        if checkpoint_dir is not None and stop is None:
            trainer.save(checkpoint_dir)  # on a stop, the interrupt handler saves
        if stop is not None:
            raise stop


def _save_on_interrupt(trainer, hooks, checkpoint_dir, stop):
    """Ctrl-C or SIGTERM: writes a checkpoint (rank 0) and says where, before re-raising."""
    if isinstance(stop, Terminated):
        # Every worker stops after the same step: let all arrive first.
        hooks.finish()
    if checkpoint_dir is not None:
        path = trainer.save(checkpoint_dir)
        if isinstance(stop, Terminated):
            hooks.finish()  # a save may gather across workers: none leaves before all have
        if path is not None:
            what = stop if isinstance(stop, Terminated) else f"interrupted at step {trainer.step}"
            print(f"\n{what}; checkpoint written to {path}", file=sys.stderr)


def _end_epoch(trainer, run, epoch, logs, validation_data):
    """Adds validation results to an epoch's logs, writes and prints them."""
    if validation_data is not None:
        val_x, val_y, *weights = ((validation_data, None) if is_batches(validation_data)
                                  else validation_data)
        results = trainer.evaluate(val_x, val_y, batch_size=max(run.batch_size, 256),
                                   sample_weight=weights[0] if weights else None)
        logs.update({f"val_{name}": value for name, value in results.items()})
    if run.writer is not None:
        with run.writer.as_default(step=trainer.step):
            for name, value in logs.items():
                tf.summary.scalar(f"epoch/{name}", value)
        run.writer.flush()
    if run.verbose:
        line = " - ".join(f"{name}: {value:.0f}" if name == "images_per_sec"
                          else f"{name}: {value:.4g}" for name, value in logs.items())
        # verbose 1 printed "Epoch i/n" above the bar; 2 has one line an epoch.
        print(line if run.verbose == 1 else f"Epoch {epoch + 1}/{run.epochs} - {line}",
              flush=True)
    return logs


def _epoch_batches(run, epoch, skip):
    """The epoch's (x, y) global batches from batch `skip` on."""
    if is_batches(run.x):
        return dataset_batches(run.x, skip)
    examples = batch_size_of(run.x)
    order = (
        np.random.default_rng([run.seed, epoch]).permutation(examples)
        if run.shuffle
        else np.arange(examples)
    )
    return numpy_batches(
        run.x, run.y, run.batch_size, order, skip, run.total_towers, drop_small=True
    )


def fit_epoch(trainer, hooks, run, epoch, skip):
    """Runs the steps of one epoch from batch `skip`; returns the epoch's logs.

    Args:
      trainer: the ReplicatedTrainer.
      hooks: FitHooks; each step calls its `run_step`.
      run: Epochs, what every epoch of this fit shares.
      epoch: int, the 0-based epoch.
      skip: int, the batches of this epoch already trained (on a resume).

    Returns:
      (logs, stopping): logs a dict of "loss", "accuracy" (when defined),
      "images_per_sec", and "skipped_steps" with on_nonfinite="skip" or
      when a step was skipped; stopping a bool, the epoch ended early
      because a stop was asked for.
    """
    batches = _epoch_batches(run, epoch, skip)
    if run.verbose == 1:
        print(f"Epoch {epoch + 1}/{run.epochs}")
    progress = keras.utils.Progbar(
        run.steps_per_epoch, verbose=int(run.verbose == 1),
        stateful_metrics=["loss", "accuracy", "images/s"]
    )
    if skip:
        progress.update(skip)
    loss_total, correct_total, seen, has_accuracy = 0.0, 0, 0, False
    if skip:
        # Resumed mid-epoch: the totals of the steps before the checkpoint.
        totals = hooks.epoch_totals.numpy()
        loss_total, correct_total, seen = float(totals[0]), int(totals[1]), int(totals[2])
    # Throughput is measured on the wall clock, so it counts batching,
    # logging and tracing too, not just the time inside the step.
    epoch_start = time.perf_counter()
    skipped_before = trainer.skipped_steps
    stopping = False
    for step_in_epoch, (x_batch, y_batch) in enumerate(batches, start=skip + 1):
        start = time.perf_counter()
        loss, correct, stopping = run.profiled.run(hooks.run_step, trainer.step + 1,
                                                   x_batch, y_batch)
        step_time = time.perf_counter() - start
        size = batch_size_of(x_batch)
        elapsed = time.perf_counter() - epoch_start
        if math.isfinite(loss):
            # A batch whose loss is NaN or Inf (skipped, on_nonfinite="skip")
            # does not make the epoch's means, nor the checkpointed totals, NaN.
            seen += size
            loss_total += loss * size
            correct_total += correct or 0
        values = [("loss", loss_total / max(seen, 1))]
        if correct is not None:
            has_accuracy = True
            values.append(("accuracy", correct_total / max(seen, 1)))
        values.append(("images/s", seen / elapsed))
        progress.update(step_in_epoch, values)
        hooks.epoch_totals.assign([loss_total, correct_total, seen])
        if run.writer is not None:
            with run.writer.as_default(step=trainer.step):
                tf.summary.scalar("train/loss", loss)
                if correct is not None:
                    tf.summary.scalar("train/accuracy", correct / size)
                tf.summary.scalar("train/learning_rate", _learning_rate(trainer.optimizers[0]))
                tf.summary.scalar("train/step_time_s", step_time)
                _straggler_summaries(hooks.watchdog, hooks.tower_medians())
        if stopping:
            break  # SIGTERM: the step is whole and logged; the caller stops the run
    logs = {"loss": loss_total / max(seen, 1)}
    if has_accuracy:
        logs["accuracy"] = correct_total / max(seen, 1)
    logs["images_per_sec"] = seen / (time.perf_counter() - epoch_start)
    skipped = trainer.skipped_steps - skipped_before
    if skipped or hooks.reports_skipped:
        logs["skipped_steps"] = skipped  # updates skipped for NaN or Inf gradients
    return logs, stopping


def _learning_rate(optimizer):
    return float(tf.convert_to_tensor(optimizer.learning_rate))


def evaluate_loop(batches, steps_for, model):
    """Mean loss and accuracy over (x, y) global batches.

    Args:
      batches: iterable of (x, y) global batches.
      steps_for: fn(x) -> the trainer's step.StepFunctions, built on batch x
        if needed; its evaluate(x, y) returns (float64 loss sum, int64
        correct count, -1 when accuracy is not defined).
      model: keras.Model whose regularisation losses are added to the mean.

    Returns:
      dict: "loss" and, when defined for every batch, "accuracy".

    Raises:
      ValueError: a bad batch, or no examples.
    """
    loss_total, correct_total, count, has_accuracy = 0.0, 0, 0, True
    for x_batch, y_batch in batches:
        x_batch, y_batch = check_batch(x_batch, y_batch, "evaluate")
        loss_sum, correct = steps_for(x_batch).evaluate(x_batch, y_batch)
        loss_total += float(loss_sum)
        count += batch_size_of(x_batch)
        has_accuracy = has_accuracy and int(correct) >= 0
        correct_total += int(correct)
    if count == 0:
        raise ValueError("evaluate: the data has no examples")
    reg = float(regularization(model, tf.float64))
    results = {"loss": loss_total / count + reg}
    if has_accuracy:
        results["accuracy"] = correct_total / count
    return results


def predict_loop(batches, steps_for):
    """Model outputs for every input batch, concatenated in order.

    Args:
      batches: iterable of input global batches.
      steps_for: fn(x) -> the trainer's step.StepFunctions, built on batch x
        if needed.

    Raises:
      ValueError: there are no batches.
    """
    outputs = []
    for x_batch in batches:
        x_batch = tf.nest.map_structure(tf.convert_to_tensor, x_batch)
        outputs.append(tf.nest.map_structure(lambda t: t.numpy(),
                                             steps_for(x_batch).predict(x_batch)))
    if not outputs:
        raise ValueError("predict: x has no examples")
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts, axis=0), *outputs)


def _straggler_summaries(watchdog, tower_medians):
    """The scalars that show who the others wait for: each worker's, each tower's.

    ``workers/ms_inside_step/worker_<r>``: each worker's median ms inside its
    last steps, as the chief's watchdog hears them; the worker the others
    wait for is the one whose steps take least
    (``tfreduce.workers.stragglers``).
    ``towers/ms_to_gradients/tower_<k>``: each of this worker's towers'
    median ms from the split to its gradients; the tower the others wait for
    takes most (``tfreduce.trainer.towertimes``).
    """
    for k, ms in sorted((tower_medians or {}).items()):
        tf.summary.scalar(f"towers/ms_to_gradients/tower_{k}", ms)
    if watchdog is not None:
        watchdog.write_scalars()
