"""Graph structure on "/gpu:k" devices, built without running."""

import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import GPU_DEVICES, build_graph

BUILDERS = {
    "flat": tfreduce.allreduce_grads_flat,
    "hierarchical": tfreduce.allreduce_grads_hierarchical,
    "nccl": tfreduce.allreduce_grads_nccl,
    "collective": tfreduce.allreduce_grads_collective,
    "ring": tfreduce.allreduce_grads_ring,
}


def ops_named(graph, suffix):
    return [op for op in graph.get_operations() if op.name.endswith(suffix)]


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("num_towers", [1, 2, 3, 8])
def test_output_k_is_placed_on_device_k(name, num_towers):
    graph, grads, devices = build_graph(num_towers, [(3,), (4, 5), ()])
    with graph.as_default():
        out = BUILDERS[name](grads, devices=devices)
    assert isinstance(out, list) and all(isinstance(row, list) for row in out)
    assert len(out) == num_towers and all(len(row) == 3 for row in out)
    for k, row in enumerate(out):
        for n, t in enumerate(row):
            assert t.op.device == devices[k], (k, n)
            assert t.shape == grads[k][n].shape
            assert t.dtype == tf.float32


def test_hierarchical_k8_group_sums_sit_on_paired_roots():
    # Equal sizes: variable n's roots are devices n % 4 and n % 4 + 4 (the
    # DGX-1 pairing). The root that does not combine sums its group; the
    # combining root adds its own group's 4 gradients and that sum in one
    # AddN (one copy across the groups either way).
    graph, grads, devices = build_graph(8, [(16,)] * 8)
    with graph.as_default():
        tfreduce.allreduce_grads_hierarchical(grads, devices, pack_bytes=None)
    ops = {op.name: op for op in graph.get_operations()}
    for n in range(8):
        roots = [GPU_DEVICES[n % 4], GPU_DEVICES[n % 4 + 4]]
        total = ops[f"allreduce_hierarchical/entry{n}_sum"]
        mine = roots.index(total.device)  # the combiner's group
        other = 1 - mine
        assert f"allreduce_hierarchical/entry{n}_group{mine}_sum" not in ops
        group_sum = ops[f"allreduce_hierarchical/entry{n}_group{other}_sum"]
        assert group_sum.device == roots[other]
        assert group_sum.type == "AddN"
        assert [i.op.device for i in group_sum.inputs] == GPU_DEVICES[4 * other:4 * other + 4]
        assert total.type == "AddN"
        assert [i.op.device for i in total.inputs] == GPU_DEVICES[4 * mine:4 * mine + 4] + [
            roots[other]]
        assert total.inputs[4].op is group_sum
        # The total reaches the other root once; every device's output
        # reads its own group's root.
        for k in range(8):
            out = ops[f"allreduce_hierarchical/entry{n}_dev{k}_out"]
            src = out.inputs[0].op.device
            assert src == roots[0 if k < 4 else 1]


def test_hierarchical_combining_root_alternates_between_groups():
    graph, grads, devices = build_graph(8, [(16,)] * 8)
    with graph.as_default():
        tfreduce.allreduce_grads_hierarchical(grads, devices, pack_bytes=None)
    combiners = [graph.get_operation_by_name(f"allreduce_hierarchical/entry{n}_sum").device
                 for n in range(8)]
    assert combiners == GPU_DEVICES[:4] + GPU_DEVICES[4:]


def test_hierarchical_average_divides_once_per_variable():
    graph, grads, devices = build_graph(8, [(16,)] * 5)
    with graph.as_default():
        tfreduce.allreduce_grads_hierarchical(grads, devices, average=True, pack_bytes=None)
    scales = [op for op in graph.get_operations() if op.type == "Mul"]
    assert len(scales) == 5


def test_flat_average_divides_once_per_variable():
    graph, grads, devices = build_graph(4, [(16,)] * 6)
    with graph.as_default():
        tfreduce.allreduce_grads_flat(grads, devices, average=True, pack_bytes=None)
    assert len([op for op in graph.get_operations() if op.type == "Mul"]) == 6


def test_flat_roots_balance_bytes_not_count():
    # One big tensor and six small ones on 2 devices: round-robin by count
    # would put 4 tensors (big included) on device 0; by bytes the big one
    # has device 0 to itself and the small ones all go to device 1.
    shapes = [(4,)] * 3 + [(1000,)] + [(4,)] * 3
    graph, grads, devices = build_graph(2, shapes)
    with graph.as_default():
        tfreduce.allreduce_grads_flat(grads, devices, pack_bytes=None)
    roots = [graph.get_operation_by_name(f"allreduce_flat/entry{n}_sum").device
             for n in range(7)]
    assert roots[3] == GPU_DEVICES[0]
    assert [r for n, r in enumerate(roots) if n != 3] == [GPU_DEVICES[1]] * 6


def test_flat_equal_sizes_rotate_roots_like_tensorpack():
    graph, grads, devices = build_graph(4, [(8,)] * 8)
    with graph.as_default():
        tfreduce.allreduce_grads_flat(grads, devices, pack_bytes=None)
    roots = [graph.get_operation_by_name(f"allreduce_flat/entry{n}_sum").device
             for n in range(8)]
    assert roots == [GPU_DEVICES[n % 4] for n in range(8)]


def test_hierarchical_uneven_groups_roots_in_each_group():
    groups = [[0, 1, 2], [3, 4], [5]]
    graph, grads, devices = build_graph(6, [(8,)] * 3)
    with graph.as_default():
        tfreduce.allreduce_grads_hierarchical(grads, devices, groups=groups, pack_bytes=None)
    ops = {op.name: op for op in graph.get_operations()}
    for n in range(3):
        # Every group's root sums its group; the combining root's sum adds
        # its group's tensors and the other roots' sums.
        total = ops[f"allreduce_hierarchical/entry{n}_sum"]
        reads = sorted(i.op.device for i in total.inputs)
        for gi, group in enumerate(groups):
            root = GPU_DEVICES[group[n % len(group)]]
            op = ops.get(f"allreduce_hierarchical/entry{n}_group{gi}_sum")
            if op is None:
                assert total.device == root
                members = [GPU_DEVICES[i] for i in group]
                assert sorted(members + [GPU_DEVICES[g[n % len(g)]] for g in groups
                                         if g is not group]) == reads
            else:
                assert op.device == root and op.outputs[0] in list(total.inputs)
                assert sorted(i.op.device for i in op.inputs) == sorted(
                    GPU_DEVICES[i] for i in group)


def test_default_groups():
    assert tfreduce.default_groups(8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert tfreduce.default_groups(6) == [[0, 1, 2], [3, 4, 5]]
    assert tfreduce.default_groups(3) == [[0, 1], [2]]
    assert tfreduce.default_groups(1) == [[0]]


def test_nccl_builds_one_allreduce_per_device_and_variable():
    graph, grads, devices = build_graph(4, [(3,), (5,)])
    with graph.as_default():
        tfreduce.allreduce_grads_nccl(grads, devices=devices, pack_bytes=None)
    nccl = [op for op in graph.get_operations() if op.type == "NcclAllReduce"]
    assert len(nccl) == 8
    assert sorted(op.device for op in nccl) == sorted(GPU_DEVICES[:4] * 2)
    assert {op.get_attr("reduction") for op in nccl} == {b"sum"}


def test_collective_ops_share_keys_and_are_chained_per_device():
    graph, grads, devices = build_graph(3, [(3,), (5,), (7,)])
    keys = tfreduce.CollectiveKeys(first_instance_key=100)
    with graph.as_default():
        tfreduce.allreduce_grads_collective(grads, devices, keys=keys, communication="ring",
                                            pack_bytes=None)
    ops = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    assert len(ops) == 9
    for n in range(3):
        group = [graph.get_operation_by_name(f"allreduce_collective/entry{n}_dev{k}_allreduce")
                 for k in range(3)]
        assert [op.device for op in group] == devices
        instance = {int(tf.get_static_value(op.inputs[3])) for op in group}
        assert instance == {100 + n}
        assert {op.get_attr("communication_hint") for op in group} == {b"ring"}
        if n:
            for k, op in enumerate(group):
                # Reduction n on device k waits for reduction n-1 on device k.
                prev = f"allreduce_collective/entry{n - 1}_dev{k}_allreduce"
                deps = set()
                for dep in op.control_inputs:
                    deps.add(dep.name)
                for inp in op.inputs:
                    deps.update(c.name for c in inp.op.control_inputs)
                assert prev in deps, (n, k)
    assert keys.instance_key() == 103


def test_packing_concatenates_same_dtype_and_passes_others_through():
    shapes = [(2, 3), (4,), (), (100,)]
    graph, grads, devices = build_graph(2, shapes)
    with graph.as_default():
        sparse = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 1]), tf.constant([5, 3]))
        with tf.device(devices[0]):
            f64 = tf.zeros([3], tf.float64)
        with tf.device(devices[1]):
            f64_b = tf.zeros([3], tf.float64)
        grads[0] += [sparse, f64]
        grads[1] += [sparse, f64_b]
        out = tfreduce.allreduce_grads_flat(grads, devices, pack_bytes=64)
    packs = [op for op in graph.get_operations() if op.type == "ConcatV2"
             and "_pack" in op.name]
    # The three small float32 tensors (6 + 4 + 1 floats = 44 bytes) share one
    # buffer per tower; (100,) is larger than 64 bytes, float64 is alone in
    # its dtype, and IndexedSlices are gathered, not packed.
    assert len(packs) == 2
    assert all(len(op.inputs) == 4 for op in packs)  # 3 tensors + axis
    assert [op.device for op in packs] == devices
    assert isinstance(out[0][4], tf.IndexedSlices)
    for k in range(2):
        assert [t.shape for t in out[k][:4]] == [tuple(s) for s in shapes]
        assert out[k][5].dtype == tf.float64


def test_none_on_every_tower_stays_none():
    graph, grads, devices = build_graph(3, [(2,), (3,)])
    with graph.as_default():
        for row in grads:
            row.insert(1, None)
        out = tfreduce.allreduce_grads(grads, devices, algorithm="hierarchical")
    assert [row[1] for row in out] == [None, None, None]
    assert all(row[0] is not None and row[2] is not None for row in out)


def test_one_name_scope_per_call():
    graph, grads, devices = build_graph(2, [(2,)])
    with graph.as_default():
        tfreduce.allreduce_grads_flat(grads, devices)
        tfreduce.allreduce_grads_flat(grads, devices)
    scopes = {op.name.split("/")[0] for op in graph.get_operations()
              if op.type != "Placeholder"}
    assert scopes == {"allreduce_flat", "allreduce_flat_1"}


def test_importing_tfreduce_leaves_tensorflow_unchanged():
    # The package must not touch devices, eager mode or TF symbols on import.
    import importlib
    before = (tf.executing_eagerly(), tf.add_n, tf.config.list_logical_devices())
    importlib.reload(tfreduce)
    after = (tf.executing_eagerly(), tf.add_n, tf.config.list_logical_devices())
    assert before == after


def test_split_and_merge_grad_list_round_trip():
    pairs = [[(np.float32(k), f"v{n}") for n in range(3)] for k in range(2)]
    grads, variables = tfreduce.split_grad_list(pairs)
    assert grads == [[0.0] * 3, [1.0] * 3]
    assert variables == [["v0", "v1", "v2"]] * 2
    assert tfreduce.merge_grad_list(grads, variables) == pairs


def test_import_is_lazy_and_exports_resolve():
    # `python -m tfreduce.launch` must start workers without importing TF.
    import subprocess
    import sys
    code = ("import sys, tfreduce; assert 'tensorflow' not in sys.modules; "
            "import tfreduce.launch; assert 'tensorflow' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    for name in tfreduce.__all__:
        assert getattr(tfreduce, name) is not None
    with pytest.raises(AttributeError, match="module 'tfreduce' has no attribute 'nope'"):
        tfreduce.nope
