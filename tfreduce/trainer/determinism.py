"""The deterministic step: the same bits for any number of towers (``deterministic=True``).

The global batch of B examples is split into M micro-batches by the one
shard rule (``contract.shard_sizes(B, M)``), so micro-batch j is the same
rows whatever K is. Tower k holds micro-batches k*s .. (k+1)*s - 1 (s =
M / K, a power of two) and runs each one's forward and backward pass on
its own, at the micro-batch's shape (across W workers, worker w takes
micro-batches w*M/W .. (w+1)*M/W - 1 and its towers those in turn):

- the gradient is that of the micro-batch's loss sum over B (plus the
  regularisation over M), so the sum over micro-batches is the gradient of
  the global-batch mean;
- the seed state of every random layer (Dropout) is set to (its seed,
  step * M + j) first, so micro-batch j draws the same numbers on any tower;
- every BatchNormalization layer starts from the step's moving statistics
  and normalises by the micro-batch's own (ghost batch norm, Hoffer et al.
  2017); its moving statistics after micro-batch j, weighted by the
  micro-batch's share of B, are summed like the gradients.

Each tower sums its micro-batches in the fixed tree (``algorithms.tree``),
and the reduction (``Reduction(deterministic=True)``) sums the towers' sums
in the levels above. The batch's order is the trainer's: a function of the
seed and the epoch only.
"""

import tensorflow as tf

from tfreduce.algorithms.tree import fix_summation_order, tree_sum, tree_tower_counts
from tfreduce.basis.contract import shard_sizes
from tfreduce.trainer.batching import split_shards
from tfreduce.trainer.compiled import TowerPasses
from tfreduce.trainer.losses import correct_count

__all__ = ["check_deterministic", "check_batch_for_micro_batches", "fix_order",
           "micro_batch_passes", "DeterministicStep"]

#: micro_batches when deterministic=True and none is given.
DEFAULT_MICRO_BATCHES = 8


def check_deterministic(micro_batches, total_towers, towers_per_worker, accumulate_steps,
                        powersgd):
    """Checks a deterministic trainer's settings (its reduction has deterministic=True).

    Raises:
      TypeError: micro_batches not an int.
      ValueError: micro_batches < 1; T towers that do not hold whole
        subtrees (naming the T that do), or several workers whose towers are
        not a power of two each; accumulation or PowerSGD, whose
        sums are not in the tree.
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int):
        raise TypeError(f"micro_batches must be an int, got {type(micro_batches).__name__} "
                        f"{micro_batches!r}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    able = tree_tower_counts(micro_batches)
    if total_towers not in able:
        raise ValueError(
            f"deterministic=True with {total_towers} towers and micro_batches={micro_batches}: "
            f"each tower must hold a power of two of the micro-batches (a whole subtree of "
            f"the sum), so the towers can be {able}; or choose micro_batches a power-of-two "
            f"multiple of {total_towers}")
    if total_towers > towers_per_worker and towers_per_worker & (towers_per_worker - 1):
        raise ValueError(
            f"deterministic=True with {towers_per_worker} towers per worker: each worker's "
            f"towers must be a whole subtree of the sum, a power of two of them")
    for given, name in ((accumulate_steps > 1, f"accumulate_steps={accumulate_steps}"),
                        (powersgd is not None, f"powersgd={powersgd!r}")):
        if given:
            raise ValueError(f"deterministic=True with {name}: those sums are not in the fixed "
                             f"tree yet; leave it out (docs/determinism.md)")


def fix_order():
    """Turns TF's op determinism on and the Grappler passes that regroup sums off, process-wide.

    Op determinism picks deterministic kernels where TF has both (mostly on
    GPUs) and refuses the ops that have none; the Grappler passes are
    ``algorithms.tree.REORDERING_PASSES``.
    """
    fix_summation_order()
    tf.config.experimental.enable_op_determinism()


def check_batch_for_micro_batches(batch, micro_batches):
    """Raises ValueError when a global batch has fewer examples than micro-batches."""
    if batch < micro_batches:
        raise ValueError(f"deterministic=True: a global batch of {batch} examples cannot fill "
                         f"micro_batches={micro_batches} (each needs at least one example); "
                         f"use a batch of at least {micro_batches}, or fewer micro-batches")


def micro_batch_passes(towers, options):
    """The towers' passes of one micro-batch (trainer.compiled): the gradient of its loss
    sum over B plus the regularisation over M."""
    micro_batches = options.micro_batches

    def combine(loss_sum, reg, batch):
        return loss_sum / tf.cast(batch, loss_sum.dtype) + reg / micro_batches

    return TowerPasses(towers, options.loss_fn, combine, options.jit_compile)


class DeterministicStep:
    """The forward and backward passes of a deterministic step, micro-batch by micro-batch.

    Args:
      towers: Towers, this process's K built replicas.
      options: StepOptions, with ``micro_batches`` M.
      counter: the int64 step counter tf.Variable (the random layers' seeds).
      passes: ``micro_batch_passes(towers, options)``, kept by the caller
        (compiled once, used by every trace).
    """

    def __init__(self, towers, options, counter, passes):
        self.towers = towers
        self.options = options
        self.counter = counter
        self.passes = passes
        # This worker's micro-batches: first .. first + count - 1 of the M.
        self.count = options.micro_batches // options.cluster.num_workers
        self.first = options.cluster.rank * self.count

    def forward(self, x, y, batch, host):
        """The step's forward and backward passes, as ``step.StepGraph`` takes them.

        Args:
          x, y: [b, ...], this worker's micro-batches of the global batch.
          batch: int32 scalar B.
          host: str, the device where the batch is split.

        Returns:
          (all_grads K x N, loss_sums [K], corrects [K] or None, regs [K],
          float64 [K] zeros (TF's op determinism refuses the Timestamp op
          that times the towers), sync: fn(after) that builds the sync of
          the moving statistics).
        """
        count = self.count
        with tf.device(host):
            sizes = shard_sizes(batch, self.options.micro_batches)[self.first:self.first + count]
            _, (x_parts, y_parts) = split_shards([x, y], count, host, sizes)
            seconds = tf.zeros([len(self.towers.devices)], tf.float64)
        all_grads, loss_sums, corrects, regs, moving = self._gradients(x_parts, y_parts, sizes,
                                                                       batch)
        return (all_grads, loss_sums, corrects, regs, seconds,
                lambda after: self._sync_moving(moving, after))

    def _gradients(self, x_parts, y_parts, sizes, batch):
        """Every tower's tree sum over its micro-batches.

        Returns:
          (all_grads K x N, loss_sums [K], corrects [K] or None, regs [K],
          moving K x V: the towers' sums of the weighted moving statistics).
        """
        towers, count = self.towers, self.options.micro_batches
        per_tower = self.count // len(towers.devices)
        step = self.counter.read_value()
        out = ([], [], [], [], [])
        for k, device in enumerate(towers.devices):
            with tf.device(device), tf.name_scope(f"tower{k}"):
                # Every micro-batch starts from the step's moving statistics.
                start = [tf.identity(v) for v in towers.moving[k]]
                leaves = [self._micro_batch(k, j, (x_parts[j], y_parts[j]), start,
                                            (sizes[j], batch, step))
                          for j in range(k * per_tower, (k + 1) * per_tower)]
                grads, losses, corrects, regs, moving = zip(*leaves)
                out[0].append([None if grads[0][n] is None
                               else tree_sum([g[n] for g in grads], name=f"grad{n}")
                               for n in range(len(grads[0]))])
                out[1].append(tree_sum(losses, name="loss"))
                out[2].append(None if corrects[0] is None else tree_sum(corrects, name="correct"))
                out[3].append(regs[0])
                out[4].append([tree_sum([m[v] for m in moving], name=f"moving{v}")
                               for v in range(len(moving[0]))])
                # Every tower's seeds as after the whole batch, for any K.
                self._set_seeds(k, (step + 1) * count)
        return out

    def _set_seeds(self, k, counter):
        """Sets tower k's random layers' seed states to (their seed, counter)."""
        for v in self.towers.forward[k][len(self.towers.moving[k]):]:
            v.assign(tf.stack([v[0], tf.cast(counter, v.dtype)]))

    def _micro_batch(self, k, j, data, start, counts):
        # Micro-batch j on tower k: (grads, loss sum, correct, reg, weighted
        # moving statistics); counts: (its size, the global batch, the step).
        towers, options = self.towers, self.options
        (x, y), (size, batch, step) = data, counts
        for v, value in zip(towers.moving[k], start):
            v.assign(value)
        self._set_seeds(k, step * options.micro_batches + self.first + j)
        with tf.name_scope(f"micro{j}"):
            grads, loss_sum, y_pred, reg = self.passes(
                k, tf.nest.map_structure(tf.identity, x), tf.nest.map_structure(tf.identity, y),
                batch)
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        share = tf.cast(size, tf.float64) / tf.cast(batch, tf.float64)
        moving = [tf.identity(v) * tf.cast(share, v.dtype) for v in towers.moving[k]]
        return grads, loss_sum, correct_count(y, y_pred), reg, moving

    def _sync_moving(self, moving, after):
        """Sets the moving statistics to the tree sum of the micro-batches' weighted ones."""
        towers = self.towers
        if not towers.moving[0]:
            return
        with tf.control_dependencies(after):
            reduced = self.options.allreduce_exact(moving, average=False)
        for k, device in enumerate(towers.devices):
            with tf.device(device):
                for v, value in zip(towers.moving[k], reduced[k]):
                    v.assign(value)
