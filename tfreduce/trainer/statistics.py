"""What a step reduces besides the gradients: BatchNorm's moving statistics and the step's metrics.

Both go through the trainer's all-reduce callable, in the order the step
builds them (the metrics first, the statistics after the tensors given as
`after`): each worker's collectives run one after the other, in the same
order on every worker.
"""

import tensorflow as tf


def sum_metrics(devices, loss_sums, corrects, stop, allreduce):
    """Loss sums, correct counts and stop requests summed over every worker.

    Args:
      devices: list of K device names, this worker's towers.
      loss_sums: [K] scalar loss sums, loss_sums[k] of tower k's shard.
      corrects: [K] int64 scalar correct counts, or [K] None.
      stop: float64 scalar, 1 when this worker was asked to stop; counted
        once per worker (on its tower 0).
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
    with tf.name_scope("metrics"):
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
    """
    if not towers.moving[0]:
        return
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
