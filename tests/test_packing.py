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
from tfreduce.analysis.graphwalk import walk_back
from tfreduce.buffers.packing import DEFAULT_PACK_BYTES, hands_out_slices

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
            if op.type == "SplitV" and "_unpack" in op.name and "_tail" not in op.name]


def pieces(op):
    """The gradients one pack concat joins (its inputs but the axis)."""
    return list(op.inputs[:-1])


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
    # bytes: a slice and a split hand out the 192 aligned bytes without a
    # copy; only the 32-byte tail is sliced and split with copies.
    graph, out = build(2, [f32(5), f32(16), f32(3), f32(32)], pack_bytes=1024)
    pack = [op for op in packs(graph) if op.device == GPU_DEVICES[0]][0]
    assert packed_members(pack) == ["3", "1", "2", "0"]
    assert pack.outputs[0].shape == (32 + 16 + 3 + 5,)
    ops = {op.name: op for op in graph.get_operations()}
    name = "allreduce_flat/dev0_unpack0"
    head, free = ops[f"{name}_head"], ops[name]
    tail, cut = ops[f"{name}_tail_slice"], ops[f"{name}_tail"]
    assert free.inputs[0] is head.outputs[0] and cut.inputs[0] is tail.outputs[0]
    assert [t.shape[0] for t in free.outputs] == [32, 16]
    assert [t.shape[0] for t in cut.outputs] == [3, 5]
    assert hands_out_slices(head) and hands_out_slices(free)
    assert not hands_out_slices(tail) and not hands_out_slices(cut)
    assert [t.shape for t in out[1]] == [(5,), (16,), (3,), (32,)]


def test_a_buffer_of_aligned_gradients_is_one_free_split():
    graph, _ = build(2, [f32(16), f32(32)], pack_bytes=1024)
    pack = [op for op in packs(graph) if op.device == GPU_DEVICES[0]][0]
    assert len(pack.inputs) - 1 == 2 and pack.outputs[0].shape == (48,)
    assert not [op for op in graph.get_operations() if "_tail" in op.name or "_head" in op.name]
    assert all(hands_out_slices(op) for op in unpacks(graph))


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
