"""Packing (tensor fusion): which gradients share a buffer, and the ops it builds.

Numeric exactness of packed reductions is covered in test_numeric.py
(pack_bytes=256 for every algorithm); these tests build on "/gpu:k" and only
look at the graph.
"""

import inspect

import pytest
import tensorflow as tf

import tfreduce
from helpers import GPU_DEVICES, placeholders
from tfreduce.graphwalk import walk_back
from tfreduce.packing import DEFAULT_PACK_BYTES, hands_out_slices

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
    """The first split of each buffer (not the split of its unaligned tail)."""
    return [op for op in graph.get_operations()
            if op.type == "SplitV" and "_unpack" in op.name and not op.name.endswith("_tail")]


def pieces(op):
    """The inputs of one pack concat that are gradients (not the padding zeros)."""
    return [t for t in op.inputs[:-1] if "zeros" not in t.op.name]


def packed_members(op):
    """The variable indices packed by one concat (through any reshape), in buffer order."""
    sources = [t.op.inputs[0].op if t.op.type == "Reshape" else t.op for t in pieces(op)]
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
    sizes = sorted(len(pieces(op)) for op in packs(graph))
    assert sizes == [2] * 3 + [4] * 6
    for k in range(3):
        on_k = [op for op in packs(graph) + unpacks(graph) if op.device == GPU_DEVICES[k]]
        assert len(on_k) == 6
        assert all(t.shape == (25,) and t.op.device == GPU_DEVICES[k] for t in out[k])


def test_buffers_fill_in_backward_order_and_close_at_pack_bytes():
    # Backward order: 4 (20 bytes), 3 (100: not smaller than pack_bytes,
    # passed through), 2 and 1 (40 each: 100 in all), then 0 (140 > 100)
    # alone, passed through as a buffer of one.
    graph, _ = build(2, [f32(10), f32(10), f32(10), f32(25), f32(5)], pack_bytes=100)
    members = [packed_members(op) for op in packs(graph) if op.device == GPU_DEVICES[0]]
    assert members == [["4", "2", "1"]]


def test_the_first_buffer_holds_the_last_variables():
    # What the backward pass computes first is reduced first: entry 0 is
    # the last variables' buffer, and its reduction reads none of the others.
    graph, out = build(2, [f32(8)] * 6, "ring", pack_bytes=64)
    first, second, third = [op for op in packs(graph) if op.device == GPU_DEVICES[0]]
    assert [packed_members(op) for op in (first, second, third)] == [
        ["5", "4"], ["3", "2"], ["1", "0"]]
    assert first.name.endswith("pack0")
    placeholders_read = {op.name for op in walk_back([out[0][5].op], set())
                         if op.type == "Placeholder"}
    assert placeholders_read == {"t0_g4", "t0_g5", "t1_g4", "t1_g5"}


def test_aligned_gradients_are_handed_out_as_slices():
    # 64 and 128 bytes (multiples of ALIGN_BYTES) first, then 20 and 12
    # bytes, then 32 bytes of zeros: the buffer's split hands out 64, 128
    # and the 64-byte tail at aligned offsets (no copy), and only the tail
    # is cut by a copying split.
    graph, out = build(2, [f32(5), f32(16), f32(3), f32(32)], pack_bytes=1024)
    pack = [op for op in packs(graph) if op.device == GPU_DEVICES[0]][0]
    assert packed_members(pack) == ["3", "1", "2", "0"]
    assert pack.outputs[0].shape == (16 + 32 + 3 + 5 + 8,)
    free = graph.get_operation_by_name("allreduce_flat/dev0_unpack0")
    tail = graph.get_operation_by_name("allreduce_flat/dev0_unpack0_tail")
    assert [t.shape[0] for t in free.outputs] == [32, 16, 16]
    assert [t.shape[0] for t in tail.outputs] == [3, 5, 8]
    assert tail.inputs[0] is free.outputs[-1]
    assert hands_out_slices(free) and not hands_out_slices(tail)
    assert [t.shape for t in out[1]] == [(5,), (16,), (3,), (32,)]


def test_a_buffer_of_aligned_gradients_needs_no_padding_or_tail():
    graph, _ = build(2, [f32(16), f32(32)], pack_bytes=1024)
    pack = [op for op in packs(graph) if op.device == GPU_DEVICES[0]][0]
    assert len(pack.inputs) - 1 == 2 and pack.outputs[0].shape == (48,)
    assert not [op for op in graph.get_operations() if op.name.endswith("_tail")]
    assert all(hands_out_slices(op) for op in unpacks(graph))


def test_dtypes_are_packed_separately():
    specs = [f32(4), ((4,), tf.float16), f32(4), ((4,), tf.float16), ((2,), tf.float64)]
    graph, out = build(2, specs, pack_bytes=1024)
    dev0 = [op for op in packs(graph) if op.device == GPU_DEVICES[0]]
    assert sorted(op.outputs[0].dtype.name for op in dev0) == ["float16", "float32"]
    assert sorted(packed_members(op) for op in dev0) == [["2", "0"], ["3", "1"]]
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
    assert [packed_members(op) for op in packs(graph)] == [["4", "0"], ["4", "0"]]
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
