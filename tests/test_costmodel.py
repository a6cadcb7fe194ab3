"""The topology cost model: closed forms, presets, NCCL against nccl-tests, errors."""

import os
import re

import pytest
import tensorflow as tf

import tfreduce
from helpers import GPU_DEVICES
from tfreduce.analysis.costmodel import predict
from tfreduce.analysis.hostprobe import host_topology
from tfreduce.basis.topology import PRESETS, Topology

GB = 1e9


def build(algorithm, num_devices, size_bytes, **options):
    """One float32 gradient of size_bytes per device, reduced; built on "/gpu:k", not run."""
    graph = tf.Graph()
    devices = GPU_DEVICES[:num_devices]
    with graph.as_default():
        grads = []
        for d in devices:
            with tf.device(d):
                grads.append([tf.zeros([size_bytes // 4])])
        out = tfreduce.allreduce_grads(grads, devices, algorithm=algorithm, **options)
    return out, grads


@pytest.mark.parametrize("num_devices", [2, 4, 8])
@pytest.mark.parametrize("bandwidth, latency", [(10 * GB, 2e-6), (1 * GB, 0.0)])
def test_uniform_machine_gives_the_alpha_beta_formulas(num_devices, bandwidth, latency):
    size = 4 * 2**20
    topology = Topology.fully_connected(num_devices, bandwidth, latency)
    hop = latency + size / bandwidth
    formulas = {
        # to the root and back
        "flat": 2 * hop,
        # 2(K-1) steps of S/K between ring neighbours
        "ring": 2 * (num_devices - 1) * (latency + size / num_devices / bandwidth),
        # inside the group, to the combining root, back to the other root,
        # back inside the group (one group each for K=2)
        "hierarchical": (2 if num_devices == 2 else 4) * hop,
    }
    for algorithm, want in formulas.items():
        out, grads = build(algorithm, num_devices, size, pack_bytes=None)
        got = predict(out, topology, inputs=grads)
        assert got.seconds == pytest.approx(want, rel=1e-12), algorithm
        assert got.bytes_per_device == size and got.num_devices == num_devices
        assert got.bus_bandwidth == pytest.approx(
            size * 2 * (num_devices - 1) / num_devices / want, rel=1e-12)


def build_collective(collective, algorithm, num_devices, size_bytes):
    """One float32 tensor of size_bytes per device through a collective; on "/gpu:k", not run."""
    graph = tf.Graph()
    devices = GPU_DEVICES[:num_devices]
    with graph.as_default():
        tensors = []
        for d in devices:
            with tf.device(d):
                tensors.append([tf.zeros([size_bytes // 4])])
        kwargs = {"root": 0} if collective in ("broadcast", "reduce") else {}
        out = getattr(tfreduce, collective)(tensors, devices, algorithm=algorithm, **kwargs)
    return out, tensors


@pytest.mark.parametrize("num_devices", [2, 4, 8])
def test_collectives_on_a_uniform_machine_give_the_alpha_beta_formulas(num_devices):
    size, bandwidth, latency = 4 * 2**20, 10 * GB, 2e-6
    topology = Topology.fully_connected(num_devices, bandwidth, latency)
    hop, steps = latency + size / bandwidth, num_devices - 1
    chunk = latency + size / num_devices / bandwidth
    formulas = {
        # the ring's halves: K-1 steps of S/K (all-gather: of each device's S)
        ("reduce_scatter", "ring"): steps * chunk,
        ("all_gather", "ring"): steps * hop,
        # a pipeline of K-1 whole hops along the ring
        ("broadcast", "ring"): steps * hop,
        ("reduce", "ring"): steps * hop,
        # to the root, then the root's shards (reduce-scatter) or copies out
        ("reduce_scatter", "flat"): hop + chunk,
        ("broadcast", "flat"): hop,
        ("reduce", "flat"): hop,
        # NCCL's ring inside one op: G-1 steps of each member's S (after
        # the gather of the towers' order, 4 bytes each), or S pipelined
        # through G-1 hops
        ("all_gather", "collective"): steps * (latency + 4 / bandwidth) + steps * hop,
        ("broadcast", "collective"): steps * latency + size / bandwidth,
    }
    for (collective, algorithm), want in formulas.items():
        out, tensors = build_collective(collective, algorithm, num_devices, size)
        got = predict(out, topology, inputs=tensors)
        if num_devices == 2 and collective == "reduce_scatter" and algorithm == "flat":
            want = hop + chunk  # one device sends S, the root sends back S/2
        assert got.seconds == pytest.approx(want, rel=1e-9), (collective, algorithm)


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_collective_is_priced_on_every_preset(preset):
    size = 4 * 2**20
    for collective in ("reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"):
        for algorithm in ("flat", "hierarchical", "ring", "collective"):
            out, tensors = build_collective(collective, algorithm, 8, size)
            got = predict(out, preset, inputs=tensors)
            # Each sends at least S/8 from a device over a link no faster
            # than the preset's fastest.
            fastest = max(link.bandwidth for link in Topology.preset(preset).links)
            assert size / 8 / fastest <= got.seconds < 1.0, (collective, algorithm, got)


def test_bus_bandwidth_uses_the_nccl_tests_factors():
    assert tfreduce.bus_bandwidth("all_reduce", 8 * GB, 1.0, 8) == pytest.approx(14 * GB)
    assert tfreduce.bus_bandwidth("all_gather", 8 * GB, 1.0, 8) == pytest.approx(7 * GB)
    assert tfreduce.bus_bandwidth("reduce_scatter", 8 * GB, 2.0, 4) == pytest.approx(3 * GB)
    assert tfreduce.bus_bandwidth("broadcast", 8 * GB, 2.0, 4) == pytest.approx(4 * GB)
    with pytest.raises(ValueError, match=r"unknown collective 'gather'; choose one of "):
        tfreduce.bus_bandwidth("gather", 1, 1.0, 2)


def test_a_ring_moves_2_k_minus_1_over_k_of_s_per_device():
    size, bandwidth, num_devices = 8 * 2**20, 5 * GB, 8
    out, grads = build("ring", num_devices, size, pack_bytes=None)
    got = predict(out, Topology.fully_connected(num_devices, bandwidth), inputs=grads)
    for k in range(num_devices):
        sent = sum(busy for name, busy in got.link_busy.items() if name.startswith(f"gpu{k}->"))
        assert sent * bandwidth == pytest.approx(2 * (num_devices - 1) / num_devices * size)
    # The critical path is the ring's 2(K-1) hops, each followed by its add or copy.
    assert sum(kind == "transfer" for kind, *_ in got.critical_path) == 2 * (num_devices - 1)


def test_nccl_ring_on_dgx_a100_matches_nccl_tests():
    # nccl-tests all_reduce_perf on 8 x A100 SXM (NVSwitch) reports a bus
    # bandwidth of about 230 GB/s at 1 GB (NVIDIA's DGX A100 figures).
    out, grads = build("nccl", 8, 2**30, pack_bytes=None)
    got = predict(out, "dgx-a100", inputs=grads)
    assert got.bus_bandwidth == pytest.approx(230 * GB, rel=0.15)
    assert [kind for kind, *_ in got.critical_path if kind == "collective"]


def test_presets_route_over_their_links():
    v100 = Topology.preset("dgx1-v100")
    assert [link.bandwidth for link in v100.route(0, 3)] == [40 * GB]  # two NVLinks
    assert [link.bandwidth for link in v100.route(0, 1)] == [20 * GB]
    # No NVLink between 0 and 5: PCIe to the CPU, QPI, PCIe; never through a GPU.
    route = v100.route(0, 5)
    assert [link.name for link in route] == ["gpu0->pcie0", "pcie0->cpu0", "cpu0->cpu1",
                                             "cpu1->pcie2", "pcie2->gpu5"]
    assert min(link.bandwidth for link in route) == 6 * GB
    p100 = Topology.preset("dgx1-p100")
    assert {k for k in range(1, 8) if len(p100.route(0, k)) == 1} == {1, 2, 3, 4}
    a100 = Topology.preset("dgx-a100")
    assert all(link.bandwidth == 240 * GB for k in range(1, 8) for link in a100.route(0, k))
    assert sorted(PRESETS) == ["dgx-a100", "dgx-h100", "dgx1-p100", "dgx1-v100", "pcie3x8",
                               "pcie4x8"]
    two = Topology.cluster("dgx-a100", nodes=2, nic_bandwidth=24 * GB)
    assert two.num_devices == 16
    across = two.route(1, 9)
    assert "m0.nic->net" in [link.name for link in across]
    assert min(link.bandwidth for link in across) == 24 * GB
    assert [link.name for link in two.route(1, 2)] == ["gpu1->m0.nvswitch", "m0.nvswitch->gpu2"]


def test_compute_costs_memory_passes_and_launches():
    topology = Topology(2, [("gpu0", "gpu1", 1 * GB, 0.0)], memory_bandwidth=100 * GB,
                        launch_cost=1e-5)
    out, grads = build("flat", 2, 4 * 2**20, pack_bytes=None)
    got = predict(out, topology, inputs=grads)
    size = 4 * 2**20
    # Two transfers, and the root's add of two inputs into one output (3 S moved).
    assert got.seconds == pytest.approx(2 * size / GB + 1e-5 + 3 * size / (100 * GB))


def test_errors():
    with pytest.raises(ValueError, match=re.escape("unknown topology preset 'dgx-9'; choose one "
                                                   "of ['dgx-a100', 'dgx-h100'")):
        Topology.preset("dgx-9")
    out, grads = build("flat", 4, 1024, pack_bytes=None)
    with pytest.raises(ValueError, match=r"is on /device:GPU:([23]), device \1, but topology "
                                         r"'fully_connected\(2\)' has 2 devices; use a "
                                         r"topology of as many devices as the graph"):
        predict(out, Topology.fully_connected(2, GB), inputs=grads)
    with pytest.raises(ValueError, match="link gpu0->gpu1: bandwidth must be > 0 bytes/s"):
        Topology(2, [("gpu0", "gpu1", 0, 0.0)])
    with pytest.raises(ValueError, match="topology 'custom': no route from device 0 to device 1"):
        Topology(2, [("gpu0", "switch", GB, 0.0)])


def test_collectives_take_the_widest_ring_and_share_its_links():
    # DGX-1 with V100: the pairs with two NVLinks form a ring through all 8
    # GPUs, so NCCL's ring runs at 40 GB/s per link (not 6 over QPI).
    out, grads = build("nccl", 8, 2**30, pack_bytes=None)
    got = predict(out, "dgx1-v100", inputs=grads)
    assert got.bus_bandwidth == pytest.approx(40 * GB, rel=0.01)
    # Two all-reduces of S/2 each use the same links: one after the other.
    graph = tf.Graph()
    with graph.as_default():
        grads = []
        for d in GPU_DEVICES[:8]:
            with tf.device(d):
                grads.append([tf.zeros([2**27]), tf.zeros([2**27])])
        two = tfreduce.allreduce_grads(grads, GPU_DEVICES[:8], algorithm="nccl", pack_bytes=None)
    both = predict(two, "dgx1-v100", inputs=grads)
    assert both.seconds == pytest.approx(got.seconds, rel=0.01)


def test_shared_compute_lanes_cache_and_collective_cost():
    size = 4 * 2**20
    out, grads = build("flat", 4, size, pack_bytes=None)
    free = Topology.fully_connected(4, 1e30)
    own = Topology.fully_connected(4, 1e30, memory_bandwidth=GB)
    shared = Topology.fully_connected(4, 1e30, memory_bandwidth=GB, compute_lanes=1)
    cached = Topology.fully_connected(4, 1e30, memory_bandwidth=GB, cache=(2**30, 10 * GB))
    times = {name: predict(out, t, inputs=grads).seconds
             for name, t in [("free", free), ("own", own), ("shared", shared), ("cached", cached)]}
    assert times["free"] == pytest.approx(0, abs=1e-12)
    assert times["own"] == pytest.approx(5 * size / GB)  # the root's add_n: 4 in, 1 out
    assert times["shared"] == pytest.approx(times["own"])  # one op: nothing to share
    assert times["cached"] == pytest.approx(5 * size / (10 * GB))
    with pytest.raises(ValueError, match="compute_lanes must be None or an int >= 1, got 0"):
        Topology.fully_connected(2, GB, compute_lanes=0)
    with pytest.raises(ValueError, match=r"cache must be None or \(bytes >= 0, bandwidth > 0\)"):
        Topology.fully_connected(2, GB, cache=(1, 0))
    nccl_out, nccl_grads = build("nccl", 2, size, pack_bytes=None)
    slow = Topology.fully_connected(2, 1e30, collective_cost=1e-3)
    assert predict(nccl_out, slow, inputs=nccl_grads).seconds == pytest.approx(1e-3)


def one_device_graph(build):
    """predict() of build(x) on /gpu:0, x a float32 [4096] (16 KiB) input, at 1 GB/s."""
    with tf.Graph().as_default():
        with tf.device(GPU_DEVICES[0]):
            x = tf.zeros([4096])
            out = build(x)
    return predict([[t] for t in out], Topology.fully_connected(1, GB, memory_bandwidth=GB),
                   inputs=[[x]]).seconds


@pytest.mark.parametrize("pieces, copies", [
    ([4096], False),  # one piece: TF forwards the input
    ([2048, 2048], False),  # every piece starts and ends on 64 bytes: slices
    ([16, 4080], False),
    ([10, 4086], True),  # 40 bytes: not aligned, so the pieces are copied
])
def test_splits_cost_nothing_only_when_tf_hands_out_aligned_slices(pieces, copies):
    got = one_device_graph(lambda x: tf.split(x, pieces))
    # A copy reads and writes 16 KiB, and reads the two sizes and the axis.
    assert got == pytest.approx((2 * 4096 * 4 + 12) / GB if copies else 0.0, abs=1e-15)


def test_row_splits_and_unstack_follow_the_row_size():
    # [256, 16] float32: 64-byte rows, aligned; [256, 10]: 40-byte rows, copied.
    for cols, copies in ((16, False), (10, True)):
        def rows(x, cols=cols):
            return tf.split(tf.reshape(x[:256 * cols], [256, cols]), 4)
        slicing = one_device_graph(rows)
        strided = one_device_graph(lambda x, cols=cols: [x[:256 * cols]])
        # (and its axis)
        assert slicing - strided == pytest.approx(
            (2 * 256 * cols * 4 + 4) / GB if copies else 0.0, abs=1e-15)
    assert one_device_graph(lambda x: tf.unstack(tf.reshape(x, [4, 1024]))) == 0.0


def test_fresh_memory_costs_large_outputs_once_more():
    size = 2**20
    out, grads = build("flat", 2, size, pack_bytes=None)
    plain = Topology.fully_connected(2, 1e30, memory_bandwidth=GB)
    fresh = Topology.fully_connected(2, 1e30, memory_bandwidth=GB, fresh_memory=(size - 1, GB))
    above = Topology.fully_connected(2, 1e30, memory_bandwidth=GB, fresh_memory=(size, GB))
    base = predict(out, plain, inputs=grads).seconds
    # The root's add_n writes one S-byte output: S / 1 GB/s more, when S is
    # above the threshold (the copies back are transfers, not ops).
    assert predict(out, fresh, inputs=grads).seconds == pytest.approx(base + size / GB)
    assert predict(out, above, inputs=grads).seconds == pytest.approx(base)
    with pytest.raises(ValueError, match=r"fresh_memory must be None or \(bytes >= 0, "):
        Topology.fully_connected(2, GB, fresh_memory=(1, 0))


def test_large_ops_take_every_lane_and_small_ones_one():
    # Two towers' adds, independent: on two shared lanes the small ones run
    # side by side, the large ones (beyond the cache tier) one after another.
    def adds(size):
        with tf.Graph().as_default():
            xs, out = [], []
            for d in GPU_DEVICES[:2]:
                with tf.device(d):
                    xs.append(tf.zeros([size // 4]))
                    out.append([xs[-1] + 1.0])
        lanes = Topology.fully_connected(2, 1e30, memory_bandwidth=GB, compute_lanes=2,
                                         cache=(2**16, GB))
        return predict(out, lanes, inputs=[[x] for x in xs]).seconds
    # (each add also reads its 4-byte constant)
    assert adds(2**12) == pytest.approx((2 * 2**12 + 4) / GB)  # one add's time
    assert adds(2**16) == pytest.approx(2 * (2 * 2**16 + 4) / GB)  # two adds' time


@pytest.mark.slow
def test_the_host_probe_measures_this_machine():
    host = host_topology(4, repeats=3)
    assert host.name == "host" and host.num_devices == 4
    assert host.compute_lanes == len(os.sched_getaffinity(0))
    assert host.fresh_memory is None or (host.fresh_memory[0] == 32 * 2**20
                                         and host.fresh_memory[1] > 0)
    assert 1e8 < host.memory_bandwidth < 1e12  # bytes/s of a real memory
    assert 0 < host.launch_cost < 1e-3
    assert host.cache[1] > 0 and host.collective_cost > 0
    assert host.copy_cost > 0 and host.links[0].bandwidth == float("inf")


@pytest.mark.slow
def test_plan_allreduce_picks_the_fastest_predicted_candidate():
    shapes = [[3, 3, 64, 64], [64], [2048, 1000], [1000]]
    dgx1 = tfreduce.plan_allreduce(shapes, GPU_DEVICES[:8], "dgx1-v100")
    a100 = tfreduce.plan_allreduce(shapes, GPU_DEVICES[:8], "dgx-a100")
    cpu = tfreduce.plan_allreduce(shapes, [f"/cpu:{k}" for k in range(8)], "dgx-a100")
    for plan in (dgx1, a100, cpu):
        assert plan.seconds == min(seconds for *_, seconds in plan.table)
        assert plan.kwargs()["algorithm"] == plan.algorithm
    # NCCL's ring over the doubled NVLinks, or the NVSwitch, beats every
    # graph algorithm; NCCL is a candidate on GPU names only.
    assert dgx1.algorithm == "nccl" and a100.algorithm == "nccl"
    assert "nccl" not in {algorithm for algorithm, *_ in cpu.table}
    # On a DGX-1 the hierarchical roots pair over NVLink: faster than flat.
    best = {}
    for algorithm, options, seconds in dgx1.table:
        best[algorithm] = min(best.get(algorithm, seconds), seconds)
    assert best["hierarchical"] < best["flat"]
    with pytest.raises(ValueError, match="topology 'dgx-a100' has 8 devices, fewer than the 16"):
        tfreduce.plan_allreduce(shapes, [f"/gpu:{k}" for k in range(16)], "dgx-a100")
