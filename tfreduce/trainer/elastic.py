"""`fit` under the elastic launcher: commits, the resume from the newest, re-forming.

Under ``tfreduce-launch --workers MIN:MAX`` (``tfreduce.workers.elastic_launch``)
a job is a sequence of generations of processes; what one leaves the
next is its workers' commits (``tfreduce.workers.generations``). For
``ReplicatedTrainer.fit``:

- **A commit** is a trainer checkpoint (``checkpoints.TrainerCheckpoint``,
  written whole or not at all) that every worker writes to its own folder
  of the job's directory, ``trainer-<worker id>``, after every
  ``commit_every`` steps and after every epoch. Each worker writes, since
  any of them may be the one that survives; the replicas are equal, so
  every commit of one step holds the same values.
- **The resume**: the first ``fit`` of a process in a generation after the
  first restores the newest intact commit of the directory (the most
  steps, whichever worker wrote it), read by rank 0 and broadcast, as
  ``restore`` does; the epoch and batch follow from the step counter, and
  the global batches of array input are the same for any number of
  workers. So a lost worker rolls the job back to its last commit and the
  steps since are redone on the same batches: none is skipped or seen
  twice in the result, and with ``deterministic=True`` the weights have the
  same bits as an uninterrupted run.
- **Host updates** (slots added or removed): each step sends, beside its
  SIGTERM flag, whether this worker has seen the launcher's update, in
  units of ``HOST_UPDATE_UNIT`` of the flag that the step's metrics
  all-reduce sums. Every worker learns of it after the same step; all
  commit there and leave with ``RESHAPE_CODE``, and nothing is redone.
- **A lost peer** (``WorkerLostError`` of the watchdog, TF's
  ``UnavailableError`` or ``AbortedError``) ends this process with
  ``RESHAPE_CODE``; the launcher starts the next generation.

Outside the elastic launcher none of this happens: ``commit_every`` is
accepted and unused, so one script runs both ways.
"""

import contextlib
import sys

import tensorflow as tf

from tfreduce.algorithms.tree import tree_tower_counts
from tfreduce.trainer.checkpoints import find_prefix
from tfreduce.trainer.determinism import DEFAULT_MICRO_BATCHES, check_deterministic
from tfreduce.workers import generations
from tfreduce.workers.failures import PEER_LOST

__all__ = ["HOST_UPDATE_UNIT", "ElasticFit", "check_commit_every"]

#: The step flag's unit for "this worker saw a host update" (SIGTERMs count 1 each).
HOST_UPDATE_UNIT = 2.0 ** 20
_STEP_KEY = "step/.ATTRIBUTES/VARIABLE_VALUE"


def check_commit_every(commit_every):
    """Raises TypeError or ValueError unless commit_every is None or an int >= 1."""
    if commit_every is None:
        return
    if isinstance(commit_every, bool) or not isinstance(commit_every, int):
        raise TypeError(f"commit_every must be None or an int, got {type(commit_every).__name__} "
                        f"{commit_every!r}")
    if commit_every < 1:
        raise ValueError(f"commit_every must be >= 1 steps, got {commit_every}")


class ElasticFit:
    """One trainer's fits under the elastic launcher; outside it every method does nothing.

    Args:
      worker: this process's ``generations.ElasticWorker``, or None (no
        elastic launcher: ``generations.elastic_worker()``).
      save: fn(folder), writes the trainer's checkpoint to str folder on
        every worker (``TrainerCheckpoint.save(folder, every_worker=True)``).
      restore: fn(prefix), the trainer's restore of a checkpoint prefix read
        on rank 0 ("" on the others), broadcast to every worker.
    """

    def __init__(self, worker, save, restore):
        self._worker, self._save, self._restore = worker, save, restore
        self._updates_seen = 0 if worker is None else worker.updates_at_start
        self._resumed = False
        self._commit_every = None
        self._fitting = False
        self._committed = None  # the step of the last commit

    @classmethod
    def of_this_process(cls, save, restore):
        """The ElasticFit of this process's place in an elastic job (doing nothing outside one).

        Raises:
          ValueError: as ``generations.elastic_worker``.
        """
        return cls(generations.elastic_worker(), save, restore)

    @property
    def folder(self):
        """str, the folder of this worker's commits."""
        return generations.trainer_folder(self._worker.directory, self._worker.worker_id)

    def check_sizes(self, options, micro_batches):
        """Every size the job may form must suit a deterministic step.

        Args:
          options: the trainer's StepOptions (its reduction and devices).
          micro_batches: int or None, the trainer's argument.

        Raises:
          ValueError: naming the sizes that do not and the --worker-counts that
            would do; the launcher is told first, so it ends the job.
        """
        if (not options.reduction.deterministic or self._worker is None
                or self._worker.sizes is None):
            return
        micro_batches = DEFAULT_MICRO_BATCHES if micro_batches is None else micro_batches
        if (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)
                or micro_batches < 1):
            return  # deterministic_options names the bad argument
        towers = len(options.devices)

        def fits(workers):  # the deterministic step's own rule, at that size
            try:
                check_deterministic(micro_batches, workers * towers, towers, 1, None)
            except ValueError:
                return False
            return True

        bad = [n for n in self._worker.sizes if not fits(n)]
        if bad:
            good = [n for n in range(1, max(self._worker.sizes) + 1) if fits(n)]
            message = (
                f"deterministic=True with micro_batches={micro_batches} runs on "
                f"{_either(tree_tower_counts(micro_batches))} towers, and this elastic job may "
                f"form {', '.join(map(str, bad))} worker(s) of {towers} tower(s): start it with "
                f"tfreduce-launch --worker-counts {','.join(map(str, good))}")
            self._worker.give_up(message)
            raise ValueError(message)

    def resume(self, trainer):
        """The first fit of a re-formed generation: restores the newest commit on every worker."""
        if self._worker is None or self._resumed or self._worker.generation == 0:
            return
        self._resumed = True
        prefix = _newest_commit(self._worker.directory) if trainer.is_chief else ""
        self._restore(prefix or "")
        if prefix:
            print(f"tfreduce elastic: generation {self._worker.generation} resumes at step "
                  f"{trainer.step} from {prefix}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def fitting(self, trainer, commit_every):
        """Within it, fit's steps commit and watch for host updates, and a lost peer ends
        this process with RESHAPE_CODE for the launcher; it resumes first (``resume``).

        Raises:
          TypeError, ValueError: commit_every is not None or an int >= 1.
        """
        check_commit_every(commit_every)
        self._commit_every, self._fitting = commit_every, self._worker is not None
        try:
            with self._leaving_on_loss():
                self.resume(trainer)
                yield
        finally:
            self._fitting = False

    def flag(self, stop_requested):
        """The float a step sums over the workers: SIGTERM (1), in fit host update (the unit)."""
        update = self._fitting and self._worker.hosts_updates() > self._updates_seen
        return float(bool(stop_requested)) + HOST_UPDATE_UNIT * update

    def after_step(self, trainer, summed):
        """After a step: in fit, commits when due and leaves after a host update.

        Returns:
          float, the SIGTERMs the step summed (the flag without host updates).
        """
        updates, stops = divmod(float(summed), HOST_UPDATE_UNIT)
        if not self._fitting:
            return stops
        if updates or (self._commit_every and trainer.step % self._commit_every == 0):
            self.commit(trainer)
        if updates:
            generations.leave(
                f"the job's hosts changed: every worker committed step {trainer.step} and it "
                f"re-forms (worker {self._worker.worker_id}, generation "
                f"{self._worker.generation})")
        return stops

    def commit(self, trainer):
        """Writes this worker's commit (every worker calls it at the same step), once a step."""
        if self._fitting and self._committed != trainer.step:
            self._save(self.folder)
            self._committed = trainer.step

    @contextlib.contextmanager
    def _leaving_on_loss(self):
        if self._worker is None:
            yield  # no launcher to re-form the job: the error is the caller's
            return
        try:
            yield
        except PEER_LOST as error:
            generations.leave(generations.lost_peer(error, self._worker))


def _newest_commit(directory):
    """The intact commit with the most steps among the workers' folders, or None."""
    newest, newest_step = None, -1
    for folder in generations.trainer_folders(directory):
        try:
            prefix = find_prefix(folder)
        except (FileNotFoundError, ValueError):
            continue  # no commit yet, or none whole: a worker killed while it wrote
        step = int(tf.train.load_checkpoint(prefix).get_tensor(_STEP_KEY))
        if step > newest_step:
            newest, newest_step = prefix, step
    return newest


def _either(numbers):
    """"1, 2 or 4"."""
    words = [str(n) for n in numbers]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
