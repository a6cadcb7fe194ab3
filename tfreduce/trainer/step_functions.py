"""The tf.functions a trainer runs (StepFunctions), and the build of a run (build_run).

The graphs they trace are step.py's builders.
"""

import functools
import math

import tensorflow as tf

from tfreduce.trainer.checkpoints import TrainerCheckpoint
from tfreduce.trainer.step import HOST, StepGraph
from tfreduce.trainer.towers import build_towers, state_bytes, state_variables, sync_functions
from tfreduce.trainer.towertimes import TowerTimes
from tfreduce.trainer.update import TowerState, nonfinite_error, scales_loss
from tfreduce.workers.consistency import check_workers_agree, describe_variables
from tfreduce.workers.progress import progress


def signature(structure):
    """The tf.TensorSpecs of a batch like `structure` (its leaves), the batch axis left open."""
    return tf.nest.map_structure(
        lambda t: tf.TensorSpec([None] + t.shape[1:].as_list(), t.dtype), structure)


class StepFunctions:
    """The tf.functions the trainer runs on its built towers.

    `train`, `evaluate` and `predict` are each traced once, on their first
    call, from the shapes and dtypes of that call's batch, without AutoGraph
    (as Keras 3's `fit`; docs/architecture.md). The batch axis of
    every input signature stays None: a worker's part may differ in size
    from step to step, and a retrace on one worker only would build its
    collectives out of step with the others. The calls that run cross-worker
    collectives (train, broadcast) run inside the cluster's
    `detect_lost_workers`, which names a lost worker.

    Args:
      towers: Towers, this worker's K built replicas.
      options: StepOptions.
      state: TowerState, the per-tower state of the update.
      step: the int64 step counter tf.Variable.
      epoch_totals: the float64 [3] tf.Variable of the epoch's running loss
        sum, correct count and examples (broadcast with the step).

    Attributes:
      difference: tf.function () -> float64 scalar, the largest absolute
        difference between any tower's variable and tower 0's.
      tower_times: TowerTimes, each tower's time to its gradients over the
        last steps (it reports a tower that lags).
    """

    def __init__(self, towers, options, state, step, epoch_totals):
        self._towers = towers
        self._options = options
        self._state = state
        self._step = step
        self._graph = StepGraph(towers, options, state, step)
        self._broadcast_fn, self.difference = sync_functions(
            towers, options.cluster, [step, epoch_totals])
        self._train_fns = {True: None, False: None}  # update -> tf.function
        cluster = options.cluster
        self.tower_times = TowerTimes(towers.devices, cluster.describe(cluster.rank))
        self._eval_fn = None
        self._predict_fn = None

    def broadcast(self):
        """Copies tower 0's variables (rank 0's in a cluster) to every tower."""
        with self._options.cluster.detect_lost_workers():
            self._broadcast_fn()

    def step_graphs(self):
        """{"train", "accumulate"} -> tf.Graph of the step functions traced so far."""
        functions = {"train": self._train_fns[True], "accumulate": self._train_fns[False]}
        return {name: fn.get_concrete_function().graph for name, fn in functions.items()
                if fn is not None}

    def graphs(self):
        """The graphs of the train and accumulate functions traced so far."""
        return list(self.step_graphs().values())

    def state_variables(self):
        """Variables per tower and kind (towers.state_variables)."""
        return state_variables(self._towers, self._state)

    def state_bytes(self):
        """Bytes of state per tower and kind (towers.state_bytes)."""
        return state_bytes(self._towers, self._state)

    def train(self, x, y, batch, stop=False):
        """Runs StepGraph.train on this worker's part x, y of a global batch of int size `batch`.

        Every `accumulate_steps`-th step (counting from 1) reduces and
        updates; the others accumulate, with a function of their own that
        holds no cross-device reduction.

        Returns:
          (float64 scalar mean loss, int64 scalar correct count, -1 when
          accuracy is not defined, float64 scalar workers asked to `stop`,
          bool: the update was skipped), the first three as eager tensors.

        Raises:
          FloatingPointError: the gradients hold NaN or Inf and on_nonfinite
            is "raise" (no update was applied; the step is not counted).
        """
        number = int(self._step.numpy()) + 1
        update = number % self._state.accumulate_steps == 0
        if self._train_fns[update] is None:
            self._train_fns[update] = tf.function(
                functools.partial(self._graph.train, update=update),
                input_signature=[signature(x), signature(y), tf.TensorSpec([], tf.int32),
                                 tf.TensorSpec([], tf.float64)], autograph=False)
        with self._options.cluster.detect_lost_workers(), \
                progress.timed(f"training step {number}", number):
            loss, correct, stops, finite, report, tower_losses, losses_finite, seconds = (
                self._train_fns[update](x, y, tf.constant(batch, tf.int32),
                                        tf.constant(float(stop), tf.float64)))
        self.tower_times.add(number, seconds.numpy())
        raises = self._options.on_nonfinite == "raise"
        if scales_loss(self._towers.optimizers[0]):
            # Non-finite gradients are how a loss scale finds its level; a
            # non-finite loss is not.
            if raises and not bool(losses_finite):
                raise self._loss_error(number, tower_losses.numpy())
        elif raises and not bool(finite):
            raise nonfinite_error(report.numpy(), number, self._towers, self._options.cluster,
                                  self._options.reduction.compression)
        return loss, correct, stops, not bool(finite)

    def _loss_error(self, number, tower_losses):
        """The FloatingPointError of a step (with a LossScaleOptimizer) whose loss is not finite."""
        bad = [k for k, value in enumerate(tower_losses) if not math.isfinite(value)]
        where = (f"tower {bad[0]} ({self._towers.devices[bad[0]]})" if bad
                 else "a tower of another worker")
        return FloatingPointError(
            f"step {number}: {where} computed a NaN or Inf loss; no update was applied and the "
            "checkpoints stay as they were")

    def tracing_counts(self):
        """{"train", "evaluate", "predict"} -> times each was traced (0: never run).

        With accumulate_steps > 1, "accumulate" too (the steps between
        updates). Each is traced once for the shapes and dtypes of its first
        batch; a count above 1 means retracing (another dtype or rank of input).
        """
        functions = [("train", self._train_fns[True]), ("evaluate", self._eval_fn),
                     ("predict", self._predict_fn)]
        if self._state.accumulate_steps > 1:
            functions.append(("accumulate", self._train_fns[False]))
        return {name: 0 if fn is None else fn.experimental_get_tracing_count()
                for name, fn in functions}

    def evaluate(self, x, y):
        """Runs StepGraph.evaluate on the global batch x, y."""
        if self._eval_fn is None:
            self._eval_fn = tf.function(
                self._graph.evaluate,
                input_signature=[signature(x), signature(y)], autograph=False)
        return self._eval_fn(x, y)

    def predict(self, x):
        """Runs StepGraph.predict on the global batch of inputs x."""
        if self._predict_fn is None:
            self._predict_fn = tf.function(
                self._graph.predict,
                input_signature=[signature(x)], autograph=False)
        return self._predict_fn(x)


def build_run(models, optimizers, options, counters, x, describe, restore=None):
    """Builds the towers and everything that runs them; syncs the towers.

    Args:
      models, optimizers: lists of K, the replicas and their optimizers.
      options: StepOptions.
      counters: (step counter, epoch totals) tf.Variables.
      x: a batch [batch, ...] to build unbuilt models with, or None.
      describe: str, more settings the workers of a cluster must agree on.
      restore: a checkpoint prefix to restore before the first broadcast ("" on
        the workers of a cluster that receive rank 0's), or None.

    Returns:
      (StepFunctions, TrainerCheckpoint).

    Raises:
      ValueError: the towers differ, the workers differ, or the checkpoint
        does not match.
    """
    first_tower = options.cluster.rank * len(options.devices)
    built = build_towers(models, optimizers, options.devices, x,
                         (options.zero_stage, options.total_towers, first_tower))
    # Before the first collective: a worker that differs fails now, on all.
    check_workers_agree(options.cluster, len(options.devices),
                        f"{options.describe()}, {describe}",
                        describe_variables(built.variables[0]))
    state = TowerState(built, options.accumulate_steps, options.powersgd, HOST,
                       built.sharding.sum_specs())
    checkpoint = TrainerCheckpoint(built, *counters, state, options)
    if restore is not None:
        # Before the step functions exist: if it fails, the next call builds again.
        checkpoint.restore(restore)
    steps = StepFunctions(built, options, state, *counters)
    steps.broadcast()
    if restore is not None:
        checkpoint.finish_restore()
    return steps, checkpoint
