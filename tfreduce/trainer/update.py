"""From the towers' gradients to the update: accumulation, PowerSGD, the non-finite guard.

One update of a step, in order:

1. gradient accumulation (`accumulate_steps=M`, Horovod's
   backward_passes_per_step, DDP's no_sync): the M-1 steps between updates
   only add each tower's gradients into its own sums, reducing no
   gradient; the M-th adds its own, divides by the examples of the M
   micro-batches and goes on;
2. the all-reduce: the trainer's (any algorithm, one process or a cluster),
   or PowerSGD around it (tfreduce.algorithms.powersgd);
3. one finiteness check on tower 0's reduced gradients (a NaN or Inf on any
   tower reaches every tower's sum, so one check sees it) that decides for
   every tower at once: apply the update, or skip it. What was non-finite
   (which tower, which variable) is worked out only when the check fails;
4. the commit: a step is a transaction. Only when it applies do PowerSGD's
   new Q and error feedback take effect; when it skips, the moving
   statistics and seed states its forward pass moved go back to those of
   the update cycle's start, so the run goes on as if the cycle's batches
   had not been in the stream.

The per-tower state (the sums, PowerSGD's Q and error feedback) is never
broadcast from tower 0: it is each tower's own, and it is checkpointed per
tower.
"""

import tensorflow as tf

from tfreduce.basis import kerases
from tfreduce.algorithms.powersgd import PowerSGDState, powersgd_reduce
from tfreduce.basis.contract import check_flag, values_of
from tfreduce.buffers.compression import Compression

ON_NONFINITE = ("raise", "skip")


def check_update_options(average, accumulate_steps, on_nonfinite):
    """Raises ValueError/TypeError for a bad average, accumulate_steps or on_nonfinite.

    Args:
      average: bool.
      accumulate_steps: int >= 1.
      on_nonfinite: "raise" or "skip".
    """
    check_flag(average, "average")
    if isinstance(accumulate_steps, bool) or not isinstance(accumulate_steps, int):
        raise TypeError(f"accumulate_steps must be an int >= 1, got {accumulate_steps!r}")
    if accumulate_steps < 1:
        raise ValueError(
            f"accumulate_steps must be >= 1 (1: an update every step), got {accumulate_steps}")
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")


def scales_loss(optimizer):
    """bool: Keras' LossScaleOptimizer (either Keras'), which skips non-finite steps itself."""
    return kerases.scales_loss(optimizer)


class TowerState:
    """The per-tower state of the update, created once the towers are built.

    Args:
      towers: Towers, built.
      accumulate_steps: int M >= 1.
      powersgd: a tfreduce.PowerSGD, or None (no PowerSGD state).
      host: the device of the count of accumulated examples.
      sum_specs: K lists of (shape, dtype) of tower k's sums; None: the
        shapes of its trainable variables (ZeRO stage 2 sums its shards).

    Attributes:
      sums: K x N list of tf.Variables (None where M = 1), tower k's sum of
        the gradients (or of its reduced shards) since the last update, on
        devices[k].
      examples: float64 scalar tf.Variable, the examples those sums cover.
      powersgd: PowerSGDState, or None.
      saved: K x F list of tf.Variables, tower k's forward state (moving
        statistics, seed states) as the current update cycle began.
    """

    def __init__(self, towers, accumulate_steps, powersgd, host, sum_specs=None):
        self.devices = towers.devices
        self.accumulate_steps = accumulate_steps
        self.sums = None
        self.examples = None
        if sum_specs is None:
            sum_specs = [[(v.shape, v.dtype) for v in row] for row in towers.trainable]
        if accumulate_steps > 1:
            self.sums = []
            for k, device in enumerate(towers.devices):
                with tf.device(device), tf.name_scope(f"accumulated_tower{k}"):
                    self.sums.append([tf.Variable(tf.zeros(shape, dtype), trainable=False,
                                                  name=f"sum{n}")
                                      for n, (shape, dtype) in enumerate(sum_specs[k])])
            with tf.device(host):
                self.examples = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                            name="accumulated_examples")
                # Not checkpointed: a checkpoint's sums are finite, so were
                # the losses of its cycle.
                self.losses_finite = tf.Variable(True, trainable=False,
                                                 name="cycle_losses_finite")
        self.powersgd = None
        if powersgd is not None:
            self.powersgd = PowerSGDState(powersgd, towers.devices, towers.trainable[0])
        self.forward = towers.forward
        self.saved = []
        for k, device in enumerate(towers.devices):
            with tf.device(device), tf.name_scope(f"forward_state_tower{k}"):
                self.saved.append([tf.Variable(v, trainable=False, name=f"saved{i}")
                                   for i, v in enumerate(towers.forward[k])])

    def save_forward(self, always=False):
        """Keeps the forward state as an update cycle begins (its first micro-batch).

        Not checkpointed: after a restore (``always``) it is kept again, so a
        cycle resumed midway and then skipped goes back to the resumed state.
        """
        def save():
            for row, saved in zip(self.forward, self.saved):
                for v, s in zip(row, saved):
                    s.assign(v)
        if not any(self.forward):
            return
        if self.examples is None or always:
            save()
        else:
            tf.cond(tf.equal(self.examples, 0.0), save, lambda: None)

    def commit(self, finite, pending):
        """Ends an update: the pending state on commit, the forward state back on a skip.

        A step whose reduced gradients are not finite changes nothing (its
        optimizers apply nothing, see ``apply_gradients``): PowerSGD's error
        feedback and Q keep their values, and the moving statistics and
        seed states go back to those of the cycle's start.

        Args:
          finite: bool scalar, the step commits.
          pending: K lists of (tf.Variable, value), tower k's new state.
        """
        for k, device in enumerate(self.devices):
            def keep(k=k):
                for v, value in pending[k]:
                    v.assign(value)

            def restore(k=k):
                for v, s in zip(self.forward[k], self.saved[k]):
                    v.assign(s)

            if pending[k] or self.forward[k]:
                with tf.device(device), tf.name_scope(f"commit_tower{k}"):
                    tf.cond(finite, keep, restore)

    def cycle_losses_finite(self, finite, update):
        """bool scalar: every loss of the update cycle so far is finite, this step's included.

        Args:
          finite: bool scalar, this step's losses (of every worker) are finite.
          update: bool, this step ends the cycle: the next one starts afresh.
        """
        if self.examples is None:
            return finite
        cycle = tf.logical_and(self.losses_finite.read_value(), finite)
        self.losses_finite.assign(tf.constant(True) if update else cycle)
        return cycle

    def tower_variables(self, k):
        """Tower k's own variables (sums, Q, error feedback), for checkpoints."""
        own = list(self.sums[k]) if self.sums else []
        return own + (self.powersgd.tower_variables(k) if self.powersgd else [])

    def checkpointed(self):
        """{name: trackable} of this state for tf.train.Checkpoint; {} when there is none."""
        if self.sums is None and self.powersgd is None:
            return {}
        parts = {"tower_state": [self.tower_variables(k) for k in range(len(self.devices))]}
        if self.examples is not None:
            parts["accumulated_examples"] = self.examples
        return parts

    def reset(self):
        """Empties the sums and restarts PowerSGD (Q from its seed, no error)."""
        if self.sums:
            for row in self.sums:
                for v in row:
                    v.assign(tf.zeros_like(v))
            self.examples.assign(0.0)
            self.losses_finite.assign(True)
        if self.powersgd:
            self.powersgd.reset()

    def accumulate(self, all_grads, batch):
        """Adds each tower's gradients into its sums, on its device; counts batch."""
        for k, (grads, sums) in enumerate(zip(all_grads, self.sums)):
            with tf.device(self.devices[k]), tf.name_scope(f"accumulate_tower{k}"):
                for g, v in zip(grads, sums):
                    if g is not None:
                        # Densified: a sum of IndexedSlices grows every step.
                        v.assign_add(tf.convert_to_tensor(g))
        self.examples.assign_add(tf.cast(batch, tf.float64))

    def take(self, all_grads, batch):
        """The gradients of the update: this step's plus the sums, per example.

        The sums are emptied (read first: the reads come before the
        assignments in the step's order).

        Returns:
          K x N list, on each tower; all_grads itself when M = 1.
        """
        if self.sums is None:
            return all_grads
        examples = self.examples + tf.cast(batch, tf.float64)
        out = []
        for k, (grads, sums) in enumerate(zip(all_grads, self.sums)):
            with tf.device(self.devices[k]), tf.name_scope(f"accumulated_tower{k}"):
                row = []
                for g, v in zip(grads, sums):
                    if g is None:
                        row.append(None)
                        continue
                    total = tf.convert_to_tensor(g) + v.read_value()
                    row.append(total / tf.cast(examples, total.dtype))
                out.append(row)
        with tf.control_dependencies([g for row in out for g in row if g is not None]):
            for row in self.sums:
                for v in row:
                    v.assign(tf.zeros_like(v))
            self.examples.assign(0.0)
        return out

    def reduce(self, all_grads, allreduce, average, num_replicas):
        """The all-reduce of the update: plain, or PowerSGD around `allreduce`.

        Returns:
          (K x N reduced gradients, pending state for ``commit``).
        """
        if self.powersgd is None:
            return allreduce(all_grads, average), [[] for _ in self.devices]
        return powersgd_reduce(all_grads, self.powersgd, allreduce, average, num_replicas)


def all_finite(grads, device):
    """bool scalar: every element of `grads` is finite; one check, on `device`.

    Args:
      grads: list of N tensors (IndexedSlices and None allowed), tower 0's
        reduced gradients.
      device: where the check runs (tower 0's device).
    """
    with tf.device(device), tf.name_scope("nonfinite_check"):
        checks = [_finite(g) for g in grads if g is not None and g.dtype.is_floating]
        return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


def locate_nonfinite(finite, all_grads, reduced, devices, host):
    """int32 [K + 1, N]: 1 where a gradient holds NaN or Inf, computed only if not `finite`.

    Row k is tower k's gradient (before the all-reduce), row K the reduced
    gradient on tower 0 (with ZeRO, a list of the towers' pieces of it); all
    zeros when `finite` (a branch not taken costs nothing).
    """
    num_towers, num_vars = len(all_grads), len(reduced)

    def find():
        # Built on every trace: 3 ops per gradient, one stack per row.
        rows = []
        for k, grads in enumerate(list(all_grads) + [reduced]):
            with tf.device(devices[k] if k < num_towers else devices[0]):
                rows.append(tf.stack([_finite(g) for g in grads]))
        with tf.device(host):
            return tf.cast(tf.logical_not(tf.stack(rows)), tf.int32)

    with tf.device(host):
        zeros = tf.zeros([num_towers + 1, num_vars], tf.int32)
    if not num_vars:
        return zeros
    return tf.cond(finite, lambda: zeros, find)


def _finite(g):
    # bool scalar: every element of g (or of each of a list of pieces) is finite.
    checks = [tf.reduce_all(tf.math.is_finite(values_of(p)))
              for p in (g if isinstance(g, list) else [g])
              if p is not None and p.dtype.is_floating]
    if len(checks) > 1:
        return tf.reduce_all(tf.stack(checks))
    return checks[0] if checks else tf.constant(True)


def apply_gradients(towers, reduced, finite, losses_finite):
    """Each tower's optimizer applies its reduced gradients, all or none.

    The update runs only where `finite` is True: one decision for every
    tower. A LossScaleOptimizer decides itself, from the same reduced values
    on every tower (lowering its scale when it skips), but only when every
    loss is finite: a NaN or Inf loss is bad data, not a scale too high, and
    leaves the scale and its counter as they were.

    Args:
      towers: Towers.
      reduced: K x N reduced gradients.
      finite: bool scalar, they are all finite.
      losses_finite: bool scalar, every loss of the update cycle is finite.
    """
    for k, (optimizer, device) in enumerate(zip(towers.optimizers, towers.devices)):
        pairs = list(zip(reduced[k], towers.trainable[k]))
        with tf.device(device), tf.name_scope(f"tower{k}_apply"):
            def apply(optimizer=optimizer, pairs=pairs):
                optimizer.apply_gradients(pairs)

            tf.cond(losses_finite if scales_loss(optimizer) else finite, apply, lambda: None)


def nonfinite_error(report, step, towers, cluster, compression=Compression.none):
    """The FloatingPointError of a step whose gradients are not finite.

    Args:
      report: np.ndarray int [K + 1, N] from locate_nonfinite.
      step: int, the 1-based number of the step.
      towers: Towers, whose variables name the columns.
      cluster: the tfreduce.Cluster, or a LocalCluster.
      compression: the reduction's compression.Compressor: a 16-bit wire
        dtype is named as a cause of an overflowing sum.

    Returns:
      FloatingPointError naming the step, the first tower and variable.
    """
    num_towers = len(towers.devices)
    names = [kerases.variable_name(v) for v in towers.trainable[0]]
    advice = ("no update was applied and the checkpoints stay as they were; lower the "
              "learning rate, or pass on_nonfinite='skip' to skip such steps")
    for k in range(num_towers):
        bad = [names[n] for n in range(len(names)) if report[k][n]]
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            return FloatingPointError(
                f"step {step}: tower {k} ({towers.devices[k]}) computed NaN or Inf in the "
                f"gradient of variable {bad[0]!r}{more}; {advice}")
    bad = [names[n] for n in range(len(names)) if report[num_towers][n]]
    where = ("a tower of another worker, or the sum overflowed"
             if not cluster.is_local else "every tower's gradient is finite: the sum overflowed")
    if compression.compresses:
        limit = tf.as_dtype(compression.dtype).max
        where += (f"; compression={compression.name!r} crosses devices in "
                  f"{compression.dtype.name}, at most {limit:g}")
    return FloatingPointError(
        f"step {step}: the all-reduced gradient of variable {bad[0] if bad else '?'!r} is NaN "
        f"or Inf ({where}); {advice}")
