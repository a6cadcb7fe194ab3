"""The public all-reduce functions: the dispatcher and one function per algorithm.

Each builds a ``tfreduce.Reduction`` from its keywords (the one place the
algorithm and its options are checked and documented) and calls it.

The K x N contract, the same for every function here::

    all_grads[k][n]   the gradient of variable n on tower k (K towers, N variables)
    out[k][n]         the sum (or mean) over k of all_grads[k][n], placed on devices[k]

K=2, N=2, sum::

    [[A, B],      ->   [[A+C, B+D],    # on devices[0]
     [C, D]]            [A+C, B+D]]    # on devices[1]

Inputs and outputs are lists of K lists of N; each output keeps its
gradient's shape and dtype; a variable whose gradient is None on every tower
stays None; ``tf.IndexedSlices`` are gathered (or densified with
``sparse_as_dense``); float16 and bfloat16 are summed in float32 and rounded
once.
"""

import tensorflow as tf

from tfreduce.basis.choices import DEFAULT_PACK_BYTES
from tfreduce.choice.reduction import Reduction, as_reduction

__all__ = ["allreduce_grads", "allreduce_grads_flat", "allreduce_grads_hierarchical",
           "allreduce_grads_ring", "allreduce_grads_nccl", "allreduce_grads_collective",
           "plan_allreduce"]


@tf.autograph.experimental.do_not_convert
def allreduce_grads(all_grads, devices=None, average=False, algorithm="auto", *, reduction=None,
                    **options):
    """All-reduces K x N gradients with the named algorithm (the module's K x N contract).

    ``allreduce_grads(grads, devices, algorithm="ring", pack_bytes=None)`` is
    ``tfreduce.Reduction("ring", pack_bytes=None)(grads, devices)``: every
    option is a field of ``tfreduce.Reduction``, documented and checked there.

    Args:
      all_grads: list of K lists of N gradients (the module's K x N contract).
      devices: list of K device strings, or None for the tensors' devices.
      average: bool, mean instead of sum.
      algorithm: a name in ``tfreduce.ALGORITHMS``; "auto" picks NCCL when
        every device is a GPU, else flat, or with ``topology=`` the plan of
        the cost model.
      reduction: a ``tfreduce.Reduction`` to use instead of ``algorithm``
        and ``**options``.
      **options: the options of ``tfreduce.Reduction``: ``groups``,
        ``communication``, ``keys``, ``timeout``, ``pack_bytes``,
        ``sparse_as_dense``, ``compression``, ``topology``.

    Returns:
      list[list[tf.Tensor]], K x N; ``out[k][n]`` is placed on ``devices[k]``.

    Raises:
      ValueError, TypeError: a bad choice (see ``tfreduce.Reduction``), both
        ``reduction`` and ``algorithm`` or options, or bad input (the tower,
        the variable and the values are named).
    """
    return as_reduction(algorithm, reduction, options)(all_grads, devices, average)


def plan_allreduce(shapes, devices, topology, dtype=tf.float32, average=True, **options):
    """The all-reduce with the lowest predicted time for these gradients on this machine.

    ``tfreduce.Reduction(topology=topology, **options).plan(shapes, devices,
    dtype, average)``: see ``Reduction.plan`` for the candidates.

    Args:
      shapes: list of N gradient shapes (lists of ints), e.g. the model's
        trainable variables' shapes.
      devices: list of K device names ("/gpu:k"); they need not exist here.
      topology: a tfreduce.Topology, a preset name, or "host".
      dtype: tf.DType of the gradients.
      average: bool.
      **options: the frame options every candidate keeps: ``pack_bytes``
        (then only that size is tried), ``compression``, ``sparse_as_dense``.

    Returns:
      planner.Plan; ``plan.reduction`` is the chosen ``tfreduce.Reduction``
      (``plan.kwargs()`` the same as keywords of ``allreduce_grads``).

    Raises:
      ValueError: no shapes, an unknown preset, or a topology with fewer
        devices than K.
      TypeError: an option other than the frame's, or a topology of the
        wrong type.
    """
    return Reduction(topology=topology, **options).plan(shapes, devices, dtype, average)


@tf.autograph.experimental.do_not_convert
def allreduce_grads_flat(all_grads, devices=None, average=False, pack_bytes=DEFAULT_PACK_BYTES,
                         sparse_as_dense=False, compression=None):
    """All-reduces K x N gradients by reducing each to one root and broadcasting.

    For each gradient n (after packing), a root device r is chosen — the
    least-loaded by bytes so far, largest gradients first — the K copies are
    summed on r with ``add_n`` (divided by K there once if ``average``), and
    the result is copied to each device with ``identity``.

    Args:
      all_grads: list of K lists of N gradients (the module's K x N contract).
      devices: list of K device strings, or None for the tensors' devices.
      average: bool; True divides the sum by K, once per gradient, on its root.
      pack_bytes: see ``tfreduce.Reduction``.
      sparse_as_dense: see ``tfreduce.Reduction``.
      compression: see ``tfreduce.Reduction``.

    Returns:
      list[list[tf.Tensor]], K x N (the module's contract); float16 and
      bfloat16 are summed in float32 on the root and rounded once there.

    Raises:
      TypeError, ValueError: bad input (the tower, the variable and the
        values named) or a bad option (see ``tfreduce.Reduction``).
    """
    return Reduction("flat", pack_bytes=pack_bytes, sparse_as_dense=sparse_as_dense,
                     compression=compression)(all_grads, devices, average)


@tf.autograph.experimental.do_not_convert
def allreduce_grads_hierarchical(all_grads, devices=None, average=False, groups=None,
                                 pack_bytes=DEFAULT_PACK_BYTES, sparse_as_dense=False,
                                 compression=None):
    """All-reduces K x N gradients inside groups, then across the group roots.

    Same name and first arguments as tensorpack's
    ``tensorpack.graph_builder.utils.allreduce_grads_hierarchical``, so it is a
    drop-in replacement, and it gives the same values for K=8.

    For each gradient (after packing):

    1. pick a position p in the groups (least-loaded by bytes); the root of
       group g is ``groups[g][p % len(groups[g])]``, so roots pair up by
       position (devices i and i+4 for the default K=8 groups);
    2. ``group{g}_sum``: the group's gradients summed on its root;
    3. ``total``: the group sums combined on one of the roots (the least
       loaded), divided by K there if ``average``;
    4. ``group{g}_total``: the total copied to every other root;
    5. ``dev{k}_out``: each root copies the total to the devices of its group.

    Args:
      all_grads: list of K lists of N gradients (the module's K x N contract).
      devices: list of K device strings, or None for the tensors' devices.
      average: bool; divide by K once per gradient, where the total is formed.
      groups: list of lists of device indices that covers 0..K-1 exactly once,
        e.g. ``[[0, 1, 2, 3], [4, 5, 6, 7]]``; default ``default_groups(K)``.
      pack_bytes: see ``tfreduce.Reduction``.
      sparse_as_dense: see ``tfreduce.Reduction``.
      compression: see ``tfreduce.Reduction``.

    Returns:
      list[list[tf.Tensor]], K x N (the module's contract); float16 and
      bfloat16 group sums cross between groups in float32.

    Raises:
      TypeError, ValueError: bad gradients or devices (see
        ``contract.validate_grads``), or groups that do not partition 0..K-1.
    """
    return Reduction("hierarchical", groups=groups, pack_bytes=pack_bytes,
                     sparse_as_dense=sparse_as_dense, compression=compression)(
        all_grads, devices, average)


@tf.autograph.experimental.do_not_convert
def allreduce_grads_ring(all_grads, devices=None, average=False, pack_bytes=DEFAULT_PACK_BYTES,
                         sparse_as_dense=False, compression=None):
    """All-reduces K x N gradients with a ring reduce-scatter and all-gather.

    For each gradient (after packing), on every device: flatten, split into K
    chunks (sizes differ by at most one element; tensors with fewer than K
    elements use fewer, non-empty chunks). Chunk j is owned by device
    ``(j + m) % K`` for entry m, so that small tensors do not all complete on
    the same devices; op names number a chunk c by its owner. Then:

    1. reduce-scatter (``entry{m}_chunk{c}_dev{k}_sum``): chunk c's partial
       sum moves ``c+1 -> c+2 -> ... -> c``, each device adding its own piece;
    2. ``entry{m}_chunk{c}_total``: the owner c divides by K (if
       ``average``) and casts back, once per chunk;
    3. all-gather (``entry{m}_chunk{c}_dev{k}_copy``): the total moves
       ``c -> c+1 -> ... -> c-1``;
    4. ``entry{m}_dev{k}_out``: device k concatenates the chunks in order
       and restores the shape.

    Worked ring, K=3, one gradient of 3 elements [a_k, b_k, c_k] on device k,
    chunks owned by devices 0, 1, 2: chunk 0 goes 1 -> 2 -> 0 and is summed
    ``a_1 + a_2 + a_0`` on device 0, then copied 0 -> 1 -> 2; chunks 1 and 2
    do the same, rotated; each device ends with [sum a, sum b, sum c].

    Args:
      all_grads: list of K lists of N gradients (the module's K x N contract).
      devices: list of K device strings, or None for the tensors' devices;
        their order is the ring order.
      average: bool; True multiplies by 1/K once per chunk, on its owner.
      pack_bytes: see ``tfreduce.Reduction``.
      sparse_as_dense: see ``tfreduce.Reduction``.
      compression: see ``tfreduce.Reduction``.

    Returns:
      list[list[tf.Tensor]], K x N (the module's contract). float16 and
      bfloat16 partial sums travel in float32 from the first add on (the
      first reduce-scatter hop and the all-gather carry the gradient's own
      dtype), so each device sends at most 3(K-1)/K * S bytes instead of
      2(K-1)/K * S.

    Raises:
      TypeError, ValueError: bad input (the tower, the variable and the
        values named) or a bad option (see ``tfreduce.Reduction``).
      tf.errors.InvalidArgumentError: when the graph runs, a gradient whose
        shape was known only then differs between towers (the ring splits
        shapes unknown when it is built too; the message names the tower).
    """
    return Reduction("ring", pack_bytes=pack_bytes, sparse_as_dense=sparse_as_dense,
                     compression=compression)(all_grads, devices, average)


@tf.autograph.experimental.do_not_convert
def allreduce_grads_nccl(all_grads, average=False, devices=None, pack_bytes=DEFAULT_PACK_BYTES,
                         sparse_as_dense=False, compression=None):
    """All-reduces K x N gradients with NCCL ``all_sum`` (GPUs only).

    One ``NcclAllReduce`` per device and gradient (after packing); NCCL picks
    rings/trees over NVLink or PCIe itself (NVIDIA NCCL). ``tf.IndexedSlices``
    are gathered on one GPU and broadcast, since NCCL has no sparse form.

    The argument order follows tensorpack's ``allreduce_grads(all_grads,
    average)``, so positional calls written for it keep working.

    Args:
      all_grads: list of K lists of N gradients on K GPUs.
      average: bool. NCCL sums in the gradients' dtype, so with average=True
        each tower first multiplies its gradient by 1/K (Horovod's prescale):
        float16 sums cannot overflow where their mean does not.
      devices: list of K GPU device strings, or None for the tensors' devices.
      pack_bytes: see ``tfreduce.Reduction``.
      sparse_as_dense: see ``tfreduce.Reduction``.
      compression: see ``tfreduce.Reduction``.

    Returns:
      list[list[tf.Tensor]], K x N (the module's contract).

    Raises:
      ValueError: at build time if any device is not a GPU (naming them).
      TypeError, ValueError: bad input (the tower, the variable and the
        values named), a dtype NCCL cannot sum (bfloat16), or a bad option
        (see ``tfreduce.Reduction``).
    """
    return Reduction("nccl", pack_bytes=pack_bytes, sparse_as_dense=sparse_as_dense,
                     compression=compression)(all_grads, devices, average)


@tf.autograph.experimental.do_not_convert
def allreduce_grads_collective(all_grads, devices=None, average=False, communication="auto",
                               pack_bytes=DEFAULT_PACK_BYTES, sparse_as_dense=False, keys=None,
                               timeout=None, compression=None):
    """All-reduces K x N gradients with TF collective ops (``CollectiveReduceV2``).

    One ``CollectiveReduceV2`` per device and gradient (after packing); TF's
    collective runtime runs the reduction (a ring on CPUs, ring or NCCL on
    GPUs). Runs on CPUs and GPUs, eagerly (wrapped in a ``tf.function``
    here), in a ``tf.function`` or in a ``tf.compat.v1`` graph.

    The K ops of a reduction wait for each other, so the whole group must run
    together. A ``tf.function`` runs every collective it holds; in a
    ``tf.compat.v1.Session``, fetch or depend on all K outputs of a call,
    never some of them, or the step waits until ``timeout`` and fails. On
    each device the reductions are chained in one fixed order
    (``collective.CollectiveChain``), so hundreds of them cannot deadlock on
    a few CPU threads.

    Args:
      all_grads: list of K lists of N gradients (the module's K x N contract).
      devices: list of K device strings, or None for the tensors' devices.
      average: bool; each device multiplies its sum by 1/K (every device
        forms the sum, so there is no single place to do it once).
      communication: see ``tfreduce.Reduction``.
      pack_bytes: see ``tfreduce.Reduction``.
      sparse_as_dense: see ``tfreduce.Reduction``.
      compression: see ``tfreduce.Reduction``.
      keys: see ``tfreduce.Reduction``.
      timeout: see ``tfreduce.Reduction``.

    Returns:
      list[list[tf.Tensor]], K x N (the module's contract); float16 and
      bfloat16 cross as float32 (twice the bytes, one rounding).

    Raises:
      ValueError: unknown communication, a timeout that is neither None nor
        > 0, or bad input (see ``contract.validate_grads``).
    """
    return Reduction("collective", communication=communication, keys=keys, timeout=timeout,
                     pack_bytes=pack_bytes, sparse_as_dense=sparse_as_dense,
                     compression=compression)(all_grads, devices, average)
