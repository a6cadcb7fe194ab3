"""What a step reduces besides the gradients and its metrics: BatchNorm's moving statistics.

They go through the trainer's all-reduce callable after the tensors given
as `after`: each worker's collectives run one after the other, in the same
order on every worker. (The metrics are summed over workers by
``multiworker.sum_over_workers``.)
"""

import tensorflow as tf


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
