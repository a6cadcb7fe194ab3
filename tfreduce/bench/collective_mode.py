"""The collective mode: each collective of ``--collective`` against its peers, in one run.

For each collective, every contender is built into one graph on the same
inputs, checked once against NumPy and timed in rounds in one session: the
tfreduce algorithms, tf.distribute's equivalent where it has one (the
``ReductionToOneDevice`` methods behind ``ReplicaContext.all_gather``,
``extended.broadcast_to`` and ``extended.reduce_to`` on CPUs) and a plain
baseline of direct ``add_n`` / ``concat`` / ``identity`` ops on each device.
Times are reported with nccl-tests' algorithm and bus bandwidth
(``tfreduce.bus_bandwidth``), and with ``--predict`` the cost model's time
and bus bandwidth of each tfreduce algorithm built on GPU names.

S (``--total-bytes``) is each rank's buffer as nccl-tests defines it: the
input of a reduce-scatter, broadcast, reduce and all-to-all, the output of
an all-gather (each tower then holds S/K).
"""

import statistics

import numpy as np
import tensorflow as tf

import tfreduce
from tfreduce.analysis.costmodel import predict
from tfreduce.analysis.traffic import analyze_traffic, bus_bandwidth
from tfreduce.basis.contract import shard_sizes
from tfreduce.basis.topology import Topology
from tfreduce.bench.harness import (consume, device_names, environment, graph_session_config,
                                    make_inputs, time_rounds)
from tfreduce.bench.tables import print_table
from tfreduce.bench.units import format_bytes

__all__ = ["run", "print_result"]

#: Columns of each input: S is rounded down to whole rows of this many floats.
ROW_ELEMENTS = 256


def _tf_distribute(collective):
    # tf.distribute's equivalent (the CPU default of MirroredStrategy), or None.
    from tensorflow.python.distribute import values as values_lib
    ops = tf.distribute.ReductionToOneDevice()

    def per_replica(tensors):
        return values_lib.PerReplica([row[0] for row in tensors])

    def all_gather(tensors, devices):
        gathered = ops._gather(per_replica(tensors), per_replica(tensors), axis=0)  # noqa
        return [[v] for v in gathered.values]

    def broadcast(tensors, devices):
        copies = ops.broadcast(tensors[0][0], per_replica(tensors))
        return [[v] for v in copies.values]

    def reduce(tensors, devices):
        total = ops.reduce(tf.distribute.ReduceOp.SUM, per_replica(tensors), devices[0])
        return [[total]]

    return {"all_gather": ("ReplicaContext.all_gather (ReductionToOneDevice._gather)",
                           all_gather),
            "broadcast": ("extended.broadcast_to (ReductionToOneDevice.broadcast)", broadcast),
            "reduce": ("extended.reduce_to (ReductionToOneDevice.reduce)", reduce),
            }.get(collective)


def _plain(collective):
    # Direct ops: each tower splits its own rows, each device adds or joins
    # what it receives; what a user writes without a library.
    def build(tensors, devices):
        column = [row[0] for row in tensors]
        pieces = []
        for t, device in zip(column, devices):
            with tf.device(device):
                pieces.append(tf.split(t, _shards(t, len(devices))))
        out = []
        for k, device in enumerate(devices):
            with tf.device(device):
                if collective == "reduce_scatter":
                    out.append([tf.add_n([p[k] for p in pieces])])
                elif collective == "all_gather":
                    out.append([tf.concat(column, axis=0)])
                elif collective == "all_to_all":
                    out.append([tf.concat([p[k] for p in pieces], axis=0)])
                elif collective == "broadcast":
                    out.append([tf.identity(column[0])])
        if collective == "reduce":
            with tf.device(devices[0]):
                out = [[tf.add_n(column)]]
        return out
    return build


def _shards(t, num):
    return shard_sizes(t.shape[0], num)


def _call(collective, algorithm):
    def build(tensors, devices):
        kwargs = {"root": 0} if collective in ("broadcast", "reduce") else {}
        out = getattr(tfreduce, collective)(tensors, devices, algorithm=algorithm, **kwargs)
        return [out] if collective == "reduce" else out
    return build


def _contenders(collective, device_type):
    algorithms = ["flat", "hierarchical", "ring", "collective"]
    if device_type == "gpu" and collective in ("broadcast", "reduce"):
        algorithms.append("nccl")
    out = [(a, "tfreduce", f"tfreduce.{collective}(algorithm={a!r})", _call(collective, a))
           for a in algorithms]
    peer = _tf_distribute(collective)
    if peer is not None:
        out.append(("tf.distribute", "tf.distribute", peer[0], peer[1]))
    out.append(("plain", "plain", "add_n / concat / identity on each device", _plain(collective)))
    return out


def _expected(collective, values):
    # The NumPy result on each device (reduce: on the root only).
    num = len(values)
    if collective == "reduce_scatter":
        return np.array_split(np.sum(values, axis=0), num)
    if collective == "all_gather":
        return [np.concatenate(values)] * num
    if collective == "broadcast":
        return [values[0]] * num
    if collective == "reduce":
        return [np.sum(values, axis=0)]
    return [np.concatenate([np.array_split(v, num)[k] for v in values]) for k in range(num)]


def _one(collective, args, devices, log):
    # Builds, checks and times every contender of one collective.
    num = len(devices)
    size = args.total_bytes or 4 * 2**20
    rows = max(1, size // 4 // ROW_ELEMENTS // (num if collective == "all_gather" else 1))
    graph = tf.Graph()
    with graph.as_default():
        variables, tensors = make_inputs([(rows, ROW_ELEMENTS)], devices, tf.float32)
        built = {}
        for name, family, description, build in _contenders(collective, args.device_type):
            with tf.name_scope(name.replace(".", "_")):
                out = build(tensors, devices)
            traffic = analyze_traffic(out, inputs=tensors)
            built[name] = {"family": family, "description": description, "outputs": out,
                           "fetch": consume(out, devices, name.replace(".", "_")),
                           "cross_device_bytes": traffic.total_bytes,
                           "max_sent_bytes": max((traffic.sent(d) for d in traffic.devices),
                                                 default=0)}
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph, config=graph_session_config(
            num, args.device_type)) as sess:
        sess.run(init)
        values = [row[0] for row in sess.run(tensors)]
        want = _expected(collective, values)
        for name, row in built.items():
            got = sess.run(row["outputs"])
            row["correct"] = all(np.array_equal(g[0], w) for g, w in zip(got, want))
        log(f"{collective}: timing {len(built)} contenders x {args.steps} rounds")
        times = time_rounds(sess, {n: r["fetch"] for n, r in built.items()}, args.steps,
                            args.warmup, log)
    bytes_s = rows * ROW_ELEMENTS * 4 * (num if collective == "all_gather" else 1)
    results = []
    for name, row in built.items():
        median = statistics.median(times[name])
        results.append({
            "collective": collective, "name": name, "family": row["family"],
            "description": row["description"], "correct": row["correct"],
            "median_ms": 1e3 * median, "algbw_GB_per_s": bytes_s / median / 1e9,
            "busbw_GB_per_s": bus_bandwidth(collective, bytes_s, median, num) / 1e9,
            "cross_device_bytes": row["cross_device_bytes"],
            "max_sent_bytes": row["max_sent_bytes"]})
    plain = next(r for r in results if r["name"] == "plain")["median_ms"]
    for r in results:
        r["vs_plain"] = r["median_ms"] / plain
    return bytes_s, results


def _predictions(collective, presets, num, bytes_s):
    # The cost model's seconds and bus bandwidth of each tfreduce algorithm
    # built on "/gpu:k" names, per preset.
    out = {}
    rows = max(1, bytes_s // 4 // ROW_ELEMENTS // (num if collective == "all_gather" else 1))
    for preset in presets:
        topology = Topology.preset(preset)
        if topology.num_devices < num:
            continue
        devices = [f"/gpu:{k}" for k in range(num)]
        out[preset] = {}
        for name, _, _, build in _contenders(collective, "gpu"):
            if name in ("tf.distribute", "plain"):
                continue
            with tf.Graph().as_default():
                tensors = []
                for d in devices:
                    with tf.device(d):
                        tensors.append([tf.zeros([rows, ROW_ELEMENTS])])
                seconds = predict(build(tensors, devices), topology, inputs=tensors).seconds
            out[preset][name] = {"ms": 1e3 * seconds, "busbw_GB_per_s": bus_bandwidth(
                collective, bytes_s, seconds, num) / 1e9}
    return out


def run(args, log):
    """The collective mode; returns the JSON-ready result dict.

    Args:
      args: argparse.Namespace from ``cli.parse_args`` (collective, devices,
        total_bytes, steps, warmup, device_type, predict).
      log: callable(str), progress lines.

    Returns:
      dict with keys mode, config, results (one dict per collective and
      contender: median_ms, algbw and busbw in GB/s, correct, cross-device
      bytes, vs_plain: the ratio of medians to the plain baseline),
      predictions (collective -> preset -> contender -> ms and busbw) and
      environment.
    """
    devices = device_names(args.devices, args.device_type)
    results, predictions, sizes = [], {}, {}
    for collective in args.collective:
        sizes[collective], rows = _one(collective, args, devices, log)
        results += rows
        presets = [p for p in (args.predict or []) if p != "host"]
        if presets:
            predictions[collective] = _predictions(collective, presets, args.devices,
                                                   sizes[collective])
    return {"mode": "collective",
            "config": {"devices": devices, "device_type": args.device_type,
                       "bytes": sizes, "steps": args.steps, "warmup": args.warmup,
                       "dtype": "float32"},
            "results": results, "predictions": predictions, "environment": environment()}


def print_result(result, out=None):
    """Prints one table of contenders per collective, and the predicted bus bandwidths."""
    cfg = result["config"]
    header = (f"{'collective':15s} {'contender':14s} {'ok':>3s} {'ms':>9s} {'algbw':>8s} "
              f"{'busbw':>8s} {'vs plain':>9s} {'bytes moved':>12s}")
    print_table(f"K = {len(cfg['devices'])} {cfg['device_type']} devices, float32, median of "
                f"{cfg['steps']} rounds; GB/s as nccl-tests defines them (S per rank: "
                + ", ".join(f"{c} {format_bytes(b)}" for c, b in cfg["bytes"].items()) + ")",
                header, [
                    f"{r['collective']:15s} {r['name']:14s} {'yes' if r['correct'] else 'NO':>3s} "
                    f"{r['median_ms']:9.3f} {r['algbw_GB_per_s']:8.2f} {r['busbw_GB_per_s']:8.2f} "
                    f"{r['vs_plain']:9.2f} {format_bytes(r['cross_device_bytes']):>12s}"
                    for r in result["results"]], out)
    for collective, per_preset in result["predictions"].items():
        presets = list(per_preset)
        names = list(next(iter(per_preset.values()))) if per_preset else []
        print_table(f"{collective}: predicted ms (bus GB/s), tfreduce.predict on GPU names",
                    f"{'contender':14s}" + "".join(f" {p:>20s}" for p in presets), [
                        f"{n:14s}" + "".join(_cell(per_preset[p][n]) for p in presets)
                        for n in names], out)


def _cell(prediction):
    return f" {prediction['ms']:9.3f} ({prediction['busbw_GB_per_s']:6.1f})"
