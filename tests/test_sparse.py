"""tf.IndexedSlices: gathered as IndexedSlices, or densified on request."""

import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES

ALGORITHMS = ["flat", "hierarchical", "collective"]
ROWS, COLS = 6, 3


def sparse_case(num_towers):
    """Tower k touches rows k % ROWS and 2 (so row 2 is a duplicate)."""
    rng = np.random.default_rng(num_towers)
    cases = []
    for k in range(num_towers):
        idx = np.array([k % ROWS, 2], np.int64)
        vals = (rng.integers(-8, 9, size=(2, COLS)) / 2.0).astype(np.float32)
        cases.append((idx, vals))
    dense = [np.zeros((ROWS, COLS), np.float32) for _ in range(num_towers)]
    for k, (idx, vals) in enumerate(cases):
        np.add.at(dense[k], idx, vals)
    return cases, np.sum(dense, axis=0, dtype=np.float32)


def build_inputs(cases, devices, extra):
    grads = []
    for (idx, vals), d in zip(cases, devices):
        with tf.device(d):
            s = tf.IndexedSlices(tf.constant(vals), tf.constant(idx), tf.constant([ROWS, COLS],
                                                                                  tf.int64))
            grads.append([s, tf.constant(extra, tf.float32)])
    return grads


@pytest.mark.parametrize("sparse_as_dense", [False, True])
@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("num_towers", [1, 3, 4])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_sparse_dense_value_equals_dense_sum(algorithm, num_towers, average, sparse_as_dense):
    devices = CPU_DEVICES[:num_towers]
    cases, want = sparse_case(num_towers)
    if average:
        want = want * np.float32(1.0 / num_towers)

    @tf.function(autograph=False)
    def step():
        grads = build_inputs(cases, devices, extra=[1.0, 2.0])
        out = tfreduce.allreduce_grads(grads, devices, average=average, algorithm=algorithm,
                                       sparse_as_dense=sparse_as_dense)
        kinds = [isinstance(row[0], tf.IndexedSlices) for row in out]
        places = [(row[0].values if kinds[k] else row[0]).op.device
                  for k, row in enumerate(out)]
        dense = [tf.convert_to_tensor(row[0]) for row in out]
        return dense, kinds, places

    concrete = step.get_concrete_function()
    dense, kinds, places = step()
    assert kinds == [not sparse_as_dense] * num_towers
    for k in range(num_towers):
        np.testing.assert_array_equal(dense[k].numpy(), want)
        assert places[k] == devices[k]
    assert concrete is not None


def test_gathered_slices_keep_every_row_and_place_indices_on_each_device():
    devices = CPU_DEVICES[:3]
    cases, _ = sparse_case(3)
    graph = tf.Graph()
    with graph.as_default():
        grads = build_inputs(cases, devices, extra=[0.0])
        out = tfreduce.allreduce_grads_flat(grads, devices)
        with tf.compat.v1.Session(graph=graph) as sess:
            values = sess.run([row[0] for row in out])
    for k, v in enumerate(values):
        assert out[k][0].values.op.device == devices[k]
        assert out[k][0].indices.op.device == devices[k]
        np.testing.assert_array_equal(v.indices, np.concatenate([c[0] for c in cases]))
        np.testing.assert_array_equal(v.values, np.concatenate([c[1] for c in cases]))
        np.testing.assert_array_equal(v.dense_shape, [ROWS, COLS])


def test_mixed_sparse_and_dense_towers_reduce_densely():
    devices = CPU_DEVICES[:2]
    cases, want = sparse_case(2)
    graph = tf.Graph()
    with graph.as_default():
        grads = build_inputs(cases, devices, extra=[0.0])
        dense_b = np.zeros((ROWS, COLS), np.float32)
        np.add.at(dense_b, cases[1][0], cases[1][1])
        with tf.device(devices[1]):
            grads[1][0] = tf.constant(dense_b)
        out = tfreduce.allreduce_grads_hierarchical(grads, devices)
        assert not any(isinstance(row[0], tf.IndexedSlices) for row in out)
        with tf.compat.v1.Session(graph=graph) as sess:
            values = sess.run([row[0] for row in out])
    for v in values:
        np.testing.assert_array_equal(v, want)


def test_gradients_of_an_embedding_lookup_are_reduced_as_slices():
    # The real source of IndexedSlices: tf.gather on a variable.
    devices = CPU_DEVICES[:2]
    tables = []
    for d in devices:
        with tf.device(d):
            tables.append(tf.Variable(np.arange(12, dtype=np.float32).reshape(4, 3)))

    @tf.function(autograph=False)
    def step():
        grads = []
        for k, (d, table) in enumerate(zip(devices, tables)):
            with tf.device(d), tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.gather(table, [k, 3]))
            grads.append(tape.gradient(loss, [table]))
        assert isinstance(grads[0][0], tf.IndexedSlices)
        out = tfreduce.allreduce_grads(grads, devices, average=True)
        return [tf.convert_to_tensor(row[0]) for row in out]

    want = np.zeros((4, 3), np.float32)
    want[[0, 1]] = 0.5
    want[3] = 1.0
    for v in step():
        np.testing.assert_array_equal(v.numpy(), want)
