"""The scaling mode: build time, op count and step time over a grid of K and N.

Each (algorithm, K, N) cell is built into its own graph on N small tensors
per device and run in its own session; costs are also given per K*N.
"""

import statistics
import time

import tensorflow as tf

import tfreduce
from tfreduce.bench.contenders import Contender, tfreduce_builder
from tfreduce.bench.harness import (consume, device_names, environment, graph_session_config,
                                    input_values, warm_up)
from tfreduce.bench.tables import print_table
from tfreduce.bench.units import format_bytes

__all__ = ["run", "print_result"]


def _inputs(num_tensors, elements, devices):
    # One variable per device split into N equal pieces: a split along the
    # first dimension into 64-byte-aligned pieces shares the buffer, so the
    # inputs cost K ops, not K*N as with one variable per tensor.
    variables, grads = [], []
    for k, device in enumerate(devices):
        with tf.device(device):
            v = tf.Variable(input_values([num_tensors * elements], tf.float32, [k, 0]),
                            trainable=False, name=f"tower{k}_grads")
            read = tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=tf.float32)
            grads.append(tf.split(read, num_tensors, name=f"tower{k}_split"))
        variables.append(v)
    return variables, grads


def run(args, log):
    """The scaling mode: cost of tfreduce algorithms over a grid of K and N.

    Args:
      args: argparse.Namespace from ``cli.parse_args``.
      log: callable(str), progress lines.

    Returns:
      dict with keys mode, config, results (one dict per algorithm, K and N:
      num_ops, build_s in CPU seconds, step_ms, and each per K*N) and
      environment.
    """
    counts = args.grid_devices or [2, 4, 8, 16, 32]
    sizes = args.grid_tensors or [10, 100, 1000]
    algorithms = args.algorithms or ["flat", "hierarchical", "flat+pack", "hierarchical+pack",
                                     "ring+pack"]
    elements = max(16, args.tensor_bytes // 4 // 16 * 16)
    average = args.reduce == "mean"
    rows = []
    for name in algorithms:
        algorithm, _, packed = name.partition("+")
        pack_bytes = args.pack_bytes[0] if packed else None
        warm_up([Contender(name, algorithm, name, tfreduce_builder(algorithm, pack_bytes))],
                device_names(counts[0], args.device_type), average, tf.float32)
        for num_devices in counts:
            for num_tensors in sizes:
                num_ops, build_s, step_s = _measure(
                    args, algorithm, pack_bytes, num_devices, num_tensors, elements)
                cells = num_devices * num_tensors
                rows.append({"algorithm": name, "devices": num_devices, "tensors": num_tensors,
                             "num_ops": num_ops, "build_s": build_s, "step_ms": 1e3 * step_s,
                             "build_us_per_cell": 1e6 * build_s / cells,
                             "step_us_per_cell": 1e6 * step_s / cells,
                             "ops_per_cell": num_ops / cells})
                log(f"{name} K={num_devices} N={num_tensors}: {num_ops} ops, build "
                    f"{build_s:.2f} s, step {1e3 * step_s:.2f} ms")
    return {
        "mode": "scaling",
        "config": {"tensor_bytes": 4 * elements, "reduce": args.reduce, "steps": args.steps,
                   "pack_bytes": args.pack_bytes[0], "device_type": args.device_type},
        "results": rows,
        "environment": environment(),
    }


def _measure(args, algorithm, pack_bytes, num_devices, num_tensors, elements):
    # One cell: builds K x N float32 tensors of `elements` each and their
    # reduction in a new graph and times it in a new session. Returns
    # (ops built, build CPU seconds, median step seconds).
    average = args.reduce == "mean"
    devices = device_names(num_devices, args.device_type)
    graph = tf.Graph()
    with graph.as_default():
        variables, grads = _inputs(num_tensors, elements, devices)
        before = len(graph.get_operations())
        start = time.thread_time()
        out = tfreduce.allreduce_grads(grads, devices, average=average,
                                       algorithm=algorithm, pack_bytes=pack_bytes)
        build_s = time.thread_time() - start
        num_ops = len(graph.get_operations()) - before
        fetch = consume(out, devices, "step")
        init = tf.compat.v1.initializers.variables(variables)
    config = graph_session_config(num_devices, args.device_type)
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        sess.run(init)
        for _ in range(max(args.warmup, 1)):
            sess.run(fetch)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            sess.run(fetch)
            times.append(time.perf_counter() - start)
    return num_ops, build_s, statistics.median(times)


def print_result(result, out=None):
    """Prints one line per (algorithm, K, N) cell of ``run``'s result; /KN: per K*N."""
    cfg = result["config"]
    title = (f"K devices x N tensors of {format_bytes(cfg['tensor_bytes'])}, {cfg['reduce']}, "
             f"median of {cfg['steps']} steps; +pack = pack_bytes {cfg['pack_bytes']}")
    header = (f"{'algorithm':18s} {'K':>3s} {'N':>5s} {'ops':>8s} {'ops/KN':>7s} "
              f"{'build s':>8s} {'build us/KN':>12s} {'step ms':>9s} {'step us/KN':>11s}")
    print_table(title, header, [
        f"{r['algorithm']:18s} {r['devices']:3d} {r['tensors']:5d} {r['num_ops']:8d} "
        f"{r['ops_per_cell']:7.1f} {r['build_s']:8.3f} {r['build_us_per_cell']:12.1f} "
        f"{r['step_ms']:9.2f} {r['step_us_per_cell']:11.2f}"
        for r in result["results"]], out)
