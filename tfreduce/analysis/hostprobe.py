"""The "host" topology: this machine's logical CPU devices, measured by a short probe.

What ``tfreduce.predict(..., "host")`` and ``tfreduce-bench --predict host``
cost graphs on, so that the cost model can be checked against times
measured here.
"""

import math
import os
import time

import tensorflow as tf

from tfreduce.algorithms.frame import run_stages
from tfreduce.algorithms.nccl_ops import CollectiveStage
from tfreduce.basis.contract import validate_grads
from tfreduce.basis.topology import Topology, check_topology

__all__ = ["host_topology", "resolve_topology"]


def host_topology(num_devices, repeats=9):
    """The "host" preset: K logical CPU devices of this machine, measured now.

    A short probe (a few seconds; run it on a quiet machine) measures, as
    medians of ``repeats`` runs: the memory bandwidth of an add_n of eight
    8 MiB buffers (72 MiB moved, every core helping; the best run); the
    cost of one op and the bandwidth of cache-sized ones (chains of adds of
    1 KiB and 64 KiB tensors); the cost of one cross-device edge (a chain
    of adds alternating between CPU:0 and CPU:1, less the op) and of one
    collective member (a chain of CollectiveReduceV2 over CPU:0 and CPU:1);
    the extra cost of a 64 MiB output, whose pages are mapped afresh each
    step (an add of two 64 MiB buffers, less its bytes at memory bandwidth).
    Logical CPU devices share one memory: a graph transfer passes a pointer
    (no bytes move; it costs the edge), a collective copies its ring's bytes
    at memory bandwidth, and the devices share one compute lane per core
    this process may run on: a cache-sized op takes one, a larger math op
    all (TF splits it over the cores), a concat or copying split one.

    Args:
      num_devices: int K, logical CPU devices this process has (made with
        tfreduce.logical_devices before TensorFlow started).
      repeats: int, runs per measurement.

    Returns:
      Topology named "host".
    """
    lanes = len(os.sched_getaffinity(0))
    p = _probe(min(num_devices, 2), repeats, lanes)
    return Topology.fully_connected(
        num_devices, math.inf, 0.0, memory_bandwidth=p["memory"], launch_cost=p["op"],
        compute_lanes=lanes, cache=(_CACHE_PROBE_BYTES, p["cache"]),
        collective_cost=p["collective"], copy_cost=p["edge"],
        # A CPU collective's members copy and add (3 passes over the bytes)
        # through one shared memory: the ring runs at M / (3K).
        collective_bandwidth=p["memory"] / (3 * num_devices),
        fresh_memory=None if p["fresh"] is None else (MMAP_THRESHOLD_MAX, p["fresh"]),
        name="host")


def resolve_topology(topology, num_devices, at_least=True):
    """The Topology to cost K devices on: ``check_topology``, "host" measured now.

    The one place a preset name or "host" becomes a Topology (the planner
    and ``tfreduce.predict`` both resolve here).

    Args:
      topology: a tfreduce.Topology, a preset name, or "host" (probed by
        ``host_topology`` for K logical CPU devices).
      num_devices: int K.
      at_least: bool, raise unless the topology has at least K devices
        (False: the caller reports a device beyond it itself).

    Returns:
      Topology.

    Raises:
      TypeError, ValueError: as ``check_topology``.
    """
    topology = check_topology(topology, num_devices if at_least else None)
    return host_topology(num_devices) if topology == "host" else topology


# An add of two 64 KiB tensors moves 192 KiB: the probe's cache-sized op.
_CACHE_PROBE_BYTES = 3 * 64 * 2**10
#: glibc's malloc serves allocations above this from fresh mmap pages at
#: every step (the dynamic M_MMAP_THRESHOLD stops rising here on 64-bit).
MMAP_THRESHOLD_MAX = 32 * 2**20


def _probe(num_devices, repeats, lanes):
    # Measured in a tf.compat.v1.Session of its own with num_devices CPU
    # devices (so it works in eager programs and in graph ones alike), with
    # Grappler off, so that the chains are run as built.
    chain, elements, count = 1000, 2 * 2**20, 50
    graph = tf.Graph()
    with graph.as_default():
        feeds = {size: tf.compat.v1.placeholder(tf.float32, [size]) for size in (256, 16384)}
        with tf.device("/device:CPU:0"):
            # A gradient-sized add_n of 8 buffers of 8 MiB: reads 64, writes 8 MiB.
            big = [tf.Variable(tf.fill([elements], float(i))) for i in range(8)]
            # An add with a 64 MiB output: reads 128, writes 64 MiB to fresh pages.
            huge = [tf.Variable(tf.fill([16 * 2**20], float(i))) for i in range(2)]
            fetches = {"memory": tf.add_n(big).op, "op": _chain(feeds[256], chain, 1),
                       "small": _chain(feeds[16384], chain, 1), "fresh": tf.add(*huge).op}
        if num_devices > 1:
            fetches["edge"] = _chain(feeds[256], chain, 2)
            fetches["collective"] = _collectives(feeds[256], count)
        init = tf.compat.v1.global_variables_initializer()
    config = tf.compat.v1.ConfigProto(device_count={"CPU": num_devices})
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    feed = {feeds[size]: [0.0] * size for size in feeds}
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(init)
        seconds = {name: _median_seconds(session, fetch, feed, repeats)
                   for name, fetch in fetches.items()}
        # Memory: the best run, what steady training reaches (a slower one
        # met page faults or a neighbour's traffic).
        seconds["memory"] = _median_seconds(session, fetches["memory"], feed, repeats, best=True)
    op = seconds["op"] / chain
    memory = 9 * 4 * elements / seconds["memory"]
    faults = seconds["fresh"] - op - 3 * 2**26 / memory
    return {"memory": memory, "op": op,
            "cache": _CACHE_PROBE_BYTES / max(seconds["small"] / chain - op, 1e-9),
            "edge": max(seconds.get("edge", 0.0) / chain - op, 0.0),
            # An instance's two members run side by side on two lanes.
            "collective": seconds.get("collective", 0.0) / count / math.ceil(2 / lanes),
            "fresh": 2**26 / faults if faults > 0 else None}


def _median_seconds(session, fetch, feed, repeats, best=False):
    session.run(fetch, feed)  # warmed up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(fetch, feed)
        times.append(time.perf_counter() - start)
    return min(times) if best else sorted(times)[len(times) // 2]


def _collectives(x, count):
    # count all-reduces over CPU:0 and CPU:1 as the collective algorithm
    # builds them (one chain per device, unpacked); their ops.
    devices = ["/device:CPU:0", "/device:CPU:1"]
    grads = []
    for k, d in enumerate(devices):
        with tf.device(d):
            grads.append([x + float(i + k) for i in range(count)])
    return [t.op for row in run_stages(validate_grads(grads, devices), [CollectiveStage()], False)
            for t in row]


def _chain(x, count, num_devices):
    # count dependent adds on x, alternating over the devices; the last op.
    for i in range(count):
        with tf.device(f"/device:CPU:{i % num_devices}"):
            x = x + 1.0
    return x.op
