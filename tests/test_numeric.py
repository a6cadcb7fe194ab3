"""Exact per-device values of every CPU-runnable algorithm against NumPy."""

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES, RUNNERS, check, covering

ALGORITHMS = ["flat", "hierarchical", "ring", "collective"]
DTYPES = {
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "bfloat16": ml_dtypes.bfloat16,
}
SHAPES = [(), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 2), (4, 8)]


def make_grads(num_towers, seed):
    """K x N arrays: every shape in every dtype, values exact in bfloat16.

    Values are multiples of 1/4 in [-16, 16]: their sums over 8 towers and
    the float32 means are exact in every dtype, so any summation order gives
    the NumPy value and the test can demand equality.
    """
    rng = np.random.default_rng(seed)
    grads = [[] for _ in range(num_towers)]
    for dtype in DTYPES.values():
        for shape in SHAPES:
            for k in range(num_towers):
                v = rng.integers(-64, 65, size=shape) / 4.0
                grads[k].append(np.asarray(v, dtype=dtype))
    return grads


# 256: buffers of several gradients, sizes that are multiples of 64 bytes
# (handed out as slices) beside others (the copied tail). Every pair of
# settings meets in some case (every algorithm at every K, in each runner);
# K = 6 and 8 are in the full suite only.
@covering(runner=list(RUNNERS), algorithm=ALGORITHMS, num_towers=[1, 2, 3, 4, 6, 8],
          average=[False, True], pack_bytes=[None, 256],
          slow=lambda case: case["num_towers"] >= 6 or (case["algorithm"], case["num_towers"],
                                                        case["runner"]) == ("ring", 4, "function"))
def test_exact_values_on_every_device(runner, algorithm, num_towers, average, pack_bytes):
    runner = RUNNERS[runner]
    devices = CPU_DEVICES[:num_towers]
    grads = make_grads(num_towers, seed=num_towers)

    def build(g):
        return tfreduce.allreduce_grads(g, devices, average=average, algorithm=algorithm,
                                        pack_bytes=pack_bytes)

    values, placed = runner(build, grads, devices)
    check(values, placed, grads, average, devices)


@pytest.mark.parametrize("groups", [
    pytest.param([[0, 1, 2], [3, 4], [5]], marks=pytest.mark.slow), [[5, 0], [1, 3, 2, 4]],
    pytest.param([[0], [1], [2], [3], [4], [5]], marks=pytest.mark.slow)])
def test_hierarchical_uneven_groups(runner, groups):
    devices = CPU_DEVICES[:6]
    grads = make_grads(6, seed=11)

    def build(g):
        return tfreduce.allreduce_grads_hierarchical(g, devices, average=True, groups=groups)

    values, placed = runner(build, grads, devices)
    check(values, placed, grads, True, devices)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_half_precision_mean_does_not_overflow(runner, algorithm):
    # 8 x 30000 = 240000 overflows float16 (max 65504); the mean does not.
    devices = CPU_DEVICES[:8]
    grads = [[np.full((4,), 30000.0, np.float16)] for _ in range(8)]

    def build(g):
        return tfreduce.allreduce_grads(g, devices, average=True, algorithm=algorithm)

    values, _ = runner(build, grads, devices)
    for row in values:
        np.testing.assert_array_equal(row[0], np.full((4,), 30000.0, np.float16))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_devices_none_takes_tensor_devices(algorithm):
    devices = [CPU_DEVICES[3], CPU_DEVICES[1], CPU_DEVICES[6]]
    grads = [[np.full((2,), k + 1.0, np.float32)] for k in range(3)]

    @tf.function(autograph=False)
    def step():
        g = []
        for k, d in enumerate(devices):
            with tf.device(d):
                g.append([tf.constant(grads[k][0])])
        out = tfreduce.allreduce_grads(g, average=False, algorithm=algorithm)
        return [[tf.identity(x) for x in row] for row in out], [[x.op.device for x in row]
                                                               for row in out]

    concrete = step.get_concrete_function()
    ops = {op.name: op for op in concrete.graph.get_operations()}
    values = step()[0]
    for k, d in enumerate(devices):
        np.testing.assert_array_equal(values[k][0].numpy(), [6.0, 6.0])
    out_ops = [op for op in ops.values() if op.name.endswith("_out")]
    assert {op.device for op in out_ops} == {d for d in devices}


def test_collective_eager_call_is_wrapped():
    devices = CPU_DEVICES[:3]
    grads = []
    for k, d in enumerate(devices):
        with tf.device(d):
            grads.append([tf.constant([k + 1.0, 2.0])])
    out = tfreduce.allreduce_grads_collective(grads, devices, average=True)
    for row in out:
        np.testing.assert_array_equal(row[0].numpy(), [2.0, 2.0])


def test_flat_eager_outputs_live_on_their_devices():
    devices = CPU_DEVICES[:4]
    grads = []
    for k, d in enumerate(devices):
        with tf.device(d):
            grads.append([tf.constant([k, 1.0]), tf.constant(3.0 * k)])
    out = tfreduce.allreduce_grads_flat(grads, devices)
    for k, row in enumerate(out):
        assert row[0].device.endswith(devices[k])
        assert row[1].device.endswith(devices[k])
        np.testing.assert_array_equal(row[0].numpy(), [6.0, 4.0])
        assert row[1].numpy() == 18.0


@pytest.mark.slow
def test_hundreds_of_collectives_do_not_deadlock(runner):
    # 150 separate reductions on 4 devices sharing 2 cores: the per-device
    # chain keeps every device launching them in the same order.
    devices = CPU_DEVICES[:4]
    grads = [[np.full((3,), k + n / 4.0, np.float32) for n in range(150)] for k in range(4)]

    def build(g):
        return tfreduce.allreduce_grads_collective(g, devices, timeout=120)

    values, placed = runner(build, grads, devices)
    check(values, placed, grads, False, devices)
