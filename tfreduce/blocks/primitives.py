"""Device-placed building blocks of an all-reduce.

Every function here places each op it builds on a named device with
``tf.device``, so the data movement of a reduction is explicit in the graph:
an op on device B that reads a tensor produced on device A is one A -> B copy.

- ``reduce_to``: sum K tensors on one device (``add_n``).
- ``finish_sum``: the one division by K (``average=True``) and the cast back
  to the gradient's dtype, done once where the sum is formed.
- ``broadcast``: one ``identity`` per target device.
- ``gather_slices``: the all-reduce of ``tf.IndexedSlices`` by concatenation.
- ``ring_reduce_scatter``, ``ring_all_gather``: the two halves of a ring
  all-reduce, one chunk step per op, each on its device.
- ``RootBalancer``: picks root devices so that bytes are spread evenly.
- ``split_rows``, ``concat_rows``, ``copy_to``: the shards of the other
  collectives along axis 0, and one copy to a device.

Half precision: ``float16`` and ``bfloat16`` gradients are cast to float32 on
the device that forms the sum, summed and (for a mean) divided in float32, and
cast back once. The sum of K gradients can overflow float16 (max 65504) where
their mean does not; accumulating in float32 avoids that and rounds only once.
"""

import tensorflow as tf

from tfreduce.basis.contract import shard_sizes

__all__ = [
    "accumulation_dtype",
    "reduce_to",
    "finish_sum",
    "broadcast",
    "check_average_dtype",
    "scale_by_reciprocal",
    "mean_of_sum",
    "gather_slices",
    "broadcast_slices",
    "RootBalancer",
    "sum_order",
    "ring_reduce_scatter",
    "ring_all_gather",
    "split_rows",
    "concat_rows",
    "copy_to",
    "widen_half",
]

_HALF = (tf.float16, tf.bfloat16)


def accumulation_dtype(dtype):
    """The dtype sums are formed in: float32 for float16/bfloat16, else dtype."""
    return tf.float32 if dtype in _HALF else dtype


def reduce_to(tensors, device, name):
    """Sums K same-shape tensors on one device.

    Args:
      tensors: list of K ``tf.Tensor`` of one shape and dtype, on any devices.
      device: str, where the sum is formed (each input is copied there).
      name: str, name of the sum op.

    Returns:
      tf.Tensor on ``device`` in ``accumulation_dtype`` of the inputs.
    """
    dtype = tensors[0].dtype
    acc = accumulation_dtype(dtype)
    with tf.device(device):
        if acc != dtype:
            # Cast on the root: the copy in still carries half-size data.
            tensors = [tf.cast(t, acc) for t in tensors]
        if len(tensors) == 1:
            return tf.identity(tensors[0], name=name)
        return tf.add_n(tensors, name=name)


def scale_by_reciprocal(tensor, num_towers):
    """Returns ``tensor * (1 / K)``, the mean every tfreduce algorithm forms.

    A multiplication rather than a division: Grappler rewrites a division by
    a constant into this product inside graphs anyway, so multiplying
    explicitly gives the same bits eagerly, in a ``tf.function`` and in a v1
    Session (for K = 3, 6, 7 the two differ by one ulp).
    """
    return tf.math.multiply(tensor, tf.constant(1.0 / num_towers, tensor.dtype),
                            name="scale_1_over_k")


def mean_of_sum(values, num_towers):
    """``values * (1 / K)`` formed in the accumulation dtype and cast back once.

    For rows gathered from K towers (their concatenation is their sum).
    """
    acc = accumulation_dtype(values.dtype)
    return tf.cast(scale_by_reciprocal(tf.cast(values, acc), num_towers), values.dtype)


def finish_sum(total, dtype, num_towers, average, device, name):
    """Divides a sum by K (if averaging) and casts it back to ``dtype``.

    Called once per variable on the device that holds the full sum, so the
    division costs one pass over the data instead of one per device.

    Args:
      total: tf.Tensor, a sum in ``accumulation_dtype(dtype)``.
      dtype: tf.DType of the gradients.
      num_towers: int K.
      average: bool, divide by K.
      device: str, the device of ``total``.
      name: str, name of the result op.

    Returns:
      tf.Tensor of ``dtype`` on ``device``.
    """
    with tf.device(device):
        if average:
            total = scale_by_reciprocal(total, num_towers)
        if total.dtype != dtype:
            total = tf.cast(total, dtype)
        return tf.identity(total, name=name)


def broadcast(tensor, devices, name_fmt="dev{}_out", indices=None):
    """Copies one tensor to several devices.

    Args:
      tensor: tf.Tensor to copy.
      devices: list of str, the target devices.
      name_fmt: str with one ``{}``, filled with each target's index.
      indices: list of int, the index to name each target by (default 0..).

    Returns:
      list of tf.Tensor, element i an ``identity`` placed on ``devices[i]``.
    """
    indices = range(len(devices)) if indices is None else indices
    out = []
    for i, d in zip(indices, devices):
        with tf.device(d):
            out.append(tf.identity(tensor, name=name_fmt.format(i)))
    return out


def check_average_dtype(dtype, n, average, what="variable {n}", kind="gradients"):
    """Raises TypeError for ``average=True`` on non-floating gradients (or tensors)."""
    if average and not (dtype.is_floating or dtype.is_complex):
        raise TypeError(
            f"{what.format(n=n)}: average=True needs floating {kind}, got "
            f"{dtype.name}; reduce with average=False and divide yourself")


def gather_slices(slices, device, num_towers, average, name):
    """All-reduces ``tf.IndexedSlices`` by concatenation on one device.

    The sum of sparse gradients is their concatenation: rows that share an
    index are summed by whoever applies the result (``scatter_add``, or
    ``tf.convert_to_tensor``). This keeps the traffic proportional to the
    rows touched instead of the variable's full size.

    Args:
      slices: list of K ``tf.IndexedSlices`` of one row shape and dtype.
      device: str, where they are gathered.
      num_towers: int K.
      average: bool, divide the values by K.
      name: str, prefix of the op names.

    Returns:
      tf.IndexedSlices on ``device``; its dense value is the dense sum (mean).
    """
    with tf.device(device):
        values = tf.concat([s.values for s in slices], axis=0, name=name + "_values")
        indices = tf.concat([tf.cast(s.indices, tf.int64) for s in slices], axis=0,
                            name=name + "_indices")
        if average:
            values = mean_of_sum(values, num_towers)
        dense_shape = slices[0].dense_shape
    return tf.IndexedSlices(values, indices, dense_shape)


def broadcast_slices(gathered, devices, name_fmt="dev{}_out"):
    """Copies a ``tf.IndexedSlices`` to every device (values and indices)."""
    values = broadcast(gathered.values, devices, name_fmt + "_values")
    indices = broadcast(gathered.indices, devices, name_fmt + "_indices")
    shape = gathered.dense_shape
    out = []
    for k, d in enumerate(devices):
        if shape is not None:
            with tf.device(d):
                shape_k = tf.identity(shape, name=name_fmt.format(k) + "_shape")
        else:
            shape_k = None
        out.append(tf.IndexedSlices(values[k], indices[k], shape_k))
    return out


def sum_order(sizes):
    """Variable indices, largest first (stable): the order roots are assigned in.

    Assigning the largest tensors first to the least-loaded device is the
    longest-processing-time rule (Graham, 1969): its largest load is within
    4/3 of the optimum, where round-robin by count can put every big tensor
    on one device.
    """
    return sorted(range(len(sizes)), key=lambda n: -sizes[n])


class RootBalancer:
    """Assigns root devices to tensors, least-loaded by bytes.

    Args:
      num_devices: int K.

    Attributes:
      load: list of int, bytes assigned to each device index so far.
    """

    def __init__(self, num_devices):
        self.load = [0] * num_devices

    def pick(self, candidates, size):
        """Returns the least-loaded of ``candidates`` and charges it ``size`` bytes.

        Ties go to the earliest candidate, so equal-size tensors rotate
        through the devices in order, as tensorpack's ``varid % K`` does.
        """
        best = min(candidates, key=lambda i: self.load[i])
        self.load[best] += size
        return best


def _accumulate(tensor):
    acc = accumulation_dtype(tensor.dtype)
    return tf.cast(tensor, acc) if acc != tensor.dtype else tensor


def ring_reduce_scatter(pieces, devices, name, wire_dtype=None):
    """Ring reduce-scatter: the sum of piece c is formed on ``devices[c]``.

    Piece c is summed along the ring ``c+1 -> c+2 -> ... -> c`` (indices mod
    K): device c+1 sends its piece to c+2, which adds its own and sends the
    partial sum on, until device c adds the last piece. Every step is one
    ``add`` on the device that performs it, so each device sends K-1 pieces
    and receives K-1 (Patarasuk & Yuan, "Bandwidth optimal all-reduce
    algorithms for clusters of workstations", JPDC 2009).

    Half precision: the first hop carries device c+1's piece in its own
    dtype; from the first add on, partial sums are float32
    (``accumulation_dtype``), so a float16 sum cannot overflow or round on
    the way, at the price of twice the bytes on the later hops.

    Args:
      pieces: list of K lists of K; ``pieces[k][c]`` is device k's piece c,
        a ``tf.Tensor`` on ``devices[k]``; pieces of one index c have one
        shape and dtype across devices. ``pieces[k][c]`` is None on every
        device for a piece that is empty (it is skipped).
      devices: list of K device strings.
      name: str, prefix of the op names (``{name}_chunk{c}_dev{k}_sum``).
      wire_dtype: None, or the 16-bit dtype partial sums are rounded to
        before each hop (wire compression: every hop carries 16 bits; each
        add is still formed in float32).

    Returns:
      list of K; element c is the sum of piece c over all devices, on
      ``devices[c]``, in the accumulation dtype; None for skipped pieces.
    """
    num_devices = len(devices)
    totals = [None] * num_devices
    for c in range(num_devices):
        if pieces[0][c] is None:
            continue
        first = (c + 1) % num_devices
        partial = pieces[first][c]
        for hop in range(2, num_devices + 1):
            k = (c + hop) % num_devices
            with tf.device(devices[k]):
                partial = tf.math.add(_accumulate(partial), _accumulate(pieces[k][c]),
                                      name=f"{name}_chunk{c}_dev{k}_sum")
                if wire_dtype is not None and hop < num_devices:
                    partial = tf.cast(partial, wire_dtype, name=f"{name}_chunk{c}_dev{k}_wire")
        if num_devices == 1:
            with tf.device(devices[c]):
                partial = _accumulate(partial)
        totals[c] = partial
    return totals


def ring_all_gather(totals, devices, name):
    """Ring all-gather: every device receives every other device's chunk.

    Chunk c travels ``c -> c+1 -> ... -> c-1`` (indices mod K), one
    ``identity`` per hop on the receiving device, so each device sends K-1
    chunks and receives K-1, each over the link to its ring neighbour.

    Args:
      totals: list of K; ``totals[c]`` is a ``tf.Tensor`` on ``devices[c]``,
        or None for an empty chunk (skipped).
      devices: list of K device strings.
      name: str, prefix of the op names (``{name}_chunk{c}_dev{k}_copy``).

    Returns:
      list of K lists of K; element [k][c] is chunk c on ``devices[k]``
      (``totals[c]`` itself for k == c); None where ``totals[c]`` is None.
    """
    num_devices = len(devices)
    out = [[None] * num_devices for _ in range(num_devices)]
    for c, chunk in enumerate(totals):
        if chunk is None:
            continue
        out[c][c] = chunk
        for hop in range(1, num_devices):
            k = (c + hop) % num_devices
            with tf.device(devices[k]):
                chunk = tf.identity(chunk, name=f"{name}_chunk{c}_dev{k}_copy")
            out[k][c] = chunk
    return out


def split_rows(x, num_shards, name, sizes=None):
    """Splits x along axis 0 into shards, on the current device.

    Args:
      x: tf.Tensor of rank >= 1.
      num_shards: int K.
      name: str, the split op's name.
      sizes: list of K ints (or a 1-D int tensor) of rows, summing to x's
        rows; None: ``contract.shard_sizes`` of the rows (the first B % K
        shards one row larger).

    Returns:
      list of K tf.Tensor, shard k of ``sizes[k]`` rows (0 rows included).
    """
    if sizes is None:
        rows = x.shape[0]
        sizes = shard_sizes(tf.shape(x)[0] if rows is None else rows, num_shards)
    if num_shards == 1:
        return [tf.identity(x, name=name)]
    return tf.split(x, sizes, num=num_shards, axis=0, name=name)


def concat_rows(parts, name):
    """Concatenates tensors along axis 0 on the current device (one identity for one)."""
    if len(parts) == 1:
        return tf.identity(parts[0], name=name)
    return tf.concat(parts, axis=0, name=name)


def widen_half(t):
    """t with float16/bfloat16 cast to float32 (exact), for TF's gather and broadcast kernels."""
    return tf.cast(t, tf.float32) if t.dtype in _HALF else t


def copy_to(g, device):
    """One copy of g (None, a tf.Tensor or tf.IndexedSlices) placed on ``device``."""
    if g is None:
        return None
    with tf.device(device):
        if isinstance(g, tf.IndexedSlices):
            shape = None if g.dense_shape is None else tf.identity(g.dense_shape)
            return tf.IndexedSlices(tf.identity(g.values), tf.identity(g.indices), shape)
        return tf.identity(g)
