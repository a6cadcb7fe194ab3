"""The loss a tower minimises: per-example losses, regularisation, accuracy.

The trainer forms the mean loss over the global batch itself, so it takes
one loss value per example from whatever the user gives (a Keras loss, a
loss name or a function) and sums them per tower.
"""

import keras
import tensorflow as tf

from tfreduce.basis import kerases
from tfreduce.trainer.batching import split_weights


def per_example_loss_fn(loss):
    """Returns fn(y_true, y_pred) -> one loss value per example.

    A `keras.losses.Loss` is used through its unreduced `call`: its own
    reduction would average over the tower's shard, while the trainer needs
    per-example values to weight each shard by its share of the global batch.
    `call` also keeps the model's dtype, where `Loss.__call__` casts to the
    loss's dtype (float32 by default).

    Args:
      loss: a keras.losses.Loss, a Keras loss name ("mse"), or a function
        (y_true, y_pred) -> per-example losses.

    Raises:
      ValueError: loss is a name Keras does not know.
      TypeError: loss is none of these.
    """
    if isinstance(loss, str):
        resolved = keras.losses.get(loss)
        if resolved is None:
            raise ValueError(
                f"unknown loss {loss!r}; give a keras loss name, a keras.losses.Loss or a function"
            )
        loss = resolved
    if isinstance(loss, keras.losses.Loss) or kerases.is_keras2(loss):
        return loss.call
    if callable(loss):
        return loss
    raise TypeError(
        "loss must be a keras loss name, a keras.losses.Loss or a function "
        f"(y_true, y_pred) -> per-example losses, got {type(loss).__name__}"
    )


def takes_class_indices(loss):
    """True for Keras' sparse categorical cross-entropy, by object or name.

    Its labels are class indices: it silently truncates 0.5 to class 0, so
    the trainer refuses fractional labels for it.
    """
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    keras_module = kerases.keras_of(loss) or keras
    return isinstance(loss, keras_module.losses.SparseCategoricalCrossentropy) or (
        loss is keras.losses.sparse_categorical_crossentropy)


def correct_count(y_true, y_pred):
    """Number of correct class predictions, or None when it is not defined.

    Defined for class scores y_pred [batch, classes] against class indices
    [batch] (int, or float holding whole numbers) or [batch, 1] (int), or
    one-hot labels [batch, classes].

    Returns:
      int64 scalar tf.Tensor, or None (also for targets or outputs that are
      structures: a model with several outputs).
    """
    y_true, _ = split_weights(y_true)
    if not tf.is_tensor(y_true) or not tf.is_tensor(y_pred):
        return None
    if y_pred.shape.rank != 2 or y_pred.shape[-1] is None or y_pred.shape[-1] < 2:
        return None
    if y_true.shape.rank == 2 and y_true.shape[-1] == 1 and y_true.dtype.is_integer:
        y_true = tf.squeeze(y_true, axis=-1)
    if y_true.shape.rank == 1 and (y_true.dtype.is_integer or y_true.dtype.is_floating):
        # Float class indices count too (whole numbers: see takes_class_indices).
        labels = tf.cast(y_true, tf.int64)
    elif y_true.shape.rank == 2 and y_true.shape[-1] == y_pred.shape[-1]:
        labels = tf.argmax(y_true, axis=-1)
    else:
        return None
    hits = tf.equal(tf.argmax(y_pred, axis=-1), labels)
    return tf.reduce_sum(tf.cast(hits, tf.int64))


def regularization(model, dtype):
    """The sum of the model's regularisation losses as a `dtype` scalar (0 without any)."""
    if not model.losses:
        return tf.zeros([], dtype)
    return tf.cast(tf.add_n(model.losses), dtype)


def tower_loss_sum(loss_fn, model, x, y, training):
    """Sum of per-example losses of one shard and the model's outputs.

    Args:
      loss_fn: fn(y_true, y_pred) -> per-example losses [shard, ...]; trailing
        axes are averaged.
      model: keras.Model, the tower's replica.
      x, y: the tower's shard of inputs and targets, [shard, ...] (or
        structures of them); targets with sample weights are a
        ``batching.Weighted``: each loss value is multiplied by its weight
        first (the weights broadcast against the loss's trailing axes, a
        weight of each token of a sequence too), as Keras' ``fit`` does.
      training: bool, passed to the model call.

    Returns:
      (scalar tf.Tensor of the model's dtype, y_pred [shard, ...]).

    Raises:
      ValueError: loss_fn returned one value for the whole shard.
    """
    y, weights = split_weights(y)
    y_pred = model(x, training=training)
    per_example = tf.convert_to_tensor(loss_fn(y, y_pred))
    if per_example.shape.rank == 0:
        raise ValueError(
            "loss returned a single value for the whole shard; the trainer needs one "
            "value per example "
            "(give a keras.losses.Loss, a loss name, or a function without reduction)"
        )
    if weights is not None:
        per_example = per_example * _against(weights, per_example)
    if per_example.shape.rank > 1:
        per_example = tf.reduce_mean(per_example, axis=list(range(1, per_example.shape.rank)))
    return tf.reduce_sum(per_example), y_pred


def _against(weights, values):
    """Sample weights [batch, ...] in the loss values' dtype, of a rank that broadcasts against them.

    Keras' rule: trailing axes of size 1 are dropped from the weights, or
    added to them, until the ranks agree (weights [B] against per-token
    losses [B, T] weigh every token of an example alike).

    Raises:
      ValueError: the weights' shape cannot broadcast against the losses'.
    """
    weights = tf.cast(weights, values.dtype)
    while weights.shape.rank > values.shape.rank and weights.shape[-1] == 1:
        weights = tf.squeeze(weights, axis=-1)
    while weights.shape.rank < values.shape.rank:
        weights = tf.expand_dims(weights, axis=-1)
    try:
        tf.broadcast_static_shape(weights.shape, values.shape)
    except ValueError:
        raise ValueError(f"sample_weight of shape {weights.shape} does not match the loss values "
                         f"of shape {values.shape}: give one weight per example, [batch], or one "
                         f"per loss value") from None
    return weights
