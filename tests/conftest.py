"""Test set-up: 8 logical CPU devices stand in for 8 GPUs.

The logical devices must be configured before TensorFlow initialises its
runtime, so this happens once, when pytest imports this file. Shared helpers
live in helpers.py.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from helpers import NUM_CPUS, run_in_function, run_in_session  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_CPUS)


@pytest.fixture(params=["function", "session"])
def runner(request):
    """Runs a reduction in a tf.function (TF2) or a tf.compat.v1 Session."""
    return run_in_function if request.param == "function" else run_in_session


@pytest.fixture
def mixed_float16():
    """Keras' mixed_float16 policy for one test, float32 again after it."""
    import keras

    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")
