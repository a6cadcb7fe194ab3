"""The small image CNN that the example trains and the benchmark's train mode times.

One definition, so that ``tfreduce-bench --mode train`` measures the model
that ``examples/image_classification.py`` trains.
"""

import keras

__all__ = ["image_cnn"]


def image_cnn(input_shape, num_classes, seed=0, batch_norm=None):
    """Two conv-BatchNorm-ReLU-pool blocks (32, 64 filters) and a linear classifier.

    Convolutions are 3x3 without bias (BatchNorm follows); initialisers are
    seeded, so every call with the same arguments builds the same weights.

    Args:
      input_shape: (height, width, channels).
      num_classes: int, number of logits.
      seed: int, seed of the weight initialisers.
      batch_norm: the BatchNormalization layer class, None for Keras' (one
        process per device: ``tfreduce.tensorflow.keras.SyncBatchNormalization``).

    Returns:
      keras.Model mapping float32 [batch, *input_shape] to float32 logits
      [batch, num_classes]; under a mixed precision policy the hidden
      layers compute in float16 or bfloat16.
    """
    inputs = keras.Input(input_shape)
    x = inputs
    for block, filters in enumerate((32, 64)):
        x = keras.layers.Conv2D(
            filters, 3, padding="same", use_bias=False,
            kernel_initializer=keras.initializers.HeNormal(seed=seed + block))(x)
        # Momentum 0.9, not Keras' 0.99: a small data set gives few steps
        # per epoch, and the moving statistics used at test time must keep up.
        x = (batch_norm or keras.layers.BatchNormalization)(momentum=0.9)(x)
        x = keras.layers.ReLU()(x)
        x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Flatten()(x)
    # float32 logits under a mixed precision policy too: the softmax and
    # the loss stay in float32 (Keras' mixed precision guide).
    outputs = keras.layers.Dense(
        num_classes, kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 2),
        dtype="float32")(x)
    return keras.Model(inputs, outputs, name="cnn")
