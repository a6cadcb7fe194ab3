"""Where the towers' optimizer state lives: whole on every tower, or sharded (ZeRO).

The towers hold one of two sharding objects with the same methods, chosen
once by ``sharding_for`` from the run's ``zero_stage``:
``ReplicatedState`` (stage 0: every tower holds the whole optimizer state
and all-reduces the gradients, as in tensorpack's and Horovod's data
parallelism) and ``trainer.zero.ZeroState`` (stages 1 and 2: each tower
holds 1/T of it, Rajbhandari et al., SC 2020). The step's update and
accumulation, the optimizers' build, the broadcast and the checkpoint ask
the object, and so have one path each.

The methods both implement:

- ``targets(k)``: the variables tower k's optimizer is built on and updates;
- ``shared_variables(optimizer)``: the optimizer variables equal on every
  tower (broadcast from tower 0 and compared);
- ``check_loss_scaling(optimizers)``: raises where loss scaling cannot run;
- ``sum_specs()``: the shapes of the accumulation buffers (None: the
  variables');
- ``load_pieces(trainable)``: after a broadcast or restore;
- ``variables(k)``: the variables tower k holds besides model and optimizer;
- ``optimizer_state(optimizers, trainable, cluster)``: the checkpoint's
  ``OptimizerState``;
- ``whole_optimizer(optimizers)``: the optimizer an old checkpoint stored
  whole, or None;
- ``update(step, all_grads, batch, losses_finite, after)`` and
  ``accumulate(step, all_grads, batch, after)``: a step's graph.
"""

import tensorflow as tf

from tfreduce.trainer.optimizer_state import OptimizerState
from tfreduce.trainer.update import all_finite, apply_gradients, locate_nonfinite, scales_loss
from tfreduce.trainer.zero import ZeroState

__all__ = ["ReplicatedState", "sharding_for"]


def sharding_for(zero_stage, trainable, devices, total_towers, first_tower):
    """The towers' sharding: ReplicatedState at stage 0, else a ZeroState.

    Args:
      zero_stage: int in trainer.zero.ZERO_STAGES (checked by check_zero_stage).
      trainable: K x N list of the towers' trainable variables.
      devices: list of K canonical device names.
      total_towers: int T, the towers of every worker.
      first_tower: int, this worker's tower 0 among the T.
    """
    if zero_stage == 0:
        return ReplicatedState(trainable)
    return ZeroState(zero_stage, trainable, devices, total_towers, first_tower)


class ReplicatedState:
    """ZeRO stage 0: every tower holds the whole optimizer state and updates every variable.

    One update: the step's gradients (plus the accumulated sums) are
    all-reduced with the trainer's reduction (or PowerSGD around it),
    checked for NaN and Inf once, and applied by every tower's optimizer.

    Args:
      trainable: K x N list of the towers' trainable variables.
    """

    def __init__(self, trainable):
        self.trainable = trainable

    def targets(self, k):
        """The variables tower k's optimizer updates: all of its trainable ones."""
        return self.trainable[k]

    def shared_variables(self, optimizer):
        """Every variable of `optimizer`: each tower's equals tower 0's."""
        return list(optimizer.variables)

    def check_loss_scaling(self, optimizers):
        """Nothing to check: every tower holds every element."""

    def sum_specs(self):
        """None: the accumulation buffers have the variables' shapes."""
        return None

    def load_pieces(self, trainable):
        """Nothing to load: the optimizers update the variables themselves."""

    def variables(self, k):
        """[]: a tower holds nothing besides its model and optimizer."""
        return []

    def optimizer_state(self, optimizers, trainable, cluster):
        """The checkpoint's OptimizerState: tower 0's optimizer, whole variables."""
        sizes = [int(v.shape.num_elements()) for v in trainable[0]]
        return OptimizerState(optimizers[:1], trainable[:1], [[(0, size) for size in sizes]],
                              trainable[0])

    def whole_optimizer(self, optimizers):
        """Tower 0's optimizer, which checkpoints before optimizer_state stored whole."""
        return optimizers[0]

    def update(self, step, all_grads, batch, losses_finite, after):
        """The update of a step: reduce, check once, apply.

        Args:
          step: step.StepGraph, whose towers, options and state these are.
          all_grads: K x N, this step's gradients.
          batch: int32 scalar, the global batch.
          losses_finite: bool scalar, every loss of the update cycle, on every
            tower of every worker, is finite; a LossScaleOptimizer applies
            (or lowers its scale) only then.
          after: tensors the gradients' reduction runs after.

        Returns:
          (finite bool scalar: the update applied (with a LossScaleOptimizer,
          also every loss finite), pending: K lists of (tf.Variable, value),
          report int32 [K + 1, N] (see locate_nonfinite), the tensors a later
          collective must run after).
        """
        towers, options, state = step.towers, step.options, step.state
        grads = state.take(all_grads, batch)
        with tf.control_dependencies(after):
            reduced, pending = state.reduce(grads, options.allreduce, options.average,
                                            options.total_towers)
        finite = all_finite(reduced[0], towers.devices[0])
        report = locate_nonfinite(finite, grads, reduced[0], towers.devices, step.host)
        apply_gradients(towers, reduced, finite, losses_finite)
        if scales_loss(towers.optimizers[0]):
            # A non-finite loss skips the update even when its gradients are
            # finite: the commit and the skipped-step count follow.
            finite = tf.logical_and(finite, losses_finite)
        # Each worker's collectives run one after the other, in the same
        # order on every worker: independent ones could wait for each other.
        after = options.cluster.order_after(g for g in reduced[0] if g is not None)
        return finite, pending, report, after

    def accumulate(self, step, all_grads, batch, after):
        """A step between updates: each tower adds its gradients to its sums.

        Returns:
          the tensors a later collective must run after.
        """
        step.state.accumulate(all_grads, batch)
        return after
