"""Traffic analysis: exact bytes per device pair, op counts and hop chains."""

import json

import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES, GPU_DEVICES, placeholders
from tfreduce.basis.contract import shard_sizes as chunk_sizes


def build(num_towers, shapes, algorithm, dtype=tf.float32, pack_bytes=None, **options):
    """Builds one reduction on K x N placeholders; returns (graph, grads, out).

    No packing unless pack_bytes is given, whatever the library default.
    """
    devices = GPU_DEVICES[:num_towers]
    graph = tf.Graph()
    with graph.as_default():
        grads = placeholders(devices, shapes, dtype)
        out = tfreduce.allreduce_grads(grads, devices, algorithm=algorithm,
                                       pack_bytes=pack_bytes, **options)
    return graph, grads, out


def per_device(traffic, num_towers):
    return ([traffic.sent(d) for d in GPU_DEVICES[:num_towers]],
            [traffic.received(d) for d in GPU_DEVICES[:num_towers]])


def test_flat_k8_every_pair_carries_two_buffers():
    # 8 equal buffers of S/8: device r is the root of buffer r; every other
    # device sends it S/8 and gets S/8 back, so each ordered pair carries
    # S/4 and each device sends and receives 7 * S/4 = 1.75 S.
    size = 8 * 512 * 4
    _, grads, out = build(8, [(512,)] * 8, "flat")
    t = tfreduce.analyze_traffic(out, inputs=grads)
    assert t.pair_bytes == {(a, b): size // 4 for a in GPU_DEVICES for b in GPU_DEVICES
                            if a != b}
    assert per_device(t, 8) == ([1.75 * size] * 8, [1.75 * size] * 8)
    assert t.longest_hop_chain == 2
    # Per buffer: add_n, the total, K outputs.
    assert t.num_ops == 8 * (1 + 1 + 8)
    assert t.op_types == {"AddN": 8, "Identity": 8 * 9}


def test_hierarchical_k8_packed_into_8_buffers():
    # 64 tensors of 256 bytes packed 8 per buffer: 8 equal buffers of S/8.
    # Buffer m has roots m % 4 and m % 4 + 4. Inside a group each device
    # sends S/2 to each other member (its piece to the two buffers the
    # member roots, and the totals of its own two buffers); across groups
    # only partners i and i+4 talk, S/4 each way; 1.75 S per device.
    size = 64 * 256
    _, grads, out = build(8, [(64,)] * 64, "hierarchical", pack_bytes=2048)
    t = tfreduce.analyze_traffic(out, inputs=grads)
    want = {}
    for a in range(8):
        for b in range(8):
            if a != b and a // 4 == b // 4:
                want[(GPU_DEVICES[a], GPU_DEVICES[b])] = size // 2
            elif a % 4 == b % 4 and a != b:
                want[(GPU_DEVICES[a], GPU_DEVICES[b])] = size // 4
    assert t.pair_bytes == want
    assert per_device(t, 8) == ([1.75 * size] * 8, [1.75 * size] * 8)
    assert t.longest_hop_chain == 4
    assert t.op_types["ConcatV2"] == 8 * 8 and t.op_types["SplitV"] == 8 * 8


@pytest.mark.parametrize("num_towers", [2, 3, 8])
def test_ring_sends_2_k_minus_1_over_k_only_to_the_next_device(num_towers):
    size = 8 * 4 * num_towers * 4
    _, grads, out = build(num_towers, [(4 * num_towers,)] * 8, "ring")
    t = tfreduce.analyze_traffic(out, inputs=grads)
    share = 2 * (num_towers - 1) * size // num_towers
    assert t.pair_bytes == {(GPU_DEVICES[k], GPU_DEVICES[(k + 1) % num_towers]): share
                            for k in range(num_towers)}
    assert per_device(t, num_towers) == ([share] * num_towers, [share] * num_towers)
    assert t.longest_hop_chain == 2 * (num_towers - 1)
    assert t.op_types["AddV2"] == 8 * num_towers * (num_towers - 1)


def test_ring_uneven_chunks():
    # 13 elements on 5 devices: chunks 3, 3, 3, 2, 2 owned by devices 0..4.
    # Device k sends every chunk but its own in the reduce-scatter and every
    # chunk but its successor's in the all-gather.
    _, grads, out = build(5, [(13,)], "ring")
    t = tfreduce.analyze_traffic(out, inputs=grads)
    sizes = chunk_sizes(13, 5)
    for k in range(5):
        want = 4 * (2 * 13 - sizes[k] - sizes[(k + 1) % 5])
        assert t.pair_bytes[(GPU_DEVICES[k], GPU_DEVICES[(k + 1) % 5])] == want
    assert t.total_bytes == 2 * 4 * 4 * 13


def test_ring_scalar_goes_round_twice():
    _, grads, out = build(4, [()], "ring")
    t = tfreduce.analyze_traffic(out, inputs=grads)
    assert t.total_bytes == 6 * 4
    assert sum(t.pair_transfers.values()) == 6
    assert t.longest_hop_chain == 6


def test_ring_half_precision_bytes():
    # Per chunk of h float16 bytes: the first hop carries h, the K-2 later
    # reduce-scatter hops 2h (float32), the K-1 all-gather hops h.
    _, grads, out = build(4, [(8,)], "ring", dtype=tf.float16)
    t = tfreduce.analyze_traffic(out, inputs=grads)
    h = 2 * 2
    assert t.total_bytes == 4 * (h + 2 * 2 * h + 3 * h)


def test_engines_inside_one_op_show_no_edges():
    _, grads, out = build(4, [(8,), (3,)], "collective")
    t = tfreduce.analyze_traffic(out, inputs=grads)
    assert t.pair_bytes == {} and t.total_bytes == 0
    assert t.op_types["CollectiveReduceV2"] == 8
    assert t.longest_hop_chain == 0


def test_whole_graph_and_concrete_function_agree_with_outputs():
    graph, grads, out = build(4, [(16,), (5,)], "flat")
    from_outputs = tfreduce.analyze_traffic(out, inputs=grads)
    from_graph = tfreduce.analyze_traffic(graph)
    assert from_graph.pair_bytes == from_outputs.pair_bytes
    assert from_graph.num_ops == from_outputs.num_ops + 4 * 2  # + the placeholders

    # A tf.function is traced in this process, so its devices must exist
    # here: the same reduction on CPU devices, compared under GPU names.
    devices = CPU_DEVICES[:4]

    @tf.function(autograph=False)
    def step(*flat):
        grads = []
        for k, d in enumerate(devices):
            with tf.device(d):
                grads.append([tf.identity(flat[2 * k]), tf.identity(flat[2 * k + 1])])
        return tfreduce.allreduce_grads_flat(grads, devices, pack_bytes=None)

    concrete = step.get_concrete_function(
        *[tf.TensorSpec(s, tf.float32) for _ in range(4) for s in [(16,), (5,)]])
    traced = tfreduce.analyze_traffic(concrete).pair_bytes
    assert {tuple(d.replace("CPU", "GPU") for d in pair): size
            for pair, size in traced.items()} == from_outputs.pair_bytes


def test_a_tensor_read_twice_on_one_device_is_sent_once():
    with tf.Graph().as_default():
        with tf.device("/gpu:0"):
            x = tf.zeros([10])
        with tf.device("/gpu:1"):
            a, b = x + 1.0, x * 2.0
        with tf.device("/gpu:2"):
            c = x - 1.0
        t = tfreduce.analyze_traffic([a, b, c], inputs=[x])
    assert t.pair_bytes == {("/device:GPU:0", "/device:GPU:1"): 40,
                            ("/device:GPU:0", "/device:GPU:2"): 40}
    assert t.num_ops == 3 + 3  # three ops and their constants


def test_unknown_sizes_and_unplaced_ops():
    with tf.Graph().as_default():
        with tf.device("/gpu:0"):
            x = tf.compat.v1.placeholder(tf.float32, [None])
        with tf.device("/gpu:1"):
            y = tf.identity(x)
        z = tf.identity(y)  # no device: not counted as a crossing
        t = tfreduce.analyze_traffic(z)
    assert t.pair_transfers == {("/device:GPU:0", "/device:GPU:1"): 1}
    assert t.pair_bytes == {} and t.unsized_transfers == 1
    assert t.ops_per_device == {"/device:GPU:0": 1, "/device:GPU:1": 1, "": 1}
    assert t.longest_hop_chain == 1


def test_as_dict_is_json():
    _, grads, out = build(2, [(4,)], "flat")
    d = tfreduce.analyze_traffic(out, inputs=grads).as_dict()
    assert json.loads(json.dumps(d))["pair_bytes"] == {
        "/device:GPU:0 -> /device:GPU:1": 16, "/device:GPU:1 -> /device:GPU:0": 16}
    assert d["sent"] == {"/device:GPU:0": 16, "/device:GPU:1": 16}


def test_bad_targets():
    with pytest.raises(TypeError, match="target must hold graph tensors.*got ndarray"):
        tfreduce.analyze_traffic([[np.zeros(3)]])
    with pytest.raises(ValueError, match="target holds no tensor"):
        tfreduce.analyze_traffic([[None]])
    graph, grads, _ = build(2, [(4,)], "flat")
    with pytest.raises(ValueError, match="inputs= applies to outputs"):
        tfreduce.analyze_traffic(graph, inputs=grads)
    with pytest.raises(TypeError, match="inputs must hold graph tensors.*got str"):
        tfreduce.analyze_traffic(grads, inputs=["x"])
