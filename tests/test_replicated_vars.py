"""broadcast_variables and max_replica_difference on K towers."""

import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES


def tower_vars(num_towers, offset=0.0):
    out = []
    for k in range(num_towers):
        with tf.device(CPU_DEVICES[k]):
            out.append([tf.Variable(np.full((2, 3), k + offset, np.float32)),
                        tf.Variable(np.float64(10 * k)),
                        tf.Variable(np.arange(3, dtype=np.int64) * k)])
    return out


def test_broadcast_copies_root_to_every_tower_eagerly():
    all_vars = tower_vars(4)
    assert tfreduce.max_replica_difference(all_vars).numpy() == 30.0
    tfreduce.broadcast_variables(all_vars, root=2)
    for k in range(4):
        np.testing.assert_array_equal(all_vars[k][0].numpy(), np.full((2, 3), 2.0))
        assert all_vars[k][1].numpy() == 20.0
        np.testing.assert_array_equal(all_vars[k][2].numpy(), [0, 2, 4])
        assert all_vars[k][0].device.endswith(CPU_DEVICES[k])
    assert tfreduce.max_replica_difference(all_vars).numpy() == 0.0


def test_broadcast_in_a_function_places_each_assign_on_its_tower():
    all_vars = tower_vars(3, offset=0.5)

    @tf.function(autograph=False)
    def sync():
        tfreduce.broadcast_variables(all_vars)
        return tfreduce.max_replica_difference(all_vars)

    graph = sync.get_concrete_function().graph
    assigns = [op for op in graph.get_operations() if op.type == "AssignVariableOp"]
    assert len(assigns) == 6
    assert sorted(op.device for op in assigns) == sorted(
        [f"/job:localhost/replica:0/task:0{d}" for d in CPU_DEVICES[1:3]] * 3)
    assert sync().numpy() == 0.0
    np.testing.assert_array_equal(all_vars[2][0].numpy(), np.full((2, 3), 0.5))


def test_keras_variables_are_broadcast_on_their_towers():
    # model.trainable_variables lists Keras 3 variables, which wrap a
    # tf.Variable and have no device of their own.
    import keras

    models = []
    for k in range(3):
        with tf.device(CPU_DEVICES[k]):
            models.append(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    all_vars = [m.trainable_variables for m in models]
    assert not isinstance(all_vars[0][0], tf.Variable)
    want = np.max([np.abs(m.get_weights()[0] - models[0].get_weights()[0]) for m in models])
    assert tfreduce.max_replica_difference(all_vars).numpy() == pytest.approx(want, abs=1e-7)
    assert want > 0
    tfreduce.broadcast_variables(all_vars)
    for k, model in enumerate(models):
        np.testing.assert_array_equal(model.get_weights()[0], models[0].get_weights()[0])
        assert all_vars[k][0].value.device.endswith(CPU_DEVICES[k])
    assert tfreduce.max_replica_difference(all_vars).numpy() == 0.0


def test_max_replica_difference_is_the_largest_elementwise_gap():
    all_vars = tower_vars(2)
    all_vars[1][0].assign(all_vars[0][0])
    all_vars[1][1].assign(all_vars[0][1] - 0.25)
    all_vars[1][2].assign([0, 0, 0])
    assert tfreduce.max_replica_difference(all_vars).numpy() == 0.25
    assert tfreduce.max_replica_difference(all_vars[:1]).numpy() == 0.0


def test_mismatched_towers_are_errors():
    all_vars = tower_vars(2)
    with pytest.raises(ValueError, match="tower 1 has 2 variables, tower 0 has 3"):
        tfreduce.broadcast_variables([all_vars[0], all_vars[1][:2]])
    with tf.device(CPU_DEVICES[1]):
        wrong = tf.Variable(np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match=r"variable 0 \(.*\): tower 1 has float32 \(3, 2\), "
                                         r"tower 0 has float32 \(2, 3\)"):
        tfreduce.broadcast_variables([all_vars[0], [wrong] + all_vars[1][1:]])
    with pytest.raises(ValueError, match=r"root tower 2 is outside 0\.\.1"):
        tfreduce.broadcast_variables(all_vars, root=2)
