"""What a Horovod-style call's inputs look like: the signature its function is kept by, and
the text the processes compare (``calls.agree``)."""

import tensorflow as tf

__all__ = ["describe_call", "input_spec"]


def input_spec(t, rows_vary):
    """The tf.TensorSpec (or IndexedSlicesSpec) a call's function is traced for; rows None
    where they may differ between processes (`rows_vary`) and for sparse rows."""
    if isinstance(t, tf.IndexedSlices):  # rows differ from call to call
        shape = t.dense_shape
        if shape is None:  # Horovod takes slices without a dense shape
            return tf.IndexedSlicesSpec([None] + t.values.shape[1:].as_list(), t.values.dtype,
                                        t.indices.dtype, None, [None])
        return tf.IndexedSlicesSpec(
            shape.numpy().tolist() if tf.is_tensor(shape) else shape, t.values.dtype,
            t.indices.dtype, None if shape is None else tf.as_dtype(shape.dtype), [None])
    shape = t.shape.as_list()
    if rows_vary:
        shape[0] = None
    return tf.TensorSpec(shape, t.dtype)


def describe_call(key, tensors, rows_vary, name):
    """A call as the processes compare it, e.g. "allreduce 'loss' (average) of float32 [3]".

    Row counts that may differ between processes (allgather's, sparse
    rows) show as None."""
    what, *options = key
    inputs = []
    for t in tensors:
        if isinstance(t, tf.IndexedSlices):
            inputs.append(f"IndexedSlices {t.values.dtype.name} "
                          f"{[None] + t.values.shape[1:].as_list()}")
            continue
        shape = t.shape.as_list()  # as input_spec has it
        if rows_vary and shape:
            shape[0] = None
        inputs.append(f"{t.dtype.name} {shape}")
    named = f" {name!r}" if name else ""
    settings = f" ({', '.join(str(o) for o in options)})" if options else ""
    return f"{what}{named}{settings} of {', '.join(inputs) or 'nothing'}"
