"""How the benchmark builds, checks and times a reduction in one v1 Session.

Inputs are read from variables on their towers' devices; a contender's
outputs are consumed by one ``NoOp`` per device joined by one fetched
``NoOp``; the session runs the graph as built (no Grappler), a traced check
run compares values with NumPy and counts ops that did not run, and timed
rounds rotate the order of the rows.
"""

import datetime
import json
import os
import platform
import time

import numpy as np
import tensorflow as tf

from tfreduce.analysis.traffic import analyze_traffic
from tfreduce.basis.devices import canonical_or_empty

__all__ = ["device_names", "graph_session_config", "consume", "input_values", "make_inputs",
           "make_floor", "time_rounds", "warm_up", "build_contender", "check", "environment",
           "processes_result"]


def device_names(num_devices, device_type):
    """K canonical device strings of the given type.

    Args:
      num_devices: int K.
      device_type: "cpu" or "gpu".

    Returns:
      list of K str, "/device:CPU:0" ... (or GPU); nothing is checked or created.
    """
    kind = "GPU" if device_type == "gpu" else "CPU"
    return [f"/device:{kind}:{k}" for k in range(num_devices)]


def graph_session_config(num_devices, device_type):
    """A ConfigProto with K devices that runs graphs as they were built.

    Grappler's meta optimizer is off: it removes ops whose outputs only feed
    control dependencies (the way the benchmark consumes outputs), which
    would make steps time nothing. The classic graph optimizer is at L0 (no
    common subexpression elimination or constant folding), so every op a
    contender builds runs, which the check run verifies.

    Args:
      num_devices: int K, the number of CPU devices the session makes
        (``device_count``); ignored for GPUs.
      device_type: "cpu" or "gpu" (GPU memory grows as needed).

    Returns:
      tf.compat.v1.ConfigProto.
    """
    if device_type == "gpu":
        config = tf.compat.v1.ConfigProto()
        config.gpu_options.allow_growth = True
    else:
        config = tf.compat.v1.ConfigProto(device_count={"CPU": num_devices})
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    config.graph_options.optimizer_options.opt_level = tf.compat.v1.OptimizerOptions.L0
    return config


def consume(outputs, devices, name):
    """A fetchable op that runs after every output: one NoOp per device, then one.

    Each device's outputs are joined on that device, so only K control edges
    cross devices (a cross-device control edge is a Send/Recv pair; one per
    output would time the consumer instead of the reduction).

    Args:
      outputs: nested lists of tf.Tensor / tf.IndexedSlices / None, e.g. K x N.
      devices: list of K device strings; an output without a device counts
        as on devices[0].
      name: str, prefix of the NoOps' names.

    Returns:
      tf.Operation, the final NoOp on devices[0].
    """
    by_device = {}
    for t in _flatten(outputs):
        spec = canonical_or_empty(t.op.device or devices[0])
        by_device.setdefault(spec, []).append(t.op)
    joins = []
    for i, (device, ops) in enumerate(sorted(by_device.items())):
        with tf.device(device), tf.control_dependencies(ops):
            joins.append(tf.no_op(name=f"{name}_join{i}"))
    with tf.device(devices[0]), tf.control_dependencies(joins):
        return tf.no_op(name=f"{name}_done")


def _flatten(nested):
    if isinstance(nested, (list, tuple)):
        return [t for item in nested for t in _flatten(item)]
    if isinstance(nested, tf.IndexedSlices):
        return [nested.values, nested.indices]
    return [] if nested is None else [nested]


def input_values(shape, dtype, seed):
    """Seeded input values that every contender must sum exactly.

    Args:
      shape: list of ints.
      dtype: tf.DType, a floating type.
      seed: [int, int], the stateless seed (e.g. [tower, tensor]).

    Returns:
      tf.Tensor of ``shape`` and ``dtype``, multiples of 1/4 in [-8, 8].
    """
    # Multiples of 1/4 in [-8, 8]: sums over any K of practical size are
    # exact in float32, so every contender must match NumPy exactly.
    ints = tf.random.stateless_uniform(shape, seed=seed, minval=-32, maxval=33, dtype=tf.int32)
    return tf.cast(ints, dtype) * tf.constant(0.25, dtype)


def make_inputs(shapes, devices, dtype):
    """K x N gradients, each read from its own variable on its tower's device.

    Args:
      shapes: list of N shapes (tuples of ints).
      devices: list of K device strings.
      dtype: tf.DType of the gradients.

    Returns:
      (variables, grads): K x N ``tf.Variable`` and the K x N tensors read
      from them (``ReadVariableOp``, no copy); grads[k][n] is on devices[k].
    """
    variables, grads = [], []
    for k, device in enumerate(devices):
        with tf.device(device):
            row = [tf.Variable(input_values(s, dtype, [k, n]), trainable=False,
                               name=f"tower{k}_grad{n}") for n, s in enumerate(shapes)]
            variables.append(row)
            # v.value() would leave the read unplaced (the placer colocates it
            # later); tensors must carry their device for traffic analysis
            # and for tf.distribute, which takes devices from its values.
            grads.append([tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=dtype,
                                                    name=f"tower{k}_read{n}")
                          for n, v in enumerate(row)])
    return variables, grads


def make_floor(total_elements, devices, dtype):
    """The memory floor: one add_n on device 0 of K flat buffers of S bytes.

    Args:
      total_elements: int, elements of one tower's gradients (S / dtype size).
      devices: list of K device strings.
      dtype: tf.DType.

    Returns:
      (variables, sum): the K buffers (variable k on devices[k]) and their
      ``add_n``, shape [total_elements], on devices[0].
    """
    buffers, reads = [], []
    for k, device in enumerate(devices):
        with tf.device(device):
            buffers.append(tf.Variable(input_values([total_elements], dtype, [k, -1]),
                                       trainable=False, name=f"floor_tower{k}"))
            reads.append(tf.raw_ops.ReadVariableOp(resource=buffers[-1].handle, dtype=dtype,
                                                   name=f"floor_read{k}"))
    with tf.device(devices[0]):
        total = tf.add_n(reads, name="floor_sum")
    return buffers, total


def time_rounds(session, fetches, steps, warmup, log):
    """Runs every fetch once per round, in an order that rotates each round.

    Args:
      session: tf.compat.v1.Session.
      fetches: dict row name -> fetch.
      steps: int, timed rounds.
      warmup: int, untimed runs of each fetch first.
      log: callable(str), progress.

    Returns:
      dict row name -> list of ``steps`` wall times in seconds.
    """
    names = list(fetches)
    for name in names:
        for _ in range(warmup):
            session.run(fetches[name])
    times = {name: [] for name in names}
    for r in range(steps):
        # Rotate the order so no row always runs right after the same other.
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            session.run(fetches[name])
            times[name].append(time.perf_counter() - start)
        log(f"  round {r + 1}/{steps}")
    return times


def warm_up(chosen, devices, average, dtype):
    """Builds every contender once, in a throwaway graph, on two small tensors.

    Args:
      chosen: list of Contender.
      devices: list of K device strings.
      average: bool, mean (True) or sum.
      dtype: tf.DType.
    """
    # The first build of each code path pays one-off costs (imports, op
    # definitions, caches); a throwaway build of two small tensors takes
    # them, so the timed builds compare the algorithms.
    with tf.Graph().as_default():
        grads = []
        for device in devices:
            with tf.device(device):
                grads.append([tf.zeros([4], dtype), tf.zeros([2, 3], dtype)])
        for c in chosen:
            c.build(grads, devices, average)


def build_contender(contender, graph, grads, devices, average):
    """Builds one contender into the shared graph and describes what it built.

    Args:
      contender: Contender.
      graph: tf.Graph, the default graph, holding ``grads``.
      grads: K x N input tensors, grads[k][n] on devices[k].
      devices: list of K device strings.
      average: bool, mean (True) or sum.

    Returns:
      dict: name, family, description, build_s (CPU seconds of the building
      thread), build_wall_s, num_ops, max_sent_bytes, max_pair_bytes,
      cross_device_bytes, longest_hop_chain (from ``analyze_traffic``);
      outputs (K x N), op_names (set of str) and fetch (the ``consume`` op),
      which are not JSON.
    """
    # Build time is the building thread's CPU time, which other processes on
    # the machine do not inflate; build_wall_s is the elapsed time.
    before = len(graph.get_operations())
    start, start_cpu = time.perf_counter(), time.thread_time()
    with tf.name_scope(contender.name.replace("+", "_")):
        out = contender.build(grads, devices, average)
    build_cpu_s = time.thread_time() - start_cpu
    build_wall_s = time.perf_counter() - start
    ops = graph.get_operations()[before:]
    traffic = analyze_traffic(out, inputs=grads)
    return {
        "name": contender.name, "family": contender.family,
        "description": contender.description, "build_s": build_cpu_s,
        "build_wall_s": build_wall_s, "num_ops": len(ops),
        "max_sent_bytes": max((traffic.sent(d) for d in traffic.devices), default=0),
        "max_pair_bytes": max(traffic.pair_bytes.values(), default=0),
        "cross_device_bytes": traffic.total_bytes,
        "longest_hop_chain": traffic.longest_hop_chain,
        "outputs": out, "op_names": {op.name for op in ops},
        "fetch": consume(out, devices, contender.name.replace("+", "_")),
    }


def check(sess, row, fetch, inputs, average, dtype, roundoff=0.0):
    """One traced run of the timed fetch that also fetches every output.

    Compares the values with NumPy and the step stats with the ops built;
    sets row["max_abs_error"] (float), row["relative_error"] (float, of
    the largest value), row["correct"] (bool; None for an approximation)
    and row["ops_not_run"] (int, 0 when nothing was pruned).

    Args:
      sess: tf.compat.v1.Session of the graph.
      row: dict from ``build_contender`` (uses "outputs" and "op_names").
      fetch: the contender's ``consume`` op.
      inputs: K x N NumPy arrays, the input gradients' values.
      average: bool, mean (True) or sum.
      dtype: tf.DType of the gradients.
      roundoff: float, the relative rounding a compressed contender adds
        (each input and the result rounded to its wire dtype); None for an
        approximation (PowerSGD), which is not judged.
    """
    metadata = tf.compat.v1.RunMetadata()
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    _, got = sess.run([fetch, row["outputs"]], options=options, run_metadata=metadata)
    error, scale = _max_error(got, inputs, average)
    # Sums of multiples of 1/4 are exact; allow the rounding of a mean by
    # 1/K and of half-precision sums formed in their own dtype.
    eps = max(float(np.finfo(dtype.as_numpy_dtype).eps), roundoff or 0.0)
    tolerance = 4 * len(inputs) * eps * scale
    row["max_abs_error"] = error
    row["relative_error"] = error / scale
    row["correct"] = None if roundoff is None else bool(error <= tolerance)
    row["ops_not_run"] = len(row["op_names"] - _executed_nodes(metadata))


def _expected(values, average):
    total = np.sum([v.astype(np.float64) for v in values], axis=0)
    return total / len(values) if average else total


def _max_error(got_rows, inputs, average):
    worst, scale = 0.0, 1.0
    for n in range(len(inputs[0])):
        want = _expected([row[n] for row in inputs], average)
        scale = max(scale, float(np.max(np.abs(want), initial=0.0)))
        for row in got_rows:
            got = np.asarray(row[n], dtype=np.float64)
            if got.shape != want.shape:
                return float("inf"), scale
            worst = max(worst, float(np.max(np.abs(got - want), initial=0.0)))
    return worst, scale


def _executed_nodes(run_metadata):
    return {node.node_name for dev in run_metadata.step_stats.dev_stats
            for node in dev.node_stats}


def environment():
    """Versions, machine and UTC time of this run.

    Returns:
      dict of str/int: tensorflow, python, platform, cpus, date, and
      tensorpack when installed.
    """
    env = {"tensorflow": tf.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "cpus": os.cpu_count(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import tensorpack
        env["tensorpack"] = tensorpack.__version__
    except ImportError:
        pass
    return env


def processes_result(run, command, path, who, **options):
    """Runs a command that starts several processes; returns the JSON rank 0 wrote to `path`.

    Args:
      run: ``subprocess.run`` (or a stand-in with its signature).
      command: list of str.
      path: str, the file rank 0 writes.
      who: str, what failed in the error ("the workers").
      **options: more keywords of `run` (env, timeout).

    Raises:
      RuntimeError: the command failed (its output's end is in the message).
    """
    done = run(command, capture_output=True, text=True, **options)
    if done.returncode != 0:
        raise RuntimeError(f"{who} failed (exit {done.returncode}):\n"
                           f"{done.stdout[-2000:]}{done.stderr[-3000:]}")
    with open(path) as f:
        return json.load(f)
