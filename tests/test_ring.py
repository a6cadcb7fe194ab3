"""Ring all-reduce: structure on "/gpu:k", exact values on CPU devices, errors."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES, build_graph, check, v1_session_config
from tfreduce.basis.contract import shard_sizes as chunk_sizes

SCOPE = "allreduce_ring"


def op(graph, name):
    return graph.get_operation_by_name(f"{SCOPE}/{name}")


def ops_of_type(graph, op_type):
    return [o for o in graph.get_operations() if o.type == op_type]


def test_chunk_sizes():
    assert chunk_sizes(8, 4) == [2, 2, 2, 2]
    assert chunk_sizes(10, 4) == [3, 3, 2, 2]
    assert chunk_sizes(2, 4) == [1, 1, 0, 0]
    assert chunk_sizes(0, 3) == [0, 0, 0]
    assert chunk_sizes(5, 1) == [5]


@pytest.mark.parametrize("num_towers", [2, 3, 4, 8])
def test_every_chunk_step_is_on_its_device(num_towers):
    # Chunk c is summed along c+1 -> c+2 -> ... -> c and copied along
    # c -> c+1 -> ... -> c-1: each step's op sits on the device doing it and
    # reads the previous device's result.
    graph, grads, devices = build_graph(num_towers, [(4 * num_towers,)])
    with graph.as_default():
        tfreduce.allreduce_grads_ring(grads, devices, pack_bytes=None)
    size = 4 * num_towers // num_towers
    for c in range(num_towers):
        for hop in range(2, num_towers + 1):
            k = (c + hop) % num_towers
            add = op(graph, f"entry0_chunk{c}_dev{k}_sum")
            assert add.device == devices[k]
            assert [i.op.device for i in add.inputs] == [devices[k - 1], devices[k]]
            assert add.outputs[0].shape == (size,)
        for hop in range(1, num_towers):
            k = (c + hop) % num_towers
            copy = op(graph, f"entry0_chunk{c}_dev{k}_copy")
            assert copy.type == "Identity"
            assert copy.device == devices[k]
            assert copy.inputs[0].op.device == devices[k - 1]
    assert len(ops_of_type(graph, "AddV2")) == num_towers * (num_towers - 1)
    copies = [o for o in graph.get_operations() if o.name.endswith("_copy")]
    assert len(copies) == num_towers * (num_towers - 1)


@pytest.mark.parametrize("num_towers", [1, 2, 3, 8])
def test_output_k_is_placed_on_device_k(num_towers):
    shapes = [(3,), (4, 5), (), (0,), (2, 1, 3)]
    graph, grads, devices = build_graph(num_towers, shapes)
    with graph.as_default():
        out = tfreduce.allreduce_grads_ring(grads, devices, average=True, pack_bytes=None)
    assert isinstance(out, list) and all(isinstance(row, list) for row in out)
    for k, row in enumerate(out):
        for n, t in enumerate(row):
            assert t.op.device == devices[k], (k, n)
            assert t.shape == shapes[n]
            assert t.dtype == tf.float32
            if num_towers > 1 and len(shapes[n]) != 1:
                # Entries in backward order: the last variable is entry 0.
                assert t.op.name == f"{SCOPE}/entry{len(shapes) - 1 - n}_dev{k}_out"


def test_uneven_sizes_split_into_chunks_differing_by_one():
    graph, grads, devices = build_graph(4, [(10,)])
    with graph.as_default():
        tfreduce.allreduce_grads_ring(grads, devices, pack_bytes=None)
    for k in range(4):
        split = op(graph, f"entry0_dev{k}_split")
        assert split.device == devices[k]
        assert [t.shape[0] for t in split.outputs] == [3, 3, 2, 2]
        # A 1-D gradient's output is the concatenation itself.
        concat = op(graph, f"entry0_dev{k}_out")
        assert concat.type == "ConcatV2" and concat.device == devices[k]
        assert [t.shape[0] for t in concat.inputs[:-1]] == [3, 3, 2, 2]


def test_tiny_tensors_use_only_their_elements_as_chunks():
    # 2 elements on 4 devices: two chunks of one element, each with K-1
    # reduce-scatter steps and K-1 copies; no empty chunk is built.
    graph, grads, devices = build_graph(4, [(2,)])
    with graph.as_default():
        tfreduce.allreduce_grads_ring(grads, devices, pack_bytes=None)
    assert len(ops_of_type(graph, "AddV2")) == 2 * 3
    assert len([o for o in graph.get_operations() if o.name.endswith("_copy")]) == 2 * 3


def test_scalar_chunks_rotate_their_owner_by_entry():
    # One element each: entry m's single chunk completes on device m % K, so
    # small tensors spread over the devices instead of piling onto device 0.
    graph, grads, devices = build_graph(4, [()] * 6)
    with graph.as_default():
        tfreduce.allreduce_grads_ring(grads, devices, average=True, pack_bytes=None)
    for m in range(6):
        total = op(graph, f"entry{m}_chunk{m % 4}_total")
        assert total.device == devices[m % 4]
    assert not ops_of_type(graph, "SplitV") and not ops_of_type(graph, "ConcatV2")


def test_average_scales_once_per_chunk_where_it_completes():
    graph, grads, devices = build_graph(4, [(8,), (3,)])
    with graph.as_default():
        tfreduce.allreduce_grads_ring(grads, devices, average=True, pack_bytes=None)
    muls = ops_of_type(graph, "Mul")
    assert len(muls) == 4 + 3
    for m in muls:
        # Each scale reads the last reduce-scatter add, on the same device.
        assert m.inputs[0].op.type == "AddV2"
        assert m.inputs[0].op.device == m.device


def test_half_precision_partial_sums_travel_in_float32():
    graph, grads, devices = build_graph(4, [(8,)], dtype=tf.float16)
    with graph.as_default():
        out = tfreduce.allreduce_grads_ring(grads, devices, pack_bytes=None)
    for c in range(4):
        # First hop: device c+1's float16 piece, cast on device c+2.
        first = op(graph, f"entry0_chunk{c}_dev{(c + 2) % 4}_sum")
        assert first.outputs[0].dtype == tf.float32
        assert first.inputs[0].op.type == "Cast"
        assert first.inputs[0].op.inputs[0].dtype == tf.float16
        later = op(graph, f"entry0_chunk{c}_dev{(c + 3) % 4}_sum")
        assert later.inputs[0].dtype == tf.float32
        # The all-gather carries the rounded float16 total.
        assert op(graph, f"entry0_chunk{c}_dev{(c + 1) % 4}_copy").outputs[0].dtype == tf.float16
    assert all(t.dtype == tf.float16 for row in out for t in row)


def test_k1_is_an_identity_on_the_one_device():
    graph, grads, devices = build_graph(1, [(5,), ()])
    with graph.as_default():
        out = tfreduce.allreduce_grads_ring(grads, devices, pack_bytes=None)
    assert not ops_of_type(graph, "AddV2")
    assert [t.op.device for t in out[0]] == devices * 2


def test_packing_reduces_one_buffer():
    graph, grads, devices = build_graph(4, [(3,), (5,), (8,)])
    with graph.as_default():
        tfreduce.allreduce_grads_ring(grads, devices, pack_bytes=1024)
    # 16 floats in one buffer: 4 chunks of 4 elements, K(K-1) adds in all.
    assert len(ops_of_type(graph, "AddV2")) == 4 * 3
    assert {o.name.split("/")[1].split("_")[0] for o in ops_of_type(graph, "AddV2")} == {"entry0"}


def test_dispatcher_builds_ring_and_rejects_other_options():
    graph, grads, devices = build_graph(2, [(4,)])
    with graph.as_default():
        tfreduce.allreduce_grads(grads, devices, algorithm="ring", pack_bytes=None)
        assert "ring" in tfreduce.ALGORITHMS
        assert ops_of_type(graph, "AddV2")
        with pytest.raises(TypeError, match=re.escape(
                "algorithm 'ring' takes no option ['groups']")):
            tfreduce.allreduce_grads(grads, devices, algorithm="ring", groups=[[0, 1]])


def test_bad_input_is_reported_like_every_algorithm():
    graph, grads, devices = build_graph(3, [(2,), (3,)])
    with graph.as_default():
        grads[2].pop()
        with pytest.raises(ValueError, match="tower 2 has 1 gradients, tower 0 has 2"):
            tfreduce.allreduce_grads_ring(grads, devices, pack_bytes=None)
        with pytest.raises(TypeError, match="variable 0: average=True needs floating"):
            int_grads = [[tf.zeros([2], tf.int32)] for _ in range(2)]
            tfreduce.allreduce_grads_ring(int_grads, devices[:2], average=True)


# ---------------------------------------------------------------- numeric

@pytest.mark.parametrize("num_towers", [5, 7])
def test_uneven_tiny_and_empty_tensors_exact(runner, num_towers):
    # Sizes around K: empty, fewer elements than K, K+1, not divisible by K.
    shapes = [(0,), (), (3,), (num_towers + 1,), (3, 7), (2, 0, 3)]
    rng = np.random.default_rng(num_towers)
    arrays = [[(rng.integers(-64, 65, size=s) / 4.0).astype(np.float32) for s in shapes]
              for _ in range(num_towers)]
    devices = CPU_DEVICES[:num_towers]
    values, placed = runner(
        lambda g: tfreduce.allreduce_grads_ring(g, devices, average=True, pack_bytes=None),
        arrays, devices)
    check(values, placed, arrays, True, devices)


def test_float16_partial_sums_do_not_overflow(runner):
    # 40000 + 40000 overflows float16 (max 65504) on the way round the ring;
    # the total is 0, and float32 partial sums get it exactly.
    arrays = [[np.full((8,), v, np.float16)] for v in (40000, 40000, -40000, -40000)]
    devices = CPU_DEVICES[:4]
    values, _ = runner(lambda g: tfreduce.allreduce_grads_ring(g, devices, pack_bytes=None),
                       arrays, devices)
    for row in values:
        np.testing.assert_array_equal(row[0], np.zeros((8,), np.float16))


def test_unknown_static_shapes_are_chunked_when_run():
    devices = CPU_DEVICES[:3]
    arrays = [np.arange(10, dtype=np.float32).reshape(5, 2) * (k + 1) for k in range(3)]
    graph = tf.Graph()
    with graph.as_default():
        grads = []
        for k, d in enumerate(devices):
            with tf.device(d):
                grads.append([tf.compat.v1.placeholder(tf.float32, [None, 2], name=f"g{k}")])
        out = tfreduce.allreduce_grads_ring(grads, devices, average=True, pack_bytes=None)
        assert out[0][0].shape.as_list() == [None, 2]
        with tf.compat.v1.Session(graph=graph, config=v1_session_config()) as sess:
            values = sess.run(out, {grads[k][0]: arrays[k] for k in range(3)})
    for k in range(3):
        np.testing.assert_array_equal(values[k][0], np.sum(arrays, axis=0) * np.float32(1 / 3))


def test_indexed_slices_are_gathered_not_chunked():
    devices = CPU_DEVICES[:2]

    @tf.function(autograph=False)
    def step():
        grads = []
        for k, d in enumerate(devices):
            with tf.device(d):
                grads.append([tf.IndexedSlices(tf.fill([1, 2], k + 1.0), tf.constant([k]),
                                               tf.constant([3, 2]))])
        out = tfreduce.allreduce_grads_ring(grads, devices, pack_bytes=None)
        assert all(isinstance(row[0], tf.IndexedSlices) for row in out)
        return [tf.convert_to_tensor(row[0]) for row in out]

    for dense in step():
        np.testing.assert_array_equal(dense.numpy(), [[1, 1], [2, 2], [0, 0]])
