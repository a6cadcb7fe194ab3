"""The collectives besides all-reduce: exact per-device values against NumPy, placement, errors."""

import re

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings, strategies as st

import tfreduce
from tfreduce.doors import collectives
from tfreduce.choice.collective_build import BUILDERS, collective_stage
from tfreduce.basis.collective_rules import COLLECTIVE_RULES, CollectiveRule
from helpers import CPU_DEVICES, GPU_DEVICES, RUNNERS, covering, placeholders, run_in_function

ALGORITHMS = ["flat", "hierarchical", "ring", "collective"]
DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int32, np.int64]
FLOATS = DTYPES[:4]
HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
# Runs, as "<runner>-K<k>": every K in a tf.function (3 and 8 in the full
# suite only), K = 1 and 4 in a TF1-style graph too. The grids below cover
# every pair of their settings (every algorithm in every run), not their
# whole product.
RUNS = [f"function-K{k}" for k in (1, 2, 3, 4, 8)] + [f"session-K{k}" for k in (1, 4)]
SLOW_RUNS = ("function-K3", "function-K8")
SLOW_GATHERS = ("all_gather", "all_to_all")


def runner_and_towers(mode):
    """"function-K4" -> (run_in_function, 4)."""
    runner, towers = mode.split("-K")
    return RUNNERS[runner], int(towers)


def values(rng, shape, dtype):
    # Multiples of 1/4 in [-16, 16]: sums over 8 towers are exact in every dtype.
    scale = 1 if np.dtype(dtype).kind == "i" else 4.0
    return np.asarray(rng.integers(-64, 65, size=shape) / scale).astype(dtype)


def same_shapes(num_towers, dtypes, seed):
    """K x N arrays of one shape per n: rows 0, 1, fewer than K, more than K."""
    rng = np.random.default_rng(seed)
    shapes = [(0, 3), (1,), (2, 2), (2 * num_towers + 1, 3), (5, 1, 2)]
    specs = [(s, d) for d in dtypes for s in shapes]
    return [[values(rng, s, d) for s, d in specs] for _ in range(num_towers)]


def uneven_rows(num_towers, dtypes, seed):
    """K x N arrays whose row counts differ by tower (0 included), trailing axes agree."""
    rng = np.random.default_rng(seed)
    trailing = [(3,), (), (2, 2)]
    out = [[] for _ in range(num_towers)]
    for d in dtypes:
        for i, rest in enumerate(trailing):
            for k in range(num_towers):
                out[k].append(values(rng, ((k * 3 + i) % 5,) + rest, d))
    return out


def summed(column, average):
    # The NumPy reference of a sum (float32 for half types) or a mean (x 1/K).
    dtype = column[0].dtype
    acc = np.dtype(np.float32) if dtype in HALF else dtype
    total = np.sum([c.astype(acc) for c in column], axis=0, dtype=acc)
    if average:
        total = total * acc.type(1.0 / len(column))
    return np.asarray(total).astype(dtype)


def expected(collective, arrays, groups, root=0, average=False, splits=None):
    """K x N NumPy results (for reduce: one list per group), the collective run per group."""
    num_towers = len(arrays)
    out = [[None] * len(arrays[0]) for _ in range(num_towers)]
    reduced = []
    for g in groups:
        for n in range(len(arrays[0])):
            column = [arrays[i][n] for i in g]
            if collective == "reduce_scatter":
                for i, shard in zip(g, np.array_split(summed(column, average), len(g))):
                    out[i][n] = shard
            elif collective == "all_gather":
                for i in g:
                    out[i][n] = np.concatenate(column)
            elif collective == "broadcast":
                for i in g:
                    out[i][n] = column[root]
            elif collective == "all_to_all":
                pieces = [np.split(c, np.cumsum(splits[j])[:-1]) if splits else
                          np.array_split(c, len(g)) for j, c in zip(g, column)]
                for p, i in enumerate(g):
                    out[i][n] = np.concatenate([piece[p] for piece in pieces])
        if collective == "reduce":
            reduced.append([summed([arrays[i][n] for i in g], average)
                            for n in range(len(arrays[0]))])
    return reduced if collective == "reduce" else out


def call(collective, tensors, devices, algorithm, groups=None, root=0, average=False,
         splits=None):
    kwargs = {"algorithm": algorithm, "groups": groups}
    if collective in ("reduce_scatter", "reduce"):
        kwargs["average"] = average
    if collective in ("broadcast", "reduce"):
        kwargs["root"] = root
    if collective == "all_to_all":
        kwargs["splits"] = splits
    out = getattr(tfreduce, collective)(tensors, devices, **kwargs)
    if collective == "reduce":
        return [out] if groups is None else out
    return out


def check(got, got_devices, want, placed_on):
    for k, row in enumerate(want):
        for n, w in enumerate(row):
            assert got[k][n].dtype == w.dtype, (k, n, got[k][n].dtype, w.dtype)
            assert got[k][n].shape == w.shape, (k, n, got[k][n].shape, w.shape)
            np.testing.assert_array_equal(got[k][n], w, err_msg=f"row {k} tensor {n}")
            assert got_devices[k][n].endswith(placed_on[k]), (k, n, got_devices[k][n])


def run(runner, collective, arrays, devices, algorithm, groups=None, root=0, average=False,
        splits=None):
    def build(tensors):
        return call(collective, tensors, devices, algorithm, groups, root, average, splits)
    return runner(build, arrays, devices)


def placement(collective, devices, groups, root):
    if collective != "reduce":
        return [d.replace("/device", "") for d in devices]
    groups = groups or [list(range(len(devices)))]
    return [devices[g[root]].replace("/device", "") for g in groups]


@covering(algorithm=ALGORITHMS, mode=RUNS, collective=["reduce_scatter", "reduce"],
          average=[False, True], slow=lambda case: case["mode"] in SLOW_RUNS)
def test_sums_equal_numpy_on_every_device(algorithm, mode, collective, average):
    runner, num_towers = runner_and_towers(mode)
    devices = CPU_DEVICES[:num_towers]
    arrays = same_shapes(num_towers, FLOATS if average else DTYPES, seed=num_towers)
    root = num_towers - 1
    got, got_devices = run(runner, collective, arrays, devices, algorithm, root=root,
                           average=average)
    want = expected(collective, arrays, [list(range(num_towers))], root, average)
    check(got, got_devices, want, placement(collective, devices, None, root))


@covering(algorithm=ALGORITHMS, mode=RUNS, collective=["all_gather", "broadcast", "all_to_all"],
          slow=lambda case: case["mode"] in SLOW_RUNS or (
              case["algorithm"] == "collective" and case["collective"] in SLOW_GATHERS))
def test_data_movement_equals_numpy_on_every_device(algorithm, mode, collective):
    runner, num_towers = runner_and_towers(mode)
    devices = CPU_DEVICES[:num_towers]
    arrays = uneven_rows(num_towers, DTYPES, seed=num_towers)
    root = num_towers // 2
    if collective == "broadcast":
        arrays = [row if k == root else [None] * len(row) for k, row in enumerate(arrays)]
    got, got_devices = run(runner, collective, arrays, devices, algorithm, root=root)
    if collective == "broadcast":
        arrays = [arrays[root]] * num_towers
    want = expected(collective, arrays, [list(range(num_towers))], root)
    check(got, got_devices, want, placement(collective, devices, None, root))


GROUPS = [
    [[0, 2], [1]],                       # K=3, unequal sizes
    [[3, 0], [1, 2]],                    # K=4, out of order
    [[0], [1, 2, 3]],                    # a group of one (full suite)
    [[0, 1, 2, 3], [4, 5], [6], [7]],    # K=8 (full suite)
]


@covering(algorithm=ALGORITHMS, groups=GROUPS,
          collective=["reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"],
          slow=lambda case: case["groups"] in GROUPS[2:])
def test_groups_run_their_own_collective(algorithm, groups, collective):
    runner = run_in_function  # the TF1-style graph: in the grids above
    num_towers = sum(map(len, groups))
    devices = CPU_DEVICES[:num_towers]
    if collective in ("reduce_scatter", "reduce"):
        arrays = same_shapes(num_towers, [np.float32, np.int64], seed=7)
    else:
        arrays = uneven_rows(num_towers, [np.float64, np.int32], seed=7)
    got, got_devices = run(runner, collective, arrays, devices, algorithm, groups=groups)
    want = expected(collective, arrays, groups)
    check(got, got_devices, want, placement(collective, devices, groups, 0))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_to_all_with_uneven_splits(runner, algorithm):
    rng = np.random.default_rng(3)
    splits = [[0, 2, 1], [3, 0, 0], [1, 1, 1]]
    arrays = [[values(rng, (sum(s), 2), np.float32), values(rng, (sum(s),), np.int64)]
              for s in splits]
    got, got_devices = run(runner, "all_to_all", arrays, CPU_DEVICES[:3], algorithm,
                           splits=splits)
    check(got, got_devices, expected("all_to_all", arrays, [[0, 1, 2]], splits=splits),
          [d.replace("/device", "") for d in CPU_DEVICES[:3]])


def test_numpy_integers_are_groups_roots_and_splits_like_ints():
    # np.array_split sizes and argmax give NumPy integers: once, splits,
    # root and groups refused them as "not ints".
    rng = np.random.default_rng(4)
    splits = [list(np.array([0, 2, 1])), list(np.array([3, 0, 0])), list(np.array([1, 1, 1]))]
    arrays = [[values(rng, (sum(s), 2), np.float32)] for s in splits]
    got, got_devices = run(run_in_function, "all_to_all", arrays, CPU_DEVICES[:3], "flat",
                           splits=splits)
    check(got, got_devices, expected("all_to_all", arrays, [[0, 1, 2]],
                                     splits=[[int(c) for c in s] for s in splits]),
          [d.replace("/device", "") for d in CPU_DEVICES[:3]])
    arrays = [[values(rng, (3, 2), np.float32)] for _ in range(4)]
    groups = [list(np.arange(2)), list(np.arange(2, 4))]
    got, got_devices = run(run_in_function, "reduce", arrays, CPU_DEVICES[:4], "ring",
                           groups=groups, root=np.int64(1))
    check(got, got_devices, expected("reduce", arrays, [[0, 1], [2, 3]], root=1),
          ["CPU:1", "CPU:3"])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_gather_of_reduce_scatter_is_the_all_reduce(algorithm):
    devices = CPU_DEVICES[:3]
    rng = np.random.default_rng(5)
    arrays = [[values(rng, (7, 2), np.float32), values(rng, (2,), np.float64)]
              for _ in devices]
    tensors = [[tf.constant(a) for a in row] for row in arrays]
    scattered = tfreduce.reduce_scatter(tensors, devices, average=True, algorithm=algorithm)
    gathered = tfreduce.all_gather(scattered, devices, algorithm=algorithm)
    reduced = tfreduce.allreduce_grads(tensors, devices, average=True, algorithm=algorithm)
    for k in range(3):
        for n in range(2):
            np.testing.assert_array_equal(gathered[k][n].numpy(), reduced[k][n].numpy())


# The collective algorithm's eager all-gather and all-to-all take 2 s each.
@pytest.mark.parametrize("algorithm, collective", [
    pytest.param(a, c, marks=[pytest.mark.slow] * (a == "collective" and c in SLOW_GATHERS))
    for a in ALGORITHMS
    for c in ["reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"]])
def test_eagerly_outputs_are_on_their_devices(algorithm, collective):
    devices = CPU_DEVICES[:3]
    arrays = (same_shapes if collective in ("reduce_scatter", "reduce") else uneven_rows)(
        3, [np.float32, ml_dtypes.bfloat16, np.int32], seed=11)
    tensors = []
    for row, d in zip(arrays, devices):
        with tf.device(d):
            tensors.append([tf.constant(a) for a in row])
    out = call(collective, tensors, None, algorithm, root=1)
    want = expected(collective, arrays, [[0, 1, 2]], root=1)
    places = placement(collective, devices, None, 1)
    for k, row in enumerate(want):
        for n, w in enumerate(row):
            np.testing.assert_array_equal(out[k][n].numpy(), w)
            assert out[k][n].device.endswith(places[k]), (k, n, out[k][n].device)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_gather_of_indexed_slices_gathers_rows(runner, algorithm):
    devices = CPU_DEVICES[:3]
    rng = np.random.default_rng(2)
    dense_rows = [4, 0, 3]
    slices = [(values(rng, (2, 3), np.float32), np.array([r - 1, 0]) if r else
               np.zeros([0], np.int64)) for r in dense_rows]
    slices[1] = (np.zeros((0, 3), np.float32), np.zeros([0], np.int64))

    def build(_):
        tensors = []
        for (v, i), rows, d in zip(slices, dense_rows, devices):
            with tf.device(d):
                tensors.append([tf.IndexedSlices(tf.constant(v), tf.constant(i, tf.int64),
                                                 tf.constant([rows, 3], tf.int64))])
        return tfreduce.all_gather(tensors, devices, algorithm=algorithm)

    got, _ = runner(build, [[np.zeros(1)] for _ in devices], devices)
    dense = []
    for (v, i), rows in zip(slices, dense_rows):
        block = np.zeros((rows, 3), np.float32)
        np.add.at(block, i, v)
        dense.append(block)
    for k in range(3):
        assert isinstance(got[k][0].dense(), np.ndarray)
        np.testing.assert_array_equal(got[k][0].dense(), np.concatenate(dense))


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_property_any_groups_and_rows(data):
    num_towers = data.draw(st.integers(1, 5), label="K")
    order = data.draw(st.permutations(range(num_towers)), label="order")
    cuts = sorted(data.draw(st.sets(st.integers(1, num_towers - 1), max_size=3), label="cuts")
                  ) if num_towers > 1 else []
    groups = [list(order[a:b]) for a, b in zip([0] + cuts, cuts + [num_towers])]
    collective = data.draw(st.sampled_from(["reduce_scatter", "all_gather", "broadcast",
                                            "reduce", "all_to_all"]), label="collective")
    algorithm = data.draw(st.sampled_from(["flat", "hierarchical", "ring"]), label="algorithm")
    rows = data.draw(st.lists(st.integers(0, 6), min_size=num_towers, max_size=num_towers))
    if collective in ("reduce_scatter", "reduce", "broadcast"):
        rows = [rows[0]] * num_towers
    rng = np.random.default_rng(num_towers)
    arrays = [[values(rng, (r, 2), np.float32)] for r in rows]
    devices = CPU_DEVICES[:num_towers]
    tensors = [[tf.constant(a) for a in row] for row in arrays]
    out = call(collective, tensors, devices, algorithm, groups=groups)
    want = expected(collective, arrays, groups)
    for k, row in enumerate(want):
        np.testing.assert_array_equal(out[k][0].numpy(), row[0])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_none_on_every_tower_stays_none(algorithm):
    devices = CPU_DEVICES[:2]
    x = [[None, tf.constant([1.0, 2.0]), None], [None, tf.constant([3.0, 4.0]), None]]
    out = tfreduce.reduce_scatter(x, devices, algorithm=algorithm)
    assert [out[k][n] is None for k in range(2) for n in (0, 2)] == [True] * 4
    np.testing.assert_array_equal(out[1][1].numpy(), [6.0])
    total = tfreduce.reduce(x, devices, root=1, algorithm=algorithm)
    assert len(total) == 3 and total[0] is None and total[2] is None
    np.testing.assert_array_equal(total[1].numpy(), [4.0, 6.0])
    gathered = tfreduce.all_gather(x, devices, algorithm=algorithm)
    assert gathered[0][0] is None and gathered[1][2] is None


def test_the_reductions_own_groups_are_positions_inside_each_collective_group():
    devices = CPU_DEVICES[:4]
    x = [[tf.constant([float(k)] * 4)] for k in range(4)]
    by_position = tfreduce.Reduction("hierarchical", groups=[[0], [1]])
    out = tfreduce.all_gather(x, devices, groups=[[0, 1], [2, 3]], reduction=by_position)
    np.testing.assert_array_equal(out[3][0].numpy(), [2.0] * 4 + [3.0] * 4)
    with pytest.raises(ValueError, match=r"with groups=\[\[0, 1\], \[2, 3\]\] each collective "
                                         r"group has its own towers: the Reduction's groups= "
                                         r"arrange one group's towers by position \(0..1 for "
                                         r"\[0, 1\]\)"):
        tfreduce.all_gather(x, devices, groups=[[0, 1], [2, 3]],
                            reduction=tfreduce.Reduction("hierarchical",
                                                         groups=[[0, 1], [2, 3]]))


# -- structure: built on GPU names, nothing runs -----------------------------

def build_on_gpus(collective, algorithm, num_towers=4, shape=(8, 2)):
    graph = tf.Graph()
    with graph.as_default():
        devices = GPU_DEVICES[:num_towers]
        tensors = placeholders(devices, [shape])
        out = call(collective, tensors, devices, algorithm, root=1)
    return graph, tensors, out


def test_ring_reduce_scatter_sends_each_device_k_minus_1_over_k_to_its_successor():
    _, tensors, out = build_on_gpus("reduce_scatter", "ring")
    traffic = tfreduce.analyze_traffic(out, inputs=tensors)
    size = 8 * 2 * 4
    assert traffic.pair_bytes == {(GPU_DEVICES[k], GPU_DEVICES[(k + 1) % 4]): 3 * size // 4
                                  for k in range(4)}
    for k in range(4):
        assert out[k][0].device == GPU_DEVICES[k]


def test_ring_all_gather_moves_the_same_bytes_as_the_reduce_scatter():
    _, tensors, out = build_on_gpus("all_gather", "ring", shape=(2, 2))
    traffic = tfreduce.analyze_traffic(out, inputs=tensors)
    assert traffic.pair_bytes == {(GPU_DEVICES[k], GPU_DEVICES[(k + 1) % 4]): 3 * 16
                                  for k in range(4)}


def test_flat_broadcast_sends_the_root_tensor_once_to_each_device():
    _, tensors, out = build_on_gpus("broadcast", "flat")
    traffic = tfreduce.analyze_traffic(out, inputs=tensors)
    assert traffic.pair_bytes == {(GPU_DEVICES[1], GPU_DEVICES[k]): 64 for k in (0, 2, 3)}


@pytest.mark.parametrize("collective", ["broadcast", "reduce"])
def test_ring_broadcast_and_reduce_send_s_along_the_ring(collective):
    # root 1: a broadcast runs 1 -> 2 -> 3 -> 0, a reduce 2 -> 3 -> 0 -> 1.
    _, tensors, out = build_on_gpus(collective, "ring")
    traffic = tfreduce.analyze_traffic(out, inputs=tensors)
    first = 1 if collective == "broadcast" else 2
    hops = [((first + i) % 4, (first + i + 1) % 4) for i in range(3)]
    assert traffic.pair_bytes == {(GPU_DEVICES[a], GPU_DEVICES[b]): 64 for a, b in hops}


def test_hierarchical_reduce_crosses_between_groups_once():
    graph = tf.Graph()
    with graph.as_default():
        devices = GPU_DEVICES[:8]
        tensors = placeholders(devices, [(4,)])
        out = tfreduce.reduce(tensors, devices, root=0, algorithm="hierarchical")
    traffic = tfreduce.analyze_traffic(out, inputs=tensors)
    crossing = {pair: b for pair, b in traffic.pair_bytes.items()
                if (pair[0] in devices[:4]) != (pair[1] in devices[:4])}
    assert len(crossing) == 1 and list(crossing.values()) == [16]
    assert out[0].device == GPU_DEVICES[0]


def test_nccl_builds_broadcast_and_reduce_on_gpus():
    graph, _, out = build_on_gpus("broadcast", "nccl")
    assert "NcclBroadcast" in {op.type for op in graph.get_operations()}
    assert [row[0].device for row in out] == GPU_DEVICES[:4]
    graph, _, out = build_on_gpus("reduce", "nccl")
    assert "NcclReduce" in {op.type for op in graph.get_operations()}
    assert out[0][0].device == GPU_DEVICES[1]


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather", "all_to_all"])
def test_nccl_refuses_what_tf_has_no_op_for(collective):
    with pytest.raises(ValueError, match=rf"algorithm 'nccl' does not build {collective} .*"
                                         r"use algorithm= one of \['flat', 'hierarchical', "
                                         r"'ring', 'collective'\]"):
        build_on_gpus(collective, "nccl")


def test_auto_is_ring_on_gpus_where_nccl_has_no_op_and_flat_on_cpus():
    graph, _, _ = build_on_gpus("all_gather", "auto")
    assert any("all_gather_ring" in op.name for op in graph.get_operations())
    graph, _, _ = build_on_gpus("broadcast", "auto")
    assert any("broadcast_nccl" in op.name for op in graph.get_operations())
    graph = tf.Graph()
    with graph.as_default():
        tensors = placeholders(CPU_DEVICES[:2], [(3,)])
        tfreduce.reduce_scatter(tensors, CPU_DEVICES[:2])
    assert any("reduce_scatter_flat" in op.name for op in graph.get_operations())


@pytest.mark.parametrize("collective", ["reduce_scatter", *[
    pytest.param(c, marks=pytest.mark.slow) for c in SLOW_GATHERS], "broadcast", "reduce"])
@pytest.mark.parametrize("preset", ["dgx1-v100", "dgx-a100"])
def test_auto_with_a_topology_takes_the_fastest_predicted(collective, preset):
    size = 8 * 2**20
    predicted = {}
    for algorithm in ("flat", "hierarchical", "ring", "collective", "nccl"):
        try:
            _, tensors, out = build_on_gpus(collective, algorithm, 8, (size // 4 // 256, 256))
        except ValueError:
            continue  # NCCL has no such op
        predicted[algorithm] = tfreduce.predict(out, preset, inputs=tensors).seconds
    # The plan is made for this call's shapes.
    graph = tf.Graph()
    with graph.as_default():
        tensors = placeholders(GPU_DEVICES[:8], [(size // 4 // 256, 256)])
        reduction = tfreduce.Reduction(topology=preset)
        kwargs = {"root": 1} if collective in ("broadcast", "reduce") else {}
        getattr(tfreduce, collective)(tensors, GPU_DEVICES[:8], reduction=reduction, **kwargs)
    best = min(predicted, key=predicted.get)
    scopes = {op.name.split("/")[0] for op in graph.get_operations()}
    assert f"{collective}_{best}" in scopes, (predicted, scopes)


def test_a_planned_collective_gives_the_numpy_values():
    devices = CPU_DEVICES[:4]
    arrays = uneven_rows(4, [np.float32], seed=1)
    tensors = [[tf.constant(a) for a in row] for row in arrays]
    out = tfreduce.all_gather(tensors, devices, topology="dgx1-v100")
    want = expected("all_gather", arrays, [[0, 1, 2, 3]])
    for k in range(4):
        for n, w in enumerate(want[k]):
            np.testing.assert_array_equal(out[k][n].numpy(), w)


# -- errors -------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("average", [False, True])
def test_compressed_sums_equal_the_compressed_all_reduces_shard(algorithm, average):
    # A mean above 65504 on one tower still fits once prescaled by 1/K.
    rng = np.random.default_rng(5)
    arrays = [[rng.normal(size=[7, 3]).astype(np.float32) * (7e4 if k == 2 else 1.0)]
              for k in range(4)]
    devices = CPU_DEVICES[:4]
    reduction = tfreduce.Reduction(algorithm, compression="fp16")

    def build(grads):
        return (tfreduce.reduce_scatter(grads, devices, average, reduction=reduction)
                + reduction(grads, devices, average)
                + [tfreduce.reduce(grads, devices, 1, average, reduction=reduction)])

    out, placed = run_in_function(build, arrays, devices)
    shards, full, reduced = out[:4], out[4:8], out[8]
    rows = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 7)]
    want = [[full[k][0][rows[k]]] for k in range(4)]
    if algorithm == "ring":
        # The all-reduce's ring starts each chunk's hops elsewhere: its
        # 16-bit partial sums round in another order.
        for k in range(4):
            np.testing.assert_allclose(shards[k][0], want[k][0], rtol=2 ** -10)
        want = shards
    check(shards, placed[:4], want, devices)
    assert shards[0][0].dtype == np.float32 and np.isfinite(shards[2][0]).all() == average
    if algorithm == "ring":
        np.testing.assert_allclose(reduced[0], full[1][0], rtol=2 ** -10)
    else:
        np.testing.assert_array_equal(reduced[0], full[1][0])
    assert placed[8][0].endswith(devices[1])


def test_a_compressed_ring_reduce_scatter_sends_16_bits():
    sent = {}
    for compression in ("none", "bf16"):
        with tf.Graph().as_default():
            tensors = placeholders(GPU_DEVICES[:4], [(8, 2)])
            out = tfreduce.reduce_scatter(tensors, GPU_DEVICES[:4], True, "ring",
                                          compression=compression)
            sent[compression] = tfreduce.analyze_traffic(out, inputs=tensors).pair_bytes
    assert sent["bf16"] == {pair: size // 2 for pair, size in sent["none"].items()}


def consts(*shapes, dtype=tf.float32):
    return [[tf.zeros(s, dtype)] for s in shapes]


@pytest.mark.parametrize("call_, message", [
    (lambda: tfreduce.all_gather(consts([2, 3], [2, 4]), CPU_DEVICES[:2]),
     r"all_gather: tensor 0: tower 1 has shape \(2, 4\), tower 0 has \(2, 3\); all_gather "
     r"joins rows along axis 0, so the other axes must agree"),
    (lambda: tfreduce.reduce_scatter(consts([], []), CPU_DEVICES[:2]),
     r"reduce_scatter: tensor 0 on tower 0 is a scalar \(shape \[\]\): reduce_scatter works "
     r"along axis 0; reshape it to \[1\]"),
    (lambda: tfreduce.reduce_scatter(consts([3], [4]), CPU_DEVICES[:2]),
     r"reduce_scatter: tensor 0: tower 1 has shape \(4,\), tower 0 has \(3,\); reduce_scatter "
     r"needs one shape on every tower"),
    (lambda: tfreduce.all_to_all(consts([3], [2]), CPU_DEVICES[:2], splits=[[1, 1], [1, 1]]),
     r"all_to_all: splits\[0\] = \[1, 1\] add up to 2, but tensor 0 on tower 0 has 3 rows"),
    (lambda: tfreduce.all_to_all(consts([3], [2]), CPU_DEVICES[:2], splits=[[3], [1, 1]]),
     r"all_to_all: splits\[0\] must be 2 ints >= 0 \(the rows tower 0 sends to each tower of "
     r"its group\), got \[3\]"),
    (lambda: tfreduce.broadcast(consts([3], [3], [3]), CPU_DEVICES[:3], root=2,
                                groups=[[0, 1], [2]]),
     r"broadcast: root must be an int position in 0..0 inside every group \(group 1, \[2\], "
     r"has 1 towers\), got 2"),
    (lambda: tfreduce.reduce(consts([3], [3]), CPU_DEVICES[:2], root=2),
     r"reduce: root must be an int position in 0..1 inside the 2 towers, got 2"),
    (lambda: tfreduce.all_gather(consts([3], [3], [3]), CPU_DEVICES[:3], groups=[[0, 1], [1]]),
     r"all_gather: device index 1 is in groups\[0\] and groups\[1\]"),
    (lambda: tfreduce.all_gather(consts([3], [3], [3]), CPU_DEVICES[:3], groups=[[0, 1]]),
     r"all_gather: groups \[\[0, 1\]\] leave device indices \[2\] out"),
    (lambda: tfreduce.reduce_scatter([[tf.zeros([2])], [tf.zeros([2], tf.float64)]],
                                     CPU_DEVICES[:2]),
     r"reduce_scatter: tensor 0: tower 1 has dtype float64, tower 0 has float32"),
    (lambda: tfreduce.all_gather([[tf.zeros([2])], [None]], CPU_DEVICES[:2]),
     r"all_gather: tensor 0 is None on towers \[1\] but not on the others"),
    (lambda: tfreduce.all_gather([[tf.zeros([2])], []], CPU_DEVICES[:2]),
     r"all_gather: tower 1 has 0 tensors, tower 0 has 1"),
    (lambda: tfreduce.all_gather(tf.zeros([2]), CPU_DEVICES[:2]),
     r"all_gather: all_tensors must be a non-empty list of K lists of N tensors"),
    (lambda: tfreduce.all_gather([[np.zeros(2)], [np.zeros(2)]], CPU_DEVICES[:2]),
     r"tower 0, tensor 0: a tensor must be a tf.Tensor, tf.IndexedSlices or None, got "
     r"ndarray"),
    (lambda: tfreduce.reduce([[tf.constant([True])], [tf.constant([False])]], CPU_DEVICES[:2]),
     r"reduce: tensor 0 has dtype bool; reduce sums floating-point and integer tensors"),
    (lambda: tfreduce.broadcast([None, [tf.zeros([2])]], None, root=1),
     r"broadcast: devices=None, but the tensors of tower 0 carry no device"),
    (lambda: tfreduce.all_gather(consts([2], [2]), CPU_DEVICES[:2], compression="fp16"),
     r"all_gather: compression='fp16' applies to the sums \(all-reduce, reduce_scatter, "
     r"reduce\); all_gather moves the tensors in "
     r"their own dtype"),
    (lambda: collective_stage(tfreduce.Reduction(topology="dgx-a100"), "reduce", CPU_DEVICES[:2]),
     r"reduce: topology= is planned per call on the tensors' shapes"),
])
def test_bad_input_names_the_tower_the_tensor_and_the_values(call_, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call_()


def test_average_of_integers_is_a_type_error():
    with pytest.raises(TypeError, match=r"reduce_scatter: tensor 0: average=True needs "
                                        r"floating tensors, got int32"):
        tfreduce.reduce_scatter(consts([2], [2], dtype=tf.int32), CPU_DEVICES[:2], average=True)


# -- across workers: 2 workers x 2 towers equal 4 towers in one process --------

@pytest.mark.parametrize("collective, kwargs, message", [
    ("all_gather", {"compression": "fp16"},
     r"all_gather: compression='fp16' applies to the sums"),
    ("reduce_scatter", {"compression": "bf16"},
     r"reduce_scatter: compression='bf16' compresses the sums of one process; across "
     r"workers reduce_scatter moves the tensors in their own dtype"),
    ("all_to_all", {"algorithm": "nccl"}, r"algorithm 'nccl' does not build all_to_all"),
    ("reduce", {"groups": [[0], [1]]},
     r"reduce: groups= run inside one process; across workers the collective spans every "
     r"tower of every worker"),
    ("broadcast", {"topology": "dgx-a100"},
     r"broadcast: topology='dgx-a100' plans for the devices of one process"),
    ("reduce", {"root": 4}, r"reduce: root must be an int position in 0..3 inside the 4 towers"),
])
def test_across_workers_bad_choices_are_refused_before_anything_runs(collective, kwargs,
                                                                      message):
    cluster = tfreduce.Cluster({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "worker", 1)
    with tf.Graph().as_default():
        tensors = placeholders(CPU_DEVICES[:2], [(4, 2)])
        with pytest.raises(ValueError, match=message):
            getattr(tfreduce, collective)(tensors, CPU_DEVICES[:2], cluster=cluster, **kwargs)


def test_across_workers_a_new_collective_is_built_from_what_it_needs(monkeypatch):
    # The toy of the recipe across workers: each worker's stage sums its
    # towers (the reduce-scatter's local step), the cross-worker ops do the rest.
    monkeypatch.setitem(COLLECTIVE_RULES, "all_sum", CollectiveRule(
        "same", True, sums=True, needs=("reduce_scatter", "all_gather")))
    monkeypatch.setitem(BUILDERS, "all_sum", _build_all_sum)
    cluster = tfreduce.Cluster({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "worker", 1)
    with tf.Graph().as_default() as graph:
        tensors = placeholders(CPU_DEVICES[:2], [(4, 2)])
        out = collectives._run("all_sum", tensors, CPU_DEVICES[:2], ("ring", None, {}), None,
                               cluster=cluster)
        kinds = {op.type for op in graph.get_operations()}
    # The all-gather's rows come from other workers too: not known when built.
    assert [[t.shape.as_list() for t in row] for row in out] == [[[None, 2]], [[None, 2]]]
    assert [row[0].device for row in out] == [f"/job:worker/replica:0/task:1/device:CPU:{k}"
                                              for k in range(2)]
    assert {"CollectiveReduceV2", "CollectiveGatherV2"} <= kinds, kinds


def test_across_workers_a_broadcast_of_a_shape_unknown_when_built_is_refused():
    cluster = tfreduce.Cluster({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "worker", 1)
    with tf.Graph().as_default():
        tensors = [[tf.compat.v1.placeholder(tf.float32, [None, 2])] for _ in range(2)]
        with pytest.raises(ValueError, match=re.escape(
                "broadcast: tensor 0's shape (None, 2) is not known when built; across workers "
                "every worker passes a tensor of the root's static shape at tower 0")):
            tfreduce.broadcast(tensors, CPU_DEVICES[:2], cluster=cluster)


@pytest.mark.slow
def test_two_workers_of_two_towers_equal_four_towers(tmp_path):
    from test_multiworker import launch_workers

    from helpers import load_script
    worker = load_script(str(__import__("pathlib").Path(__file__).parent / "workers" /
                             "collectives_worker.py"), "collectives_worker")
    code, _, err, _ = launch_workers("collectives_worker.py", "--timeout", 60,
                                     "--out", tmp_path / "rank{}.npz")
    assert code == 0, err[-3000:]
    results = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    for case, (collective, _, dtype, _, root, average) in worker.CASES.items():
        arrays = [worker.tower_arrays(case, t) for t in range(4)]
        want = expected(collective, arrays, [[0, 1, 2, 3]], root, average,
                        worker.SPLITS.get(case))
        for rank, res in enumerate(results):
            placed = __import__("json").loads(str(res[f"{case}/devices"]))
            rows = want[:1] if collective == "reduce" else want[2 * rank:2 * rank + 2]
            for r, row in enumerate(rows):
                for n, w in enumerate(row):
                    got = res[f"{case}/out/{r}/{n}"]
                    if dtype == "bfloat16":
                        got = got.view(ml_dtypes.bfloat16)
                    np.testing.assert_array_equal(got, w, err_msg=f"{case} rank {rank} {r} {n}")
                    tower = root % 2 if collective == "reduce" else r
                    assert placed[r][n] == f"/job:worker/replica:0/task:{rank}/device:CPU:{tower}"


def _build_all_sum(stage, tensors, group, ctx, splits):
    # A toy collective: every tower gets the sum, as the all-gather of a reduce-scatter.
    scattered = BUILDERS["reduce_scatter"](stage, tensors, group, ctx, splits)
    return stage.all_gather(scattered, ctx)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_new_collective_is_one_row_and_its_builder(monkeypatch, algorithm):
    # docs/architecture.md's recipe: a rule and a builder made of the stages'
    # own collectives; every algorithm that builds those builds it.
    monkeypatch.setitem(COLLECTIVE_RULES, "all_sum", CollectiveRule(
        "same", True, sums=True, needs=("reduce_scatter", "all_gather")))
    monkeypatch.setitem(BUILDERS, "all_sum", _build_all_sum)
    devices = CPU_DEVICES[:3]
    rng = np.random.default_rng(9)
    arrays = [[values(rng, (7, 2), np.float32), values(rng, (5,), np.float64)]
              for _ in devices]
    got, placed = run_in_function(
        lambda t: collectives._run("all_sum", t, devices, (algorithm, None, {}), None),
        arrays, devices)
    for k, device in enumerate(devices):
        for n in range(2):
            want = sum(row[n] for row in arrays)
            assert got[k][n].dtype == want.dtype, (k, n, got[k][n].dtype)
            np.testing.assert_array_equal(got[k][n], want)
            assert placed[k][n].endswith(device.replace("/device", "")), (k, n, placed[k][n])
    if algorithm == "collective":  # once: an algorithm without what it needs refuses it
        with pytest.raises(ValueError, match=re.escape(
                "algorithm 'nccl' does not build all_sum (TF has no such nccl op); use "
                "algorithm= one of ['flat', 'hierarchical', 'ring', 'collective']")):
            collectives._run("all_sum", [[tf.constant(a) for a in row] for row in arrays],
                             devices, ("nccl", None, {}), None)


def test_a_collective_broadcast_of_a_shape_unknown_when_built_is_refused():
    # The receivers' ops are built with the root's static shape.
    devices = CPU_DEVICES[:2]

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)], autograph=False)
    def step(x):
        return tfreduce.broadcast([[x], [None]], devices, algorithm="collective")

    with pytest.raises(ValueError, match=re.escape(
            "broadcast: tensor 0's shape (None, 2) is not known when built; TF's collective "
            "broadcast needs it: use algorithm='flat'")):
        step.get_concrete_function()
