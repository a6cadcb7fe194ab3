"""Graph builders of one step: train, evaluate, predict, and their syncs.

The builders are functions of their arguments (the towers, the all-reduce
callable, flags in StepOptions) that set no state of the trainer while
tracing. One exception is inherent: in a cluster each trace draws the
cross-worker collectives' instance keys from the cluster's CollectiveKeys,
so a step function must be traced once, the same way on every worker
(hence the open batch axis of every input signature).
Whatever the caller needs to know about the result it reads from the
returned values; a correct count of -1 means accuracy is not defined for the
model's outputs. StepFunctions, at the end, holds the tf.functions made from
them.

The global batch is split on the host into K contiguous shards, the first
B % K one example larger (tfreduce.contract.shard_sizes), one per tower.
"""

import functools

import tensorflow as tf

from tfreduce.contract import shard_sizes
from tfreduce.trainer.losses import correct_count, regularization, tower_loss_sum
from tfreduce.trainer.towers import collectives, sync_functions

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


def signature(t):
    """tf.TensorSpec of a batch like t, with the batch axis left open (None)."""
    return tf.TensorSpec([None] + t.shape[1:].as_list(), t.dtype)


def _split(tensors, num_towers):
    """Splits each [batch, ...] tensor into K contiguous shards on the host.

    Returns:
      (sizes int32 [K], one list of K shards per tensor).
    """
    with tf.device(HOST):
        sizes = shard_sizes(tf.shape(tensors[0])[0], num_towers)
        return sizes, [tf.split(t, sizes, num=num_towers) for t in tensors]


def _tower_gradients(towers, options, x_shards, y_shards, batch):
    """Forward and backward on every tower.

    Returns:
      (all_grads K x N, loss_sums [K], corrects [K] int64 or None, regs [K]).
    """
    all_grads, loss_sums, corrects, regs = [], [], [], []
    for k, (model, device) in enumerate(zip(towers.models, towers.devices)):
        with tf.device(device), tf.name_scope(f"tower{k}"):
            x_k = tf.identity(x_shards[k])
            y_k = tf.identity(y_shards[k])
            with tf.GradientTape() as tape:
                loss_sum, y_pred = tower_loss_sum(options.loss_fn, model, x_k, y_k, training=True)
                dtype = loss_sum.dtype
                # Scale before the reduction so that its sum (or mean)
                # is the gradient of the global-batch mean loss.
                numerator = options.total_towers if options.average else 1
                scale = tf.cast(numerator, dtype) / tf.cast(batch, dtype)
                reg = regularization(model, dtype)
                # Every tower adds the same regularisation term; a sum
                # over the T towers would count it T times.
                reg_weight = 1.0 if options.average else 1.0 / options.total_towers
                tower_loss = loss_sum * scale + reg * reg_weight
            grads = tape.gradient(tower_loss, towers.trainable[k])
        all_grads.append(list(grads))
        loss_sums.append(loss_sum)
        regs.append(reg)
        corrects.append(correct_count(y_k, y_pred))
    return all_grads, loss_sums, corrects, regs


def train_graph(towers, options, step, x, y, batch, stop):
    """One synchronous step; traced once by tf.function.

    Args:
      towers: Towers, this worker's K built replicas.
      options: StepOptions.
      step: the int64 step counter tf.Variable, incremented by one.
      x, y: [b, ...], this worker's part of the global batch (all of it in a
        single process).
      batch: int32 scalar B, the size of the global batch.
      stop: float64 scalar, 1 when this worker was asked to stop (SIGTERM).

    Returns:
      (float64 scalar, the mean loss over the global batch plus
      regularisation; int64 scalar, the correct predictions in the global
      batch, -1 when accuracy is not defined; float64 scalar, the workers
      asked to stop, summed over the cluster).
    """
    num_towers = len(towers.devices)
    allreduce = options.allreduce
    sizes, (x_shards, y_shards) = _split([x, y], num_towers)
    all_grads, loss_sums, corrects, regs = _tower_gradients(
        towers, options, x_shards, y_shards, batch
    )
    reduced = allreduce(all_grads, options.average)
    for k, (optimizer, device) in enumerate(zip(towers.optimizers, towers.devices)):
        with tf.device(device), tf.name_scope(f"tower{k}_apply"):
            optimizer.apply_gradients(zip(reduced[k], towers.trainable[k]))
    has_accuracy = corrects[0] is not None
    # Each worker's collectives run one after the other, in the same
    # order on every worker: independent ones could wait for each other.
    after = [g for g in reduced[0] if g is not None] if options.multiworker else []
    after = sync_moving(towers, sizes, batch, after, allreduce)
    if options.multiworker:
        loss_sums, corrects, stop = sum_metrics(
            towers.devices, loss_sums, corrects, stop, after, allreduce)
    with tf.device(HOST):
        step.assign_add(1)
        dtype = loss_sums[0].dtype
        mean_loss = tf.add_n(loss_sums) / tf.cast(batch, dtype) + tf.cast(regs[0], dtype)
        correct = (
            tf.cast(tf.add_n(corrects), tf.int64) if has_accuracy else tf.constant(-1, tf.int64)
        )
    return tf.cast(mean_loss, tf.float64), correct, stop


def sum_metrics(devices, loss_sums, corrects, stop, after, allreduce):
    """Loss sums, correct counts and stop requests summed over every worker.

    Args:
      devices: list of K device names, this worker's towers.
      loss_sums: [K] scalar loss sums, loss_sums[k] of tower k's shard.
      corrects: [K] int64 scalar correct counts, or [K] None.
      stop: float64 scalar, 1 when this worker was asked to stop; counted
        once per worker (on its tower 0).
      after: tensors the reduction runs after (control dependencies).
      allreduce: fn(all_grads, average) -> K x N, the trainer's all-reduce.

    Returns:
      ([loss sum], [correct count] or [None], workers asked to stop) of the
      global batch, in float64 (exact for counts below 2**53).
    """
    has_accuracy = corrects[0] is not None
    values = []
    for k, device in enumerate(devices):
        with tf.device(device):
            row = [tf.cast(loss_sums[k], tf.float64),
                   stop if k == 0 else tf.zeros([], tf.float64)]
            if has_accuracy:
                row.append(tf.cast(corrects[k], tf.float64))
            values.append(row)
    with tf.control_dependencies(after), tf.name_scope("metrics"):
        summed = allreduce(values, average=False)[0]
    return [summed[0]], [summed[2] if has_accuracy else None], summed[1]


def sync_moving(towers, sizes, batch, after, allreduce):
    """Sets BatchNorm moving statistics to their shard-weighted mean over towers.

    Args:
      towers: Towers, whose `moving` statistics are assigned.
      sizes: int32 [K], this worker's shard sizes.
      batch: int32 scalar B, the global batch size; the weights
        sizes[k] / B of all T towers add up to 1.
      after: tensors the reduction runs after (control dependencies).
      allreduce: fn(all_grads, average) -> K x N, the trainer's all-reduce.

    Returns:
      the tensors a later collective must run after.
    """
    if not towers.moving[0]:
        return after
    weighted = []
    for k, device in enumerate(towers.devices):
        with tf.device(device), tf.name_scope(f"tower{k}_moving"):
            share = tf.cast(sizes[k], tf.float64) / tf.cast(batch, tf.float64)
            weighted.append([v * tf.cast(share, v.dtype) for v in towers.moving[k]])
    # Reduced with the same engine as the gradients, with the weights
    # already applied, so a plain sum gives the weighted mean.
    with tf.control_dependencies(after):
        reduced = allreduce(weighted, average=False)
    for k, device in enumerate(towers.devices):
        with tf.device(device):
            for v, value in zip(towers.moving[k], reduced[k]):
                v.assign(value)
    return list(reduced[0])


def eval_graph(towers, loss_fn, x, y):
    """Sum of losses and correct predictions over a batch, split across towers.

    Args:
      towers: Towers, this worker's K built replicas.
      loss_fn: fn(y_true, y_pred) -> per-example losses.
      x, y: [batch, ...], a global batch.

    Returns:
      (float64 scalar loss sum, int64 scalar correct count, -1 when accuracy
      is not defined).
    """
    num_towers = len(towers.devices)
    _, (x_shards, y_shards) = _split([x, y], num_towers)
    loss_sums, corrects = [], []
    for k, (model, device) in enumerate(zip(towers.models, towers.devices)):
        with tf.device(device), tf.name_scope(f"tower{k}"):
            loss_sum, y_pred = tower_loss_sum(
                loss_fn, model, x_shards[k], y_shards[k], training=False
            )
            loss_sums.append(tf.cast(loss_sum, tf.float64))
            corrects.append(correct_count(y_shards[k], y_pred))
    with tf.device(HOST):
        correct = tf.add_n(corrects) if corrects[0] is not None else tf.constant(-1, tf.int64)
        return tf.add_n(loss_sums), correct


def predict_graph(towers, x):
    """The towers' outputs on their shards of x, concatenated in input order."""
    num_towers = len(towers.devices)
    _, (x_shards,) = _split([x], num_towers)
    outputs = []
    for k, (model, device) in enumerate(zip(towers.models, towers.devices)):
        with tf.device(device), tf.name_scope(f"tower{k}"):
            outputs.append(model(x_shards[k], training=False))
    with tf.device(HOST):
        return tf.concat(outputs, axis=0)


class StepFunctions:
    """The tf.functions the trainer runs on its built towers.

    `train`, `evaluate` and `predict` are each traced once, on their first
    call, from the shapes and dtypes of that call's batch. The batch axis of
    every input signature stays None: a worker's part may differ in size
    from step to step, and a retrace on one worker only would build its
    collectives out of step with the others. The calls that run cross-worker
    collectives (train, broadcast) run inside `towers.collectives`, which
    names a lost worker.

    Args:
      towers: Towers, this worker's K built replicas.
      options: StepOptions.
      step: the int64 step counter tf.Variable.
      epoch_totals: the float64 [3] tf.Variable of the epoch's running loss
        sum, correct count and examples (broadcast with the step).

    Attributes:
      difference: tf.function () -> float64 scalar, the largest absolute
        difference between any tower's variable and tower 0's.
    """

    def __init__(self, towers, options, step, epoch_totals):
        self._towers = towers
        self._options = options
        self._step = step
        self._broadcast_fn, self.difference = sync_functions(
            towers, options.cluster, [step, epoch_totals])
        self._train_fn = None
        self._eval_fn = None
        self._predict_fn = None

    def broadcast(self):
        """Copies tower 0's variables (rank 0's in a cluster) to every tower."""
        with collectives(self._options.cluster):
            self._broadcast_fn()

    def train(self, x, y, batch, stop=False):
        """Runs train_graph on this worker's part x, y of a global batch of int size `batch`.

        Returns:
          (float64 scalar mean loss, int64 scalar correct count, -1 when
          accuracy is not defined, float64 scalar workers asked to `stop`),
          as eager tensors.
        """
        if self._train_fn is None:
            self._train_fn = tf.function(
                functools.partial(train_graph, self._towers, self._options, self._step),
                input_signature=[signature(x), signature(y), tf.TensorSpec([], tf.int32),
                                 tf.TensorSpec([], tf.float64)],
            )
        with collectives(self._options.cluster):
            return self._train_fn(x, y, tf.constant(batch, tf.int32),
                                  tf.constant(float(stop), tf.float64))

    def tracing_counts(self):
        """{"train", "evaluate", "predict"} -> times each was traced (0: never run).

        Each is traced once for the shapes and dtypes of its first batch; a
        count above 1 means retracing (another dtype or rank of input).
        """
        return {name: 0 if fn is None else fn.experimental_get_tracing_count()
                for name, fn in (("train", self._train_fn), ("evaluate", self._eval_fn),
                                 ("predict", self._predict_fn))}

    def evaluate(self, x, y):
        """Runs eval_graph on the global batch x, y."""
        if self._eval_fn is None:
            self._eval_fn = tf.function(
                functools.partial(eval_graph, self._towers, self._options.loss_fn),
                input_signature=[signature(x), signature(y)],
            )
        return self._eval_fn(x, y)

    def predict(self, x):
        """Runs predict_graph on the global batch of inputs x."""
        if self._predict_fn is None:
            self._predict_fn = tf.function(
                functools.partial(predict_graph, self._towers), input_signature=[signature(x)]
            )
        return self._predict_fn(x)
