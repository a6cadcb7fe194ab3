"""Packing (tensor fusion): which gradients share a buffer, and the ops it builds.

Numeric exactness of packed reductions is covered in test_numeric.py
(pack_bytes=64 for every algorithm); these tests build on "/gpu:k" and only
look at the graph.
"""

import inspect

import pytest
import tensorflow as tf

import tfreduce
from helpers import GPU_DEVICES, placeholders
from tfreduce.packing import DEFAULT_PACK_BYTES

ALGORITHMS = ["flat", "hierarchical", "ring", "collective", "nccl"]


def build(num_towers, specs, algorithm="flat", **options):
    """specs: list of (shape, dtype); returns (graph, out)."""
    devices = GPU_DEVICES[:num_towers]
    graph = tf.Graph()
    with graph.as_default():
        grads = placeholders(devices, specs)
        out = tfreduce.allreduce_grads(grads, devices, algorithm=algorithm, **options)
    return graph, out


def packs(graph):
    return [op for op in graph.get_operations()
            if op.type == "ConcatV2" and "_pack" in op.name]


def unpacks(graph):
    return [op for op in graph.get_operations() if op.type == "SplitV" and "_unpack" in op.name]


def packed_members(op):
    """The variable indices packed by one concat (through any reshape)."""
    sources = [t.op.inputs[0].op if t.op.type == "Reshape" else t.op for t in op.inputs[:-1]]
    return [src.name.split("_g")[-1] for src in sources]


def f32(*shape):
    return (shape, tf.float32)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_one_concat_and_one_split_per_buffer_and_device(algorithm):
    # 10 tensors of 100 bytes, pack_bytes=400: buffers of 4, 4 and 2.
    graph, out = build(3, [f32(25)] * 10, algorithm, pack_bytes=400)
    assert len(packs(graph)) == 3 * 3
    assert len(unpacks(graph)) == 3 * 3
    # 1-D gradients go into the concat and come out of the split as they are.
    assert not [op for op in graph.get_operations() if op.type == "Reshape"
                and ("_pack" in op.name or "_unpack" in op.name)]
    sizes = sorted(len(op.inputs) - 1 for op in packs(graph))
    assert sizes == [2] * 3 + [4] * 6
    for k in range(3):
        on_k = [op for op in packs(graph) + unpacks(graph) if op.device == GPU_DEVICES[k]]
        assert len(on_k) == 6
        assert all(t.shape == (25,) and t.op.device == GPU_DEVICES[k] for t in out[k])


def test_buffers_fill_in_variable_order_and_close_at_pack_bytes():
    # 40, 40, 40 bytes at pack_bytes=100: [0, 1] then [2] (120 > 100). A
    # tensor of exactly pack_bytes is not smaller than it: passed through.
    graph, _ = build(2, [f32(10), f32(10), f32(10), f32(25), f32(5)], pack_bytes=100)
    members = [packed_members(op) for op in packs(graph) if op.device == GPU_DEVICES[0]]
    assert members == [["0", "1"], ["2", "4"]]


def test_dtypes_are_packed_separately():
    specs = [f32(4), ((4,), tf.float16), f32(4), ((4,), tf.float16), ((2,), tf.float64)]
    graph, out = build(2, specs, pack_bytes=1024)
    dev0 = [op for op in packs(graph) if op.device == GPU_DEVICES[0]]
    assert sorted(op.outputs[0].dtype.name for op in dev0) == ["float16", "float32"]
    assert sorted(packed_members(op) for op in dev0) == [["0", "2"], ["1", "3"]]
    assert [t.dtype for t in out[1]] == [s[1] for s in specs]


def test_unknown_shapes_large_tensors_and_slices_pass_through():
    devices = GPU_DEVICES[:2]
    graph = tf.Graph()
    with graph.as_default():
        grads = []
        for k, d in enumerate(devices):
            with tf.device(d):
                grads.append([
                    tf.compat.v1.placeholder(tf.float32, [3], name=f"t{k}_g0"),
                    tf.compat.v1.placeholder(tf.float32, [None], name=f"t{k}_g1"),
                    tf.compat.v1.placeholder(tf.float32, [1000], name=f"t{k}_g2"),
                    tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 1]), tf.constant([5, 3])),
                    tf.compat.v1.placeholder(tf.float32, [2], name=f"t{k}_g4"),
                ])
        out = tfreduce.allreduce_grads_flat(grads, devices, pack_bytes=256)
    assert [packed_members(op) for op in packs(graph)] == [["0", "4"], ["0", "4"]]
    assert out[0][1].shape.as_list() == [None]
    assert isinstance(out[1][3], tf.IndexedSlices)
    assert out[1][2].shape == (1000,)


@pytest.mark.parametrize("pack_bytes", [None, 0])
def test_no_packing(pack_bytes):
    graph, _ = build(2, [f32(3), f32(4)], pack_bytes=pack_bytes)
    assert not packs(graph) and not unpacks(graph)


def test_other_ranks_are_flattened_and_restored():
    graph, out = build(2, [f32(2, 3), f32(4), f32()], pack_bytes=1024)
    reshapes = [op for op in graph.get_operations() if op.type == "Reshape"]
    # Per device: (2, 3) and () flattened into the buffer and shaped back.
    assert len(reshapes) == 2 * 4
    assert [t.shape for t in out[1]] == [(2, 3), (4,), ()]


def test_a_single_small_tensor_is_not_concatenated():
    graph, _ = build(2, [f32(3), f32(1000)], pack_bytes=256)
    assert not packs(graph)


def test_packing_cuts_the_reduction_ops():
    # 50 small tensors reduced as one buffer: one add_n instead of 50.
    graph, _ = build(4, [f32(8)] * 50, "flat", pack_bytes=2**20)
    assert len([op for op in graph.get_operations() if op.type == "AddN"]) == 1
    graph, _ = build(4, [f32(8)] * 50, "flat", pack_bytes=None)
    assert len([op for op in graph.get_operations() if op.type == "AddN"]) == 50


def test_every_algorithm_has_the_same_pack_bytes_default():
    builders = [tfreduce.allreduce_grads_flat, tfreduce.allreduce_grads_hierarchical,
                tfreduce.allreduce_grads_ring, tfreduce.allreduce_grads_collective,
                tfreduce.allreduce_grads_nccl]
    defaults = {fn.__name__: inspect.signature(fn).parameters["pack_bytes"].default
                for fn in builders}
    assert len(set(defaults.values())) == 1, defaults


def test_the_recommended_pack_size_is_what_the_benchmark_packs_with():
    from tfreduce import bench
    _, args = bench.parse_args([])
    assert args.pack_bytes == [DEFAULT_PACK_BYTES]
