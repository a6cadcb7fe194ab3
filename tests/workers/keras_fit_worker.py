"""Keras model.fit under MirroredStrategy on K logical CPU devices, for tests/test_distribute.py.

``fit_weights`` trains a small dense + BatchNorm classifier for 2 epochs on
fixed data with the given cross-device ops and returns its weights. Run as
a script (``python keras_fit_worker.py K OUT.npz``), it does that with
MirroredStrategy's default reduction in a fresh process: on CPUs the default
is CollectiveAllReduce, whose group keys restart at 1 in every strategy, so
strategies over different device sets cannot share a process.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

BATCH, EPOCHS = 32, 2


def data():
    """96 examples of 6 float32 features and one of 3 classes."""
    rng = np.random.default_rng(0)
    return rng.normal(size=(96, 6)).astype(np.float32), rng.integers(0, 3, 96).astype(np.int64)


def make_model(dtype="float32", batch_norm=True):
    import keras

    layers = [keras.Input((6,), dtype=dtype), keras.layers.Dense(8, dtype=dtype)]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization(dtype=dtype))
    layers += [keras.layers.ReLU(dtype=dtype), keras.layers.Dense(3, dtype=dtype)]
    return keras.Sequential(layers)


def fit_weights(devices, cross_device_ops="default", dtype="float32", batch_norm=True):
    """Weights and per-epoch losses after fit; devices None trains without a strategy."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(1)
    x, y = data()
    if devices is None:
        strategy = tf.distribute.get_strategy()  # the default: one device, no reduction
    elif cross_device_ops == "default":
        strategy = tf.distribute.MirroredStrategy(devices)
    else:
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
    with strategy.scope():
        model = make_model(dtype, batch_norm)
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x.astype(dtype), y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                        verbose=0)
    return model.get_weights(), history.history["loss"]


if __name__ == "__main__":
    import tensorflow as tf

    num_devices, out = int(sys.argv[1]), sys.argv[2]
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
    weights, losses = fit_weights([f"/device:CPU:{k}" for k in range(num_devices)])
    np.savez(out, *weights, losses=np.array(losses))
