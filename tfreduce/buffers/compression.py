"""Wire compression: the dtype a gradient has while it crosses devices.

One type, in the shape of Horovod's ``Compression``: a ``Compressor``
compresses each tower's gradient on the tower's own device before anything
crosses devices, ``compress(t) -> (wire, ctx)``, and restores each result on
its device after, ``decompress(wire, ctx)``. The named instances are

- ``Compression.none``: every gradient crosses as it is;
- ``Compression.fp16``: float32 and float64 gradients cross as float16
  (Horovod's ``Compression.fp16``, PyTorch DDP's fp16 hook);
- ``Compression.bf16``: they cross as bfloat16 (DDP's bf16 hook; float32's
  range, so no overflow, with 8 bits of mantissa).

Integer and 16-bit gradients are never cast. Wherever compression is taken
(``tfreduce.Reduction`` and every door built on it), the strings "fp16",
"bf16" and "none" and None are aliases of these instances.

PowerSGD is no Compressor: it keeps state between steps (its error feedback
and Q), so it is an option of ``ReplicatedTrainer`` of its own, ``powersgd=``.
"""

import tensorflow as tf

from tfreduce.basis.contract import values_of

__all__ = ["Compressor", "Compression", "as_compressor"]


class Compressor:
    """Casts float32 and float64 tensors to a wire dtype on the sender, and back after.

    Every reduction calls ``compress`` on each tower's gradient (or, across
    workers, on each worker's local sum) before it crosses devices, and
    ``decompress`` on each result; a subclass may do more than a cast, as
    long as ``compress`` gives float32 and float64 tensors the dtype
    ``dtype``, which the stages read to check what they can sum (and which
    they sum in, prescaled by 1/K when averaging).

    Args:
      name: str, the name the aliases and the benchmark use ("fp16").
      dtype: tf.DType, the wire dtype of float32 and float64 gradients, or
        None: nothing is cast.

    Attributes:
      name: str.
      dtype: tf.DType or None.
    """

    def __init__(self, name, dtype=None):
        self.name = name
        self.dtype = None if dtype is None else tf.as_dtype(dtype)

    def __repr__(self):
        return f"tfreduce.Compression.{self.name}"

    # A value: a copy, a deep copy or an unpickled one (a Reduction that
    # holds it, sent to another process) equals the original and hashes alike.
    def __eq__(self, other):
        return type(other) is type(self) and (other.name, other.dtype) == (self.name, self.dtype)

    def __hash__(self):
        return hash((type(self), self.name, self.dtype))

    @property
    def compresses(self):
        """bool: some gradients cross devices in another dtype than their own."""
        return self.dtype is not None

    def wire_dtype(self, dtype):
        """The dtype a gradient of ``dtype`` crosses devices in.

        float32 and float64 become ``self.dtype``; integer and 16-bit dtypes,
        and every dtype without compression, stay as they are.
        """
        dtype = tf.as_dtype(dtype)
        if self.dtype is None or not dtype.is_floating or dtype.size <= 2:
            return dtype
        return self.dtype

    def compress(self, tensor):
        """``tensor`` (a tf.Tensor or IndexedSlices) in its wire dtype, on the current device.

        Returns:
          (the wire tensor, ctx): ctx is the dtype to restore, or None when
          nothing was cast.
        """
        dtype = values_of(tensor).dtype
        wire = self.wire_dtype(dtype)
        if wire == dtype:
            return tensor, None
        return _cast(tensor, wire), dtype

    def decompress(self, tensor, ctx):
        """A reduced wire tensor back in its gradient's dtype (``ctx`` from ``compress``)."""
        return tensor if ctx is None else _cast(tensor, ctx)


class Compression:
    """The named compressors (Horovod's ``hvd.Compression``): none, fp16, bf16."""

    none = Compressor("none")
    fp16 = Compressor("fp16", tf.float16)
    bf16 = Compressor("bf16", tf.bfloat16)


_BY_NAME = {c.name: c for c in (Compression.none, Compression.fp16, Compression.bf16)}


def as_compressor(compression):
    """The Compressor a ``compression=`` argument names.

    Args:
      compression: a Compressor, None, or "none", "fp16", "bf16".

    Returns:
      Compressor.

    Raises:
      ValueError: anything else (a PowerSGD is pointed to the trainer's
        ``powersgd=``).
    """
    if isinstance(compression, Compressor):
        return compression
    if compression is None:
        return Compression.none
    if isinstance(compression, str) and compression in _BY_NAME:
        return _BY_NAME[compression]
    raise ValueError(f"compression must be None, 'fp16' or 'bf16', got {compression!r} (or "
                     f"tfreduce.Compression.none, .fp16, .bf16; PowerSGD keeps state between "
                     f"steps: it is a ReplicatedTrainer option of its own, "
                     f"powersgd=tfreduce.PowerSGD(rank=2))")


def _cast(g, dtype):
    # A tensor or IndexedSlices (its values) cast to dtype, on the current device.
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(g.values, dtype), g.indices, g.dense_shape)
    return tf.cast(g, dtype)
