"""Graph builders of one step: train, evaluate, predict, and their syncs.

The builders are methods of StepGraph, which holds the towers, the
options and the per-tower state; they set no state of the trainer while
tracing. One exception is inherent: in a cluster each trace draws the
cross-worker collectives' instance keys from the cluster's CollectiveKeys,
so a step function must be traced once, the same way on every worker
(hence the open batch axis of every input signature). The caller reads
all it needs from the returned values; a correct count of -1 means
accuracy is not defined for the model's outputs. StepFunctions
(step_functions.py) holds the tf.functions made from them.

The global batch is split on the host into K contiguous shards, the first
B % K one example larger (tfreduce.basis.contract.shard_sizes), one per tower.
"""

import functools

import tensorflow as tf

from tfreduce.doors.multiworker import sum_over_workers
from tfreduce.trainer.batching import split_shards
from tfreduce.trainer.compiled import TowerPasses
from tfreduce.trainer.determinism import DeterministicStep, micro_batch_passes
from tfreduce.trainer.losses import correct_count, tower_loss_sum
from tfreduce.trainer.statistics import sync_moving
from tfreduce.trainer.towertimes import split_stamp, stamp_towers
from tfreduce.trainer.update import scales_loss

# The device that holds the step counter and where the global batch is split
# and per-tower results are gathered: the host, which every tower can reach.
HOST = "/device:CPU:0"


def make_counters():
    """The run's variables on the host: (step counter, epoch totals).

    The int64 step counter, and the float64 [3] loss sum, correct count and
    examples of the current epoch, with which a resume mid-epoch logs the
    same epoch means as a run in one go.
    """
    with tf.device(HOST):
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        totals = tf.Variable(tf.zeros([3], tf.float64), trainable=False, name="epoch_totals")
    return step, totals


class StepGraph:
    """The graph builders of one trainer's steps: train, evaluate, predict.

    It owns what every step reads (the towers, the options, the per-tower
    state and the step counter); the towers' sharding builds the update
    (``trainer.sharding``) and the cluster orders the collectives
    (``order_after``), so one path serves one process and a cluster, and
    every ZeRO stage.

    Args:
      towers: Towers, this worker's K built replicas.
      options: StepOptions.
      state: TowerState, the per-tower state of the update.
      counter: the int64 step counter tf.Variable, incremented by one unless
        the step's gradients are not finite and on_nonfinite is "raise".

    Attributes:
      towers, options, state, counter: as given.
      host: the device where the global batch is split and results gathered.
    """

    host = HOST

    def __init__(self, towers, options, state, counter):
        self.towers = towers
        self.options = options
        self.state = state
        self.counter = counter

    @functools.cached_property
    def passes(self):
        """The towers' forward and backward passes (trainer.compiled: XLA or not)."""
        options = self.options
        # Scaled before the reduction so that its sum (or mean) is the gradient
        # of the global-batch mean loss; every tower adds the same regularisation
        # term, which a sum over the T towers would count T times.
        numerator = options.total_towers if options.average else 1
        reg_weight = 1.0 if options.average else 1.0 / options.total_towers

        def combine(loss_sum, reg, batch):
            dtype = loss_sum.dtype
            scale = tf.cast(numerator, dtype) / tf.cast(batch, dtype)
            return loss_sum * scale + reg * reg_weight

        return TowerPasses(self.towers, options.loss_fn, combine, options.jit_compile)

    @functools.cached_property
    def micro_passes(self):
        """The passes of a deterministic step's micro-batches (trainer.determinism)."""
        return micro_batch_passes(self.towers, self.options)

    def _tower_gradients(self, x_shards, y_shards, batch, accumulating):
        """Forward and backward on every tower.

        Args:
          accumulating: bool, the gradients go into sums that the update divides
            by the examples of all its micro-batches: each is the gradient of
            this micro-batch's mean loss, as in a step without accumulation (so
            a float16 backward pass sees the same magnitudes), times its number
            of examples B, so the update is the gradient of the mean over all.

        Returns:
          (all_grads K x N, loss_sums [K], corrects [K] int64 or None, regs [K]).
        """
        towers = self.towers
        all_grads, loss_sums, corrects, regs = [], [], [], []
        for k, device in enumerate(towers.devices):
            with tf.device(device), tf.name_scope(f"tower{k}"):
                x_k = tf.nest.map_structure(tf.identity, x_shards[k])
                y_k = tf.nest.map_structure(tf.identity, y_shards[k])
                grads, loss_sum, y_pred, reg = self.passes(k, x_k, y_k, batch)
                if accumulating:
                    # Weighted by B after the backward pass, in the variables'
                    # dtype: the sums then add up per-example gradients.
                    grads = [None if g is None
                             else tf.convert_to_tensor(g) * tf.cast(batch, g.dtype)
                             for g in grads]
            all_grads.append(list(grads))
            loss_sums.append(loss_sum)
            regs.append(reg)
            corrects.append(correct_count(y_k, y_pred))
        return all_grads, loss_sums, corrects, regs

    def _forward(self, x, y, batch):
        """The towers' forward and backward passes on their shards of the global batch.

        Returns:
          (all_grads K x N, loss_sums [K], corrects [K] or None, regs [K],
          float64 [K] each tower's seconds to its gradients, sync: fn(after)
          that builds the sync of the BatchNorm moving statistics).
        """
        towers, options = self.towers, self.options
        if options.micro_batches:
            return DeterministicStep(towers, options, self.counter,
                                     self.micro_passes).forward(x, y, batch, HOST)
        sizes, (x_shards, y_shards) = split_shards([x, y], len(towers.devices), HOST)
        start = split_stamp(x_shards, HOST)  # the towers start from here
        all_grads, loss_sums, corrects, regs = self._tower_gradients(
            x_shards, y_shards, batch, self.state.accumulate_steps > 1)
        seconds = stamp_towers(start, towers.devices, all_grads, loss_sums, HOST)

        def sync(after):
            sync_moving(towers, sizes, batch, after, options.allreduce_exact)

        return all_grads, loss_sums, corrects, regs, seconds, sync

    def train(self, x, y, batch, stop, update=True):
        """One synchronous step; traced once by tf.function (once more without update).

        Args:
          x, y: [b, ...], this worker's part of the global batch (all of it alone).
          batch: int32 scalar B, the size of the global batch.
          stop: float64 scalar, 1 when this worker was asked to stop (SIGTERM).
          update: bool, reduce and apply (False: only accumulate; the only
            cross-device reductions are then BatchNorm's moving statistics, in a
            cluster the step's metrics, and at ZeRO stage 2 the reduce-scatter).

        Returns:
          (float64 mean loss over the global batch plus regularisation; int64
          correct predictions in it, -1 when accuracy is not defined; float64
          workers asked to stop, summed over the cluster; bool, the update
          applied (see sharding.ReplicatedState.update); int32 [K + 1, N], where
          the gradients are not finite (update.locate_nonfinite); float64 [K],
          each tower's loss sum; bool, every loss of the update cycle on every
          tower of every worker is finite; float64 [K], each tower's seconds
          from the split to its gradients (towertimes.stamp_towers), zeros when
          deterministic). Unshaped
          ones are scalars.
        """
        towers, options, state = self.towers, self.options, self.state
        # A step is a transaction: what its forward pass changes is kept first,
        # to be put back if the update cycle does not commit.
        state.save_forward()
        all_grads, loss_sums, corrects, regs, tower_seconds, sync = self._forward(x, y, batch)
        with tf.device(HOST):
            tower_losses = tf.stack([tf.cast(loss, tf.float64) for loss in loss_sums])
        has_accuracy = corrects[0] is not None
        # First, so that a non-finite loss on any worker is known to all (the
        # stop requests are counted once per worker, on its tower 0).
        stops = [stop] + [None] * (len(towers.devices) - 1)
        loss_sums, stops, corrects = sum_over_workers(
            [loss_sums, stops, corrects], towers.devices, options.cluster,
            options.allreduce_exact)
        after = options.cluster.order_after(loss_sums[:1])
        with tf.device(HOST):
            stop = tf.add_n(stops)
            losses_finite = tf.reduce_all(tf.math.is_finite(
                tf.stack([tf.cast(loss, tf.float64) for loss in loss_sums])))
        losses_finite = state.cycle_losses_finite(losses_finite, update)
        pending = None
        if update:
            finite, pending, report, after = towers.sharding.update(
                self, all_grads, batch, losses_finite, after)
        else:
            after = towers.sharding.accumulate(self, all_grads, batch, after)
            with tf.device(HOST):
                finite = tf.constant(True)
                report = tf.zeros([len(all_grads) + 1, len(all_grads[0])], tf.int32)
        # Every step, between updates too: each forward pass moved every tower's
        # BatchNorm statistics, and the replicas must stay equal.
        sync(after)
        if pending is not None:
            state.commit(finite, pending)
        with tf.device(HOST):
            # A step that is about to raise is not counted: its update was not applied.
            if options.on_nonfinite == "skip":
                counted = tf.constant(True)
            else:
                counted = losses_finite if scales_loss(towers.optimizers[0]) else finite
            self.counter.assign_add(tf.cast(counted, tf.int64))
            dtype = loss_sums[0].dtype
            mean_loss = tf.add_n(loss_sums) / tf.cast(batch, dtype) + tf.cast(regs[0], dtype)
            correct = (tf.cast(tf.add_n(corrects), tf.int64) if has_accuracy
                       else tf.constant(-1, tf.int64))
        return (tf.cast(mean_loss, tf.float64), correct, stop, finite, report, tower_losses,
                losses_finite, tower_seconds)

    def evaluate(self, x, y):
        """Sum of losses and correct predictions over a global batch x, y, split across towers.

        Returns:
          (float64 scalar loss sum, int64 scalar correct count, -1 when accuracy
          is not defined).
        """
        towers = self.towers
        _, (x_shards, y_shards) = split_shards([x, y], len(towers.devices), HOST)
        loss_sums, corrects = [], []
        for k, (model, device) in enumerate(zip(towers.models, towers.devices)):
            with tf.device(device), tf.name_scope(f"tower{k}"):
                loss_sum, y_pred = tower_loss_sum(
                    self.options.loss_fn, model, x_shards[k], y_shards[k], training=False
                )
                loss_sums.append(tf.cast(loss_sum, tf.float64))
                corrects.append(correct_count(y_shards[k], y_pred))
        with tf.device(HOST):
            correct = tf.add_n(corrects) if corrects[0] is not None else tf.constant(-1, tf.int64)
            return tf.add_n(loss_sums), correct

    def predict(self, x):
        """The towers' outputs on their shards of x, concatenated in input order."""
        towers = self.towers
        _, (x_shards,) = split_shards([x], len(towers.devices), HOST)
        outputs = []
        for k, (model, device) in enumerate(zip(towers.models, towers.devices)):
            with tf.device(device), tf.name_scope(f"tower{k}"):
                outputs.append(model(x_shards[k], training=False))
        with tf.device(HOST):
            return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *outputs)
