"""The frame every all-reduce algorithm runs in.

validate the K x N input -> densify what must be dense -> pack into M
buffers -> gather the sparse entries / reduce the dense ones with the
algorithm -> unpack to K x N. An algorithm only supplies the function that
reduces a K x M list of dense tensors; everything else, including the errors
users see, is shared so that all algorithms behave the same.
"""

import tensorflow as tf

from tfreduce.contract import nbytes, validate_grads
from tfreduce.packing import PackPlan
from tfreduce.primitives import (RootBalancer, broadcast_slices, check_average_dtype,
                                 gather_slices, sum_order)

__all__ = ["run_allreduce"]


def run_allreduce(all_grads, devices, average, reduce_dense, scope,
                  pack_bytes=None, sparse_as_dense=False, check_devices=None):
    """Validates, packs and reduces a K x N gradient list.

    Args:
      all_grads: list of K lists of N gradients (see contract.validate_grads).
      devices: list of K device strings or None.
      average: bool, mean instead of sum.
      reduce_dense: callable ``(columns, devices) -> columns_out``; ``columns``
        is a list of M lists of K dense tensors (entry m, tower k), and it
        returns M lists of K reduced tensors, element [m][k] on devices[k].
      scope: str, the name scope of this call.
      pack_bytes: int or None, see packing.PackPlan.
      sparse_as_dense: bool, reduce ``tf.IndexedSlices`` as dense tensors.
      check_devices: callable ``(devices) -> None`` raising for devices the
        algorithm cannot use, or None.

    Returns:
      list of K lists of N, ``out[k][n]`` on ``devices[k]``.
    """
    grads = validate_grads(all_grads, devices)
    if check_devices is not None:
        check_devices(grads.devices)
    for n in grads.reduced:
        column = grads.column(n)
        dtype = (column[0].values if isinstance(column[0], tf.IndexedSlices)
                 else column[0]).dtype
        check_average_dtype(dtype, n, average)
    with tf.name_scope(scope):
        _densify(grads, sparse_as_dense)
        plan = PackPlan(grads, pack_bytes)
        packed = plan.pack()
        reduced = _reduce_entries(packed, grads.devices, average, reduce_dense)
        return plan.unpack(reduced)


def _densify(grads, sparse_as_dense):
    # A variable that is sparse on some towers and dense on others is reduced
    # densely: its sum is dense anyway.
    for n in grads.reduced:
        column = grads.column(n)
        sparse = [isinstance(g, tf.IndexedSlices) for g in column]
        if any(sparse) and (sparse_as_dense or not all(sparse)):
            for k, g in enumerate(column):
                if isinstance(g, tf.IndexedSlices):
                    with tf.device(grads.devices[k]):
                        grads.grads[k][n] = tf.convert_to_tensor(g)


def _reduce_entries(packed, devices, average, reduce_dense):
    num_towers = len(packed)
    num_entries = len(packed[0])
    out = [[None] * num_entries for _ in range(num_towers)]
    sparse = [m for m in range(num_entries) if isinstance(packed[0][m], tf.IndexedSlices)]
    dense = sorted(set(range(num_entries)) - set(sparse))
    if dense:
        columns = [[packed[k][m] for k in range(num_towers)] for m in dense]
        results = reduce_dense(columns, devices)
        for m, result in zip(dense, results):
            for k in range(num_towers):
                out[k][m] = result[k]
    balancer = RootBalancer(num_towers)
    sizes = [nbytes(packed[0][m]) for m in sparse]
    for i in sum_order(sizes):
        m = sparse[i]
        root = balancer.pick(range(num_towers), sizes[i])
        gathered = gather_slices([packed[k][m] for k in range(num_towers)],
                                 devices[root], num_towers, average, name=f"entry{m}_gather")
        for k, s in enumerate(broadcast_slices(gathered, devices,
                                               name_fmt=f"entry{m}_dev{{}}_out")):
            out[k][m] = s
    return out
