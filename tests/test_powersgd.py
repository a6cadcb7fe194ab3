"""PowerSGD (tfreduce.algorithms.powersgd): the reduction against NumPy, its state, its bytes, its errors."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES, GPU_DEVICES
from tfreduce.algorithms.powersgd import PowerSGD, PowerSGDState, powersgd_allreduce

# A [2, 3, 4] kernel (a 6 x 4 matrix), a vector, a [5, 6] matrix.
SHAPES = [[2, 3, 4], [4], [5, 6]]


def flat(devices):
    def allreduce(all_grads, average):
        return tfreduce.allreduce_grads(all_grads, devices, average=average, algorithm="flat")
    return allreduce


def make(config, num_towers, shapes=SHAPES, dtype=tf.float64, devices=None):
    devices = devices or CPU_DEVICES[:num_towers]
    variables = [tf.Variable(tf.zeros(s, dtype)) for s in shapes]
    return devices, PowerSGDState(config, devices, variables)


def gradients(rng, devices, shapes=SHAPES):
    arrays = [[rng.normal(size=s) for s in shapes] for _ in devices]
    grads = []
    for d, row in zip(devices, arrays):
        with tf.device(d):
            grads.append([tf.constant(a) for a in row])
    return arrays, grads


def run(state, devices, grads, average):
    return tf.function(autograph=False)(lambda: powersgd_allreduce(
        grads, state, flat(devices), average, len(devices)))()


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("num_towers", [2, 3])
def test_full_rank_equals_the_plain_all_reduce(num_towers, average):
    devices, state = make(PowerSGD(rank=10, min_compression_rate=0), num_towers)
    assert state.ranks == [4, 0, 5]  # min(rows, cols); vectors stay plain
    rng = np.random.default_rng(num_towers)
    for _ in range(3):  # error feedback carried from step to step
        arrays, grads = gradients(rng, devices)
        out = run(state, devices, grads, average)
        for n in range(len(SHAPES)):
            want = sum(row[n] for row in arrays) / (num_towers if average else 1)
            for k in range(num_towers):
                np.testing.assert_allclose(out[k][n].numpy(), want, rtol=1e-10, atol=1e-12,
                                           err_msg=f"tower {k} variable {n}")
                assert out[k][n].shape == SHAPES[n]


def test_rank_one_gradients_are_exact_at_rank_one():
    devices, state = make(PowerSGD(rank=1, min_compression_rate=0), 2, shapes=[[6, 4]])
    rng = np.random.default_rng(0)
    u, v = rng.normal(size=(6, 1)), rng.normal(size=(1, 4))
    grads = []
    for k, d in enumerate(devices):
        with tf.device(d):
            grads.append([tf.constant((k + 1.0) * u @ v)])
    out = run(state, devices, grads, average=True)
    for k in range(2):
        np.testing.assert_allclose(out[k][0].numpy(), 1.5 * u @ v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("average", [False, True])
def test_error_feedback_keeps_what_the_approximation_left_out(average):
    num_towers = 3
    devices, state = make(PowerSGD(rank=1, min_compression_rate=0), num_towers,
                          shapes=[[6, 5]])
    rng = np.random.default_rng(1)
    errors = [np.zeros((6, 5)) for _ in devices]
    for step in range(3):
        arrays, grads = gradients(rng, devices, shapes=[[6, 5]])
        out = run(state, devices, grads, average)
        approx = out[0][0].numpy()
        share = approx if average else approx / num_towers
        for k in range(num_towers):
            # E_k = (G_k + E_k before) - the tower's share of the approximation
            want = arrays[k][0] + errors[k] - share
            np.testing.assert_allclose(state.error[k][0].numpy(), want, rtol=1e-10,
                                       atol=1e-12, err_msg=f"step {step} tower {k}")
            errors[k] = want
            # The reduced Q is every tower's next start, bit for bit.
            np.testing.assert_array_equal(state.q[k][0].numpy(), state.q[0][0].numpy())
            np.testing.assert_array_equal(out[k][0].numpy(), approx)
        # Rank 1: the output is a rank-1 matrix.
        assert np.linalg.matrix_rank(approx, tol=1e-8) == 1


def test_plain_gradients_pass_unchanged_and_none_stays_none():
    devices, state = make(PowerSGD(rank=1), 2, shapes=[[40, 30], [3, 2], [8], [4, 3]])
    assert state.ranks == [1, 0, 0, 0]  # [3, 2] and [4, 3] do not shrink by 2x at rank 1
    rng = np.random.default_rng(2)
    arrays, grads = gradients(rng, devices, shapes=[[40, 30], [3, 2], [8], [4, 3]])
    for row in grads:
        row[3] = None
    out = run(state, devices, grads, average=False)
    for k in range(2):
        np.testing.assert_allclose(out[k][1].numpy(), arrays[0][1] + arrays[1][1], rtol=1e-12)
        np.testing.assert_allclose(out[k][2].numpy(), arrays[0][2] + arrays[1][2], rtol=1e-12)
        assert out[k][3] is None


def test_starting_q_is_seeded_and_reset_restarts():
    _, a = make(PowerSGD(rank=2, seed=7, min_compression_rate=0), 2)
    _, b = make(PowerSGD(rank=2, seed=7, min_compression_rate=0), 2)
    _, c = make(PowerSGD(rank=2, seed=8, min_compression_rate=0), 2)
    np.testing.assert_array_equal(a.q[0][0].numpy(), a.q[1][0].numpy())
    np.testing.assert_array_equal(a.q[0][0].numpy(), b.q[0][0].numpy())
    assert not np.array_equal(a.q[0][0].numpy(), c.q[0][0].numpy())
    start = a.q[1][2].numpy()
    a.q[1][2].assign(tf.zeros_like(a.q[1][2]))
    a.error[1][2].assign(tf.ones_like(a.error[1][2]))
    a.reset()
    np.testing.assert_array_equal(a.q[1][2].numpy(), start)
    assert not a.error[1][2].numpy().any()


def test_ops_are_placed_on_their_towers_and_the_bytes_are_the_payload():
    graph = tf.Graph()
    with graph.as_default():
        devices = GPU_DEVICES[:2]
        variables = [tf.Variable(tf.zeros(s, tf.float32)) for s in [[64, 32], [32]]]
        state = PowerSGDState(PowerSGD(rank=2), devices, variables)
        grads = []
        for d in devices:
            with tf.device(d):
                grads.append([tf.zeros([64, 32]), tf.zeros([32])])
        out = powersgd_allreduce(grads, state, flat(devices), True, 2)
        traffic = tfreduce.analyze_traffic(out, inputs=grads)
    for k, row in enumerate(out):
        for t in row:
            assert t.op.inputs[0].device.endswith(f"GPU:{k}")
    for op in graph.get_operations():
        if op.type in ("MatMul", "Qr"):
            assert op.device.endswith(("GPU:0", "GPU:1")), op.name
    qr_devices = sorted(op.device[-5:] for op in graph.get_operations() if op.type == "Qr")
    assert qr_devices == ["GPU:0", "GPU:1"]  # each tower orthogonalises its own copy
    sent, full = state.payload_bytes()
    assert (sent, full) == (((64 + 32) * 2 + 32) * 4, (64 * 32 + 32) * 4)
    # Flat: tower 1 sends its payload to the root and gets the result back.
    assert traffic.pair_bytes[("/device:GPU:1", "/device:GPU:0")] == sent
    assert traffic.pair_bytes[("/device:GPU:0", "/device:GPU:1")] == sent


def test_payload_elements_and_matrix_rank():
    config = PowerSGD(rank=4)
    assert config.matrix_rank([3, 3, 64, 128]) == 4  # 576 x 128
    assert config.matrix_rank([128]) == 0
    assert config.matrix_rank([8, 8]) == 0  # (8 + 8) * 4 * 2 > 64
    assert config.payload_elements([[3, 3, 64, 128], [128]]) == (
        (576 + 128) * 4 + 128, 576 * 128 + 128)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"rank": 0}, ValueError, "PowerSGD rank must be >= 1, got 0"),
    ({"rank": 2.0}, TypeError, "PowerSGD rank must be an int, got 2.0"),
    ({"seed": "a"}, TypeError, "PowerSGD seed must be an int, got 'a'"),
    ({"min_compression_rate": -1}, ValueError,
     "PowerSGD min_compression_rate must be a number >= 0, got -1"),
    ({"min_compression_rate": float("nan")}, ValueError,
     "PowerSGD min_compression_rate must be a number >= 0, got nan"),
])
def test_bad_settings(kwargs, error, message):
    with pytest.raises(error, match=f"^{message}$"):
        PowerSGD(**kwargs)


def test_state_needs_an_instance():
    with pytest.raises(TypeError, match="compression state needs a tfreduce.PowerSGD, got 2"):
        PowerSGDState(2, CPU_DEVICES[:2], [])


def test_the_stateless_reductions_point_to_the_trainer():
    grads = [[tf.zeros([4, 4])], [tf.zeros([4, 4])]]
    with pytest.raises(ValueError, match=re.escape(
            "compression must be None, 'fp16' or 'bf16', got PowerSGD(rank=2, "
            "min_compression_rate=2.0, seed=0) (or tfreduce.Compression.none, .fp16, .bf16; "
            "PowerSGD keeps state between steps: it is a ReplicatedTrainer option of its own, "
            "powersgd=tfreduce.PowerSGD(rank=2))")):
        tfreduce.allreduce_grads(grads, CPU_DEVICES[:2], compression=PowerSGD())
