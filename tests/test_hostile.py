"""What a hostile user found in the newer features: each case, as it should behave now.

Every test here failed before the fix it names: a 16-bit mean that
overflowed, a topology of one device that crashed with a KeyError, a
prediction that costed unknown shapes as 0 bytes.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES
from test_update import mixed_float16  # noqa: F401 (a fixture)
from tfreduce.trainer import ReplicatedTrainer

CPU_ALGORITHMS = ["flat", "hierarchical", "ring", "collective"]


def towers(values, devices):
    out = []
    for value, device in zip(values, devices):
        with tf.device(device):
            out.append([tf.constant(value)])
    return out


# ------------------------------------------------------------------ 16-bit means

@pytest.mark.parametrize("compression", ["fp16", tfreduce.Compression.fp16])
@pytest.mark.parametrize("algorithm", CPU_ALGORITHMS)
def test_a_16_bit_mean_that_fits_does_not_overflow(algorithm, compression):
    # One tower at 70000 (beyond float16's 65504), seven at 1: the mean,
    # 8750.875, fits. It came back inf on every tower, for every algorithm.
    devices = CPU_DEVICES[:8]
    values = [np.full((5,), 70000.0 if k == 0 else 1.0, np.float32) for k in range(8)]
    out = tfreduce.allreduce_grads(towers(values, devices), devices, average=True,
                                   algorithm=algorithm, compression=compression)
    for k, row in enumerate(out):
        assert row[0].dtype == tf.float32 and row[0].device.endswith(f"CPU:{k}")
        np.testing.assert_array_equal(row[0].numpy(), np.float16(70007.0 / 8))


# ------------------------------------------------------------------ one device

def one_device_topology():
    return tfreduce.Topology(1, [], memory_bandwidth=1e11, launch_cost=5e-6, name="one")


@pytest.mark.parametrize("topology", ["dgx-a100", "one"])
def test_a_topology_with_one_device_plans_and_runs(topology):
    # Every entry point raised a bare KeyError: (0, 0) from Topology.route.
    topology = one_device_topology() if topology == "one" else topology
    plan = tfreduce.plan_allreduce([[4, 3], [3]], ["/gpu:0"], topology)
    assert plan.algorithm in tfreduce.ALGORITHMS and plan.seconds >= 0
    grads = towers([np.arange(6, dtype=np.float32)], CPU_DEVICES[:1])
    out = tfreduce.allreduce_grads(grads, CPU_DEVICES[:1], average=True, topology=topology)
    np.testing.assert_array_equal(out[0][0].numpy(), np.arange(6))
    trainer = ReplicatedTrainer(
        lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), "mse",
        lambda: keras.optimizers.SGD(0.1), devices=CPU_DEVICES[:1], topology=topology)
    rng = np.random.default_rng(0)
    assert np.isfinite(trainer.train_step(rng.normal(size=(4, 3)), rng.normal(size=(4, 2))))


def test_routes_of_one_device_and_outside_the_topology():
    topology = one_device_topology()
    assert topology.route(0, 0) == []
    with pytest.raises(ValueError, match=r"^topology 'one' has devices 0..0, no device 1$"):
        topology.route(0, 1)
    with pytest.raises(ValueError, match=r"topology 'dgx-a100' has devices 0..7, no device 8"):
        tfreduce.Topology.preset("dgx-a100").route(8, 0)


# ------------------------------------------------------------------ predict

@pytest.mark.parametrize("algorithm", ["flat", "ring", "collective"])
def test_predict_names_a_tensor_of_unknown_size(algorithm):
    # It costed them as 0 bytes: 0.102 ms where the static graph takes 2.861 ms.
    devices = CPU_DEVICES[:2]

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)] * 2)
    def reduce(a, b):
        with tf.device(devices[0]):
            a = tf.identity(a)
        with tf.device(devices[1]):
            b = tf.identity(b)
        return tfreduce.allreduce_grads([[a], [b]], devices, algorithm=algorithm)

    graph = reduce.get_concrete_function().graph
    with pytest.raises(ValueError) as info:
        tfreduce.predict(graph, tfreduce.Topology.fully_connected(2, 1e9))
    message = str(info.value)
    assert message.startswith("predict costs the bytes of static shapes, but tensor 'Identity")
    assert "has shape (None,)" in message
    assert "tfreduce.plan_allreduce takes the shapes you expect" in message


# ------------------------------------------------------------------ mixed precision

@pytest.mark.parametrize("accumulate_steps", [2, 4, 8])
def test_mixed_float16_with_accumulation_skips_no_update_on_clean_data(mixed_float16,
                                                                       accumulate_steps):
    # Between updates the loss was scaled by K instead of K/B: the float16
    # backward pass overflowed and LossScaleOptimizer skipped 2 of 2 updates.
    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                                 keras.layers.Dense(10, dtype="float32")])

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 20)).astype("float32"), rng.integers(0, 10, 256)
    trainer = ReplicatedTrainer(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                lambda: keras.optimizers.SGD(0.1), devices=CPU_DEVICES[:2],
                                accumulate_steps=accumulate_steps)
    for s in range(2 * accumulate_steps):
        trainer.train_step(x[s * 16:(s + 1) * 16], y[s * 16:(s + 1) * 16])
    assert trainer.skipped_steps == 0
    scale = trainer.optimizers[0].dynamic_scale
    assert float(scale) == 2.0**15  # Keras' initial scale: never lowered
    assert trainer.check_replicas() == 0.0
