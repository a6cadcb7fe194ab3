"""Horovod's dtypes and scale factors on TensorFlow's collectives.

TF's collective kernels (``CollectiveReduceV2``, ``CollectiveGatherV2``,
``CollectiveBcastSendV2``/``RecvV2``) take float16, float32, float64, int32
and int64 (bfloat16 only in the all-reduce, bool only in the broadcast).
Horovod also reduces, gathers and broadcasts uint8, int8, uint16, int16 and
bool, and gathers bfloat16. Those cross the wire widened (to int32, or
float32 for bfloat16) and are narrowed back after, which is exact: a sum of
8-bit integers taken in int32 and cast back is their sum modulo 2**8, what
the narrow type's own sum gives; min, max and gathers never leave the
narrow type's range.

Scale factors follow Horovod's C++ ``ScaleBuffer``: an integer tensor is
multiplied in float64 and cast back (truncated toward zero), so 0.75 scales
ints instead of becoming 0; a float16 (or bfloat16) tensor in float32, with
one rounding back; float32 and float64 tensors in their own dtype.
"""

import tensorflow as tf

__all__ = ["check_dtypes", "finish_mean", "integer_mean", "mean_dtype", "narrow", "off_wire",
           "on_wire", "scale", "widen", "wire_dtype"]

# dtype -> the dtype it crosses the wire in, for the collectives TF lacks.
_WIDER = {tf.uint8: tf.int32, tf.int8: tf.int32, tf.uint16: tf.int32, tf.int16: tf.int32,
          tf.bool: tf.int32, tf.bfloat16: tf.float32}


#: What the collectives carry between processes (after ``widen``).
CARRIED = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int16,
           tf.uint16, tf.int32, tf.int64, tf.bool)
_CARRIED = frozenset(CARRIED)


def check_dtypes(tensors, where):
    """Raises TypeError for a tensor whose dtype no collective carries (strings, complex, uint64).

    Checked on every process before the processes compare their calls, so
    that a call bad on one process alone is refused there, before any data
    moves (``calls.one_call``), and alike on one process and on many.

    Args:
      tensors: list of tf.Tensor or tf.IndexedSlices.
      where: str, the collective, for the message.
    """
    for n, t in enumerate(tensors):
        dtype = (t.values if isinstance(t, tf.IndexedSlices) else t).dtype.base_dtype
        if dtype not in _CARRIED:
            raise TypeError(f"{where}: tensor {n} has dtype {dtype.name}, which the processes' "
                            f"collectives do not carry; give one of "
                            f"{', '.join(d.name for d in CARRIED)}")


def widen(t, keep=()):
    """t in a dtype TF's collectives take (t itself when they take its own, or it is in `keep`).

    Args:
      t: tf.Tensor of any dtype.
      keep: dtypes the caller's collective takes as they are (bfloat16 for
        an all-reduce).

    Returns:
      tf.Tensor of t's values, int32 for 8- and 16-bit integers and bool,
      float32 for bfloat16.
    """
    wider = wire_dtype(t.dtype, keep)
    return t if wider == t.dtype else tf.cast(t, wider)


def wire_dtype(dtype, keep=()):
    """The dtype a tensor of `dtype` crosses TF's collectives in (see widen)."""
    dtype = tf.as_dtype(dtype).base_dtype
    return dtype if dtype in keep else _WIDER.get(dtype, dtype)


def narrow(t, dtype):
    """The result of a widened collective back in `dtype` (integers wrap, as the narrow sum does)."""
    return t if t.dtype == dtype else tf.cast(t, dtype)


def scale(t, factor):
    """t times a Python float factor, as Horovod scales (see the module docstring).

    Args:
      t: tf.Tensor, or tf.IndexedSlices (its values are scaled).
      factor: float.

    Returns:
      t's type, shape and dtype.
    """
    if isinstance(t, tf.IndexedSlices):
        return tf.IndexedSlices(scale(t.values, factor), t.indices, t.dense_shape)
    if factor == 1.0:
        return t
    if t.dtype.is_integer:
        return tf.cast(tf.cast(t, tf.float64) * factor, t.dtype)
    if t.dtype in (tf.float16, tf.bfloat16):
        return tf.cast(tf.cast(t, tf.float32) * tf.cast(factor, tf.float32), t.dtype)
    return t * tf.cast(factor, t.dtype)


def integer_mean(t, mean):
    """bool: t (a tensor or tf.IndexedSlices) is averaged (`mean`) and holds integers."""
    values = t.values if isinstance(t, tf.IndexedSlices) else t
    return mean and not values.dtype.is_floating


def mean_dtype(t, mean):
    """The dtype of t's reduction: t's, but TF's true division's for a sparse integer mean."""
    if isinstance(t, tf.IndexedSlices) and integer_mean(t, mean):
        return tf.float32 if t.values.dtype.size <= 2 else tf.float64
    return t.dtype


def finish_mean(t, mean, postscale_factor, size):
    """A reduced tensor times postscale_factor; an integer mean finished as Horovod does.

    Horovod's integer mean: a dense sum scaled once by postscale / size in
    float64 and truncated; the gathered rows of tf.IndexedSlices divided by
    size with TF's true division (float32 values for 8- and 16-bit
    integers, float64 for 32- and 64-bit ones)."""
    if not integer_mean(t, mean):
        return scale(t, postscale_factor)
    if not isinstance(t, tf.IndexedSlices):
        return scale(t, postscale_factor / size)
    values = tf.math.truediv(t.values, tf.cast(size, t.values.dtype))
    return scale(tf.IndexedSlices(values, t.indices, t.dense_shape), postscale_factor)


def on_wire(t):
    """t (a tensor or tf.IndexedSlices) as it crosses an all-reduce (which takes bfloat16;
    the gather of sparse rows does not)."""
    if isinstance(t, tf.IndexedSlices):
        return tf.IndexedSlices(widen(t.values), t.indices, t.dense_shape)
    return widen(t, keep=(tf.bfloat16,))


def off_wire(t, like):
    """A reduced t in the dtypes of the input `like` again (gathered indices come as int64)."""
    if isinstance(t, tf.IndexedSlices):
        return tf.IndexedSlices(narrow(t.values, like.dtype),
                                narrow(t.indices, like.indices.dtype), t.dense_shape)
    return narrow(t, like.dtype)
