"""tfreduce-bench: all-reduce speed against tensorpack, tf.distribute and the memory floor.

Three modes, all on K logical CPU devices (default) or K real GPUs:

``allreduce`` (default)
  Gradient shapes from a Keras application model (ResNet50 by default, built
  with ``weights=None``: nothing is downloaded) or N synthetic tensors,
  optionally rescaled to a total size. Contenders, all built into one graph
  on the same K x N inputs and run in one ``tf.compat.v1.Session``:

  - every tfreduce algorithm that runs on the devices, without packing and
    with packing (``--pack-bytes``, default ``packing.DEFAULT_PACK_BYTES``);
  - tensorpack's ``allreduce_grads_hierarchical`` (when installed; it
    asserts K == 8, so only then);
  - tf.distribute's ``HierarchicalCopyAllReduce`` (even K: it splits the
    devices into two equal halves and silently drops the last device of an
    odd K) and ``ReductionToOneDevice``, through their ``batch_reduce`` on
    ``PerReplica`` values, as MirroredStrategy calls them.

  TF collective ops (``CollectiveReduceV2``, TF's ring on CPUs) are the
  tfreduce ``collective`` contender.

  Two reference rows are timed in the same run: ``floor``, one ``add_n`` on
  device 0 of K buffers of S bytes each (S = one tower's gradients), which
  reads K*S and writes S bytes, the least memory traffic any all-reduce on
  shared memory can make (a mean adds a pass over S to scale); and
  ``inputs``, which only reads the K x N input gradients, the per-op cost
  every contender pays before reducing anything.

``train``
  Images per second of ``tfreduce.ReplicatedTrainer.train_step`` against
  Keras ``model.fit`` under ``tf.distribute.MirroredStrategy`` on the same
  model (the CNN of examples/image_classification.py), data and K.

``scaling``
  Build time, op count and step time of tfreduce algorithms for K devices x
  N small tensors over a grid of K and N, and both per K*N.

How it measures (allreduce and scaling): each contender's outputs are
consumed by one ``NoOp`` per device with control dependencies on that
device's outputs, joined by one ``NoOp`` that is fetched. The session runs
the graph as built: Grappler's meta optimizer is off (it removes ops whose
outputs only feed control dependencies, which would time nothing) and so
are common-subexpression elimination and constant folding. A check run
fetches every output once, compares it with NumPy's sum (inputs are
multiples of 1/4, so float32 sums are exact) and counts, from the run's step
stats, the contender's ops that did not run (0: nothing was pruned). Then
every contender, the floor and the inputs row run once per round, in an
order that rotates each round, for ``--steps`` rounds after ``--warmup``
untimed runs. The report gives medians and quartiles, ratios to the floor
and between all contenders, the graph-build time (CPU time of the building
thread, after a throwaway build of every contender has paid one-off costs)
and op count, and the cross-device bytes from ``tfreduce.analyze_traffic``.
``--json`` writes everything, ``--png`` draws a bar chart (matplotlib).

The train mode times steady-state steps: ``train_step`` returns the loss as
a float, and a Keras callback reads the loss after every ``fit`` step, so
both wait for each step; fit's per-call set-up and first step are left out.

    tfreduce-bench --devices 8 --model resnet50 --json resnet50.json
    python -m tfreduce.bench --model resnet50 --total-bytes 1MB --png 1mb.png
"""

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

import tfreduce
from tfreduce.packing import DEFAULT_PACK_BYTES
from tfreduce.traffic import analyze_traffic

__all__ = ["main", "parse_bytes", "format_bytes", "gradient_shapes"]

MODES = ("allreduce", "train", "scaling")
FAMILIES = ("flat", "hierarchical", "ring", "collective", "nccl", "tensorpack",
            "tf-hierarchical-copy", "tf-reduction-to-one-device")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text):
    """Parses a byte count such as ``"4MiB"``, ``"1MB"``, ``"65536"`` or ``"0"``.

    KB/MB/GB are powers of 10, KiB/MiB/GiB powers of 2; case does not matter.

    Args:
      text: str.

    Returns:
      int, bytes.

    Raises:
      ValueError: if ``text`` is not a number with an optional unit.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not match or match.group(2) not in _UNITS:
        raise ValueError(f"{text!r} is not a byte count; write e.g. 65536, 64KiB, 4MiB or 1MB")
    return int(round(float(match.group(1)) * _UNITS[match.group(2)]))


def format_bytes(num):
    """``4194304 -> "4MiB"``, ``1000000 -> "1MB"``, ``1536 -> "1.5KiB"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= size and num % (size // 4) == 0:
            return f"{num / size:g}{unit}"
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if num >= size:
            return f"{num / size:.3g}{unit}"
    return f"{num}B"


def _keras_application(name):
    import keras  # Only the model modes need Keras; it is slow to import.
    builders = {attr.lower(): getattr(keras.applications, attr)
                for attr in dir(keras.applications)
                if attr[:1].isupper() and callable(getattr(keras.applications, attr))}
    key = name.lower().replace("_", "")
    if key not in builders:
        raise ValueError(f"unknown Keras application {name!r}; choose 'synthetic' or one "
                         f"of {sorted(builders)}")
    return builders[key]


def gradient_shapes(model, num_tensors=100, total_bytes=None, dtype_size=4):
    """The gradient shapes to reduce: a Keras model's trainable tensors, or synthetic.

    Args:
      model: "synthetic", or the name of a ``keras.applications`` model in
        any case ("resnet50", "MobileNetV2"); it is built with
        ``weights=None`` (nothing is downloaded) and its trainable weights'
        shapes are returned (ResNet50: 214 tensors, 25,583,592 elements).
      num_tensors: int N for "synthetic".
      total_bytes: int or None. For "synthetic", the total size of the N
        equal tensors (default N * 4 KiB). For a model, every tensor is
        rescaled to about ``size * total_bytes / model_bytes`` (at least one
        element) and flattened to 1-D, so the same N tensors keep their
        relative sizes at another total.
      dtype_size: int, bytes per element.

    Returns:
      list of N tuples of ints.

    Raises:
      ValueError: unknown model, or num_tensors / total_bytes < 1.
    """
    if model == "synthetic":
        if num_tensors < 1:
            raise ValueError(f"--num-tensors must be >= 1, got {num_tensors}")
        total = (num_tensors * 4096) if total_bytes is None else total_bytes
        each = max(1, total // (num_tensors * dtype_size))
        return [(each,)] * num_tensors
    net = _keras_application(model)(weights=None)
    shapes = [tuple(int(d) for d in w.shape) for w in net.trainable_weights]
    del net
    if total_bytes is None:
        return shapes
    if total_bytes < 1:
        raise ValueError(f"--total-bytes must be >= 1, got {total_bytes}")
    scale = total_bytes / (sum(int(np.prod(s)) for s in shapes) * dtype_size)
    return [(max(1, int(round(int(np.prod(s)) * scale))),) for s in shapes]


class Contender:
    """One all-reduce implementation under test.

    Args:
      name: str, the row label.
      family: str, one of FAMILIES (what ``--contenders`` selects).
      description: str, what it builds.
      build: callable ``(grads, devices, average) -> K x N outputs``.
    """

    def __init__(self, name, family, description, build):
        self.name = name
        self.family = family
        self.description = description
        self.build = build


def _tfreduce_builder(algorithm, pack_bytes):
    def build(grads, devices, average):
        return tfreduce.allreduce_grads(grads, devices, average=average, algorithm=algorithm,
                                        pack_bytes=pack_bytes)
    return build


def _tensorpack_build(grads, devices, average):
    from tensorpack.graph_builder.utils import allreduce_grads_hierarchical
    return [list(row) for row in allreduce_grads_hierarchical(grads, devices, average=average)]


def _tf_distribute_builder(make_ops):
    def build(grads, devices, average):
        from tensorflow.python.distribute import values as values_lib
        per_variable = [values_lib.PerReplica([grads[k][n] for k in range(len(devices))])
                        for n in range(len(grads[0]))]
        op = tf.distribute.ReduceOp.MEAN if average else tf.distribute.ReduceOp.SUM
        # Destinations = the values themselves: an all-reduce, every device
        # gets the result, as MirroredStrategy reduces gradients.
        mirrored = make_ops().batch_reduce(op, [(v, v) for v in per_variable])
        return [[m.values[k] for m in mirrored] for k in range(len(devices))]
    return build


def contenders(num_devices, device_type, pack_sizes, packing="both"):
    """The contenders that can run here, and the others with the reason.

    Args:
      num_devices: int K.
      device_type: "cpu" or "gpu".
      pack_sizes: list of int, pack_bytes of the packed variants.
      packing: "both", "on" (packed variants only) or "off".

    Returns:
      (list of Contender, dict name -> reason skipped).
    """
    algorithms = ["flat", "hierarchical", "ring", "collective"]
    if device_type == "gpu":
        algorithms.append("nccl")
    out, skipped = [], {}
    for algorithm in algorithms:
        if packing in ("both", "off"):
            out.append(Contender(algorithm, algorithm, f"tfreduce {algorithm}, unpacked",
                                 _tfreduce_builder(algorithm, None)))
        if packing in ("both", "on"):
            for size in pack_sizes:
                out.append(Contender(
                    f"{algorithm}+pack{format_bytes(size)}", algorithm,
                    f"tfreduce {algorithm}, pack_bytes={size}",
                    _tfreduce_builder(algorithm, size)))
    try:
        import tensorpack.graph_builder.utils  # noqa: F401
    except ImportError as error:
        skipped["tensorpack"] = f"tensorpack is not installed ({error})"
    else:
        if num_devices == 8:
            out.append(Contender("tensorpack", "tensorpack",
                                 "tensorpack.graph_builder.utils.allreduce_grads_hierarchical",
                                 _tensorpack_build))
        else:
            skipped["tensorpack"] = f"asserts K == 8, here K = {num_devices}"
    if num_devices % 2 == 0:
        out.append(Contender(
            "tf-hierarchical-copy", "tf-hierarchical-copy",
            "tf.distribute.HierarchicalCopyAllReduce().batch_reduce (num_packs=1)",
            _tf_distribute_builder(tf.distribute.HierarchicalCopyAllReduce)))
    else:
        skipped["tf-hierarchical-copy"] = (
            f"splits the devices into two equal groups; with odd K = {num_devices} it "
            f"leaves one device out of the sum")
    out.append(Contender(
        "tf-reduction-to-one-device", "tf-reduction-to-one-device",
        "tf.distribute.ReductionToOneDevice().batch_reduce (sum on device 0)",
        _tf_distribute_builder(tf.distribute.ReductionToOneDevice)))
    return out, skipped


def device_names(num_devices, device_type):
    """K canonical device strings of the given type."""
    kind = "GPU" if device_type == "gpu" else "CPU"
    return [f"/device:{kind}:{k}" for k in range(num_devices)]


def session_config(num_devices, device_type):
    """A ConfigProto with K devices that runs graphs as they were built.

    Grappler's meta optimizer is off: it removes ops whose outputs only feed
    control dependencies (the way the benchmark consumes outputs), which
    would make steps time nothing. The classic graph optimizer is at L0 (no
    common subexpression elimination or constant folding), so every op a
    contender builds runs, which the check run verifies.
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
    """
    by_device = {}
    for t in _flatten(outputs):
        spec = tf.DeviceSpec.from_string(t.op.device or devices[0]).to_string()
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


def _input_values(shape, dtype, seed):
    # Multiples of 1/4 in [-8, 8]: sums over any K of practical size are
    # exact in float32, so every contender must match NumPy exactly.
    ints = tf.random.stateless_uniform(shape, seed=seed, minval=-32, maxval=33, dtype=tf.int32)
    return tf.cast(ints, dtype) * tf.constant(0.25, dtype)


def make_inputs(shapes, devices, dtype):
    """K x N gradients, each read from its own variable on its tower's device.

    Returns:
      (variables, grads): K x N ``tf.Variable`` and the K x N tensors read
      from them (``ReadVariableOp``, no copy).
    """
    variables, grads = [], []
    for k, device in enumerate(devices):
        with tf.device(device):
            row = [tf.Variable(_input_values(s, dtype, [k, n]), trainable=False,
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

    Returns:
      (variables, sum): the K buffers and their ``add_n``.
    """
    buffers, reads = [], []
    for k, device in enumerate(devices):
        with tf.device(device):
            buffers.append(tf.Variable(_input_values([total_elements], dtype, [k, -1]),
                                       trainable=False, name=f"floor_tower{k}"))
            reads.append(tf.raw_ops.ReadVariableOp(resource=buffers[-1].handle, dtype=dtype,
                                                   name=f"floor_read{k}"))
    with tf.device(devices[0]):
        total = tf.add_n(reads, name="floor_sum")
    return buffers, total


def _quartiles(samples):
    if len(samples) < 2:
        return samples[0], samples[0]
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return q[0], q[2]


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


def _time_rounds(session, fetches, steps, warmup, log):
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


def run_allreduce(args, log):
    """The allreduce mode; returns the JSON-ready result dict."""
    dtype = tf.as_dtype(args.dtype)
    devices = device_names(args.devices, args.device_type)
    shapes = gradient_shapes(args.model, args.num_tensors, args.total_bytes, dtype.size)
    sizes = [int(np.prod(s)) for s in shapes]
    total_bytes = sum(sizes) * dtype.size
    average = args.reduce == "mean"
    chosen, skipped = contenders(args.devices, args.device_type, args.pack_bytes, args.packing)
    if args.contenders:
        wanted = set(args.contenders)
        skipped.update({c.name: "not selected by --contenders" for c in chosen
                        if c.family not in wanted})
        chosen = [c for c in chosen if c.family in wanted]
    log(f"{len(shapes)} tensors, {format_bytes(total_bytes)} per tower, {args.dtype}, "
        f"{args.reduce}, K={args.devices} {args.device_type} devices; "
        f"{len(chosen)} contenders")

    _warm_up(chosen, devices, average, dtype)
    graph = tf.Graph()
    with graph.as_default():
        variables, grads = make_inputs(shapes, devices, dtype)
        floor_vars, floor_sum = make_floor(sum(sizes), devices, dtype)
        fetches = {"floor": consume([floor_sum], devices, "floor"),
                   "inputs": consume(grads, devices, "inputs")}
        rows = {}
        for c in chosen:
            rows[c.name] = _build(c, graph, grads, devices, average)
            fetches[c.name] = rows[c.name].pop("fetch")
            log(f"built {c.name}: {rows[c.name]['num_ops']} ops in "
                f"{rows[c.name]['build_s']:.2f} s")
        init = tf.compat.v1.initializers.variables(
            [v for row in variables for v in row] + floor_vars)

    with tf.compat.v1.Session(graph=graph,
                              config=session_config(args.devices, args.device_type)) as sess:
        sess.run(init)
        inputs = sess.run(grads) if args.check else None
        for c in chosen:
            row = rows[c.name]
            start = time.perf_counter()
            sess.run(fetches[c.name])
            row["first_step_s"] = time.perf_counter() - start
            if args.check:
                _check(sess, row, fetches[c.name], inputs, average, dtype)
                log(f"checked {c.name}: max error {row['max_abs_error']:g}, "
                    f"{row['ops_not_run']} of its ops did not run")
        log(f"timing {len(fetches)} rows x {args.steps} rounds")
        times = _time_rounds(sess, fetches, args.steps, args.warmup, log)

    medians = {name: statistics.median(t) for name, t in times.items()}
    results = []
    for name in ["floor", "inputs"] + [c.name for c in chosen]:
        q1, q3 = _quartiles(times[name])
        entry = {"name": name, "median_ms": 1e3 * medians[name], "q1_ms": 1e3 * q1,
                 "q3_ms": 1e3 * q3, "min_ms": 1e3 * min(times[name]),
                 "x_floor": medians[name] / medians["floor"]}
        if name in rows:
            entry["net_ms"] = 1e3 * (medians[name] - medians["inputs"])
            entry.update({k: v for k, v in rows[name].items()
                          if k not in ("outputs", "op_names")})
        results.append(entry)
    names = [c.name for c in chosen]
    return {
        "mode": "allreduce",
        "config": {
            "model": args.model, "num_tensors": len(shapes), "bytes_per_tower": total_bytes,
            "dtype": args.dtype, "reduce": args.reduce, "devices": devices,
            "device_type": args.device_type, "steps": args.steps, "warmup": args.warmup,
            "pack_bytes": args.pack_bytes,
        },
        "floor": {
            "definition": "add_n on device 0 of K buffers of S bytes: reads K*S, writes S",
            "median_ms": 1e3 * medians["floor"],
            "GB_per_s": (args.devices + 1) * total_bytes / medians["floor"] / 1e9,
        },
        "results": results,
        "ratios": {a: {b: medians[a] / medians[b] for b in names} for a in names},
        "skipped": skipped,
        "environment": _environment(),
    }


def _warm_up(chosen, devices, average, dtype):
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


def _build(contender, graph, grads, devices, average):
    # Builds one contender into the shared graph and describes what it built.
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


def _check(sess, row, fetch, inputs, average, dtype):
    # One traced run of the timed fetch that also fetches every output: the
    # values against NumPy, and the step stats against the ops built.
    metadata = tf.compat.v1.RunMetadata()
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    _, got = sess.run([fetch, row["outputs"]], options=options, run_metadata=metadata)
    error, scale = _max_error(got, inputs, average)
    # Sums of multiples of 1/4 are exact; allow the rounding of a mean by
    # 1/K and of half-precision sums formed in their own dtype.
    tolerance = 4 * len(inputs) * float(np.finfo(dtype.as_numpy_dtype).eps) * scale
    row["max_abs_error"] = error
    row["correct"] = bool(error <= tolerance)
    row["ops_not_run"] = len(row["op_names"] - _executed_nodes(metadata))


def _environment():
    env = {"tensorflow": tf.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "cpus": os.cpu_count(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import tensorpack
        env["tensorpack"] = tensorpack.__version__
    except ImportError:
        pass
    return env


def print_allreduce(result, out=None):
    """Prints the allreduce result as a table to ``out`` (a file; None: stdout).

    ``net ms`` is the median minus the ``inputs`` row's median: an estimate
    of the reduction's own time, without the reads of the K x N inputs.
    ``build s`` is the CPU time of the thread that built the graph.
    """
    cfg = result["config"]
    print(f"\n{cfg['model']}: {cfg['num_tensors']} tensors, "
          f"{format_bytes(cfg['bytes_per_tower'])} per tower, {cfg['dtype']} {cfg['reduce']}, "
          f"K={len(cfg['devices'])}; median of {cfg['steps']} steps; floor "
          f"{result['floor']['median_ms']:.2f} ms = {result['floor']['GB_per_s']:.1f} GB/s",
          file=out)
    header = (f"{'contender':30s} {'median ms':>10s} {'q1-q3 ms':>15s} {'x floor':>8s} "
              f"{'net ms':>7s} {'build s':>8s} {'ops':>7s} {'max sent/dev':>12s} {'hops':>5s} "
              f"{'ok':>3s}")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in result["results"]:
        extra = ""
        if "build_s" in r:
            ok = {True: "yes", False: "NO"}.get(r.get("correct"), "-")
            extra = (f" {r['net_ms']:7.2f} {r['build_s']:8.2f} {r['num_ops']:7d} "
                     f"{format_bytes(r['max_sent_bytes']):>12s} {r['longest_hop_chain']:5d} "
                     f"{ok:>3s}")
        extra = extra or f" {'':7s}"
        print(f"{r['name']:30s} {r['median_ms']:10.2f} "
              f"{r['q1_ms']:7.2f}-{r['q3_ms']:<7.2f} {r['x_floor']:8.2f}{extra}", file=out)
    for name, reason in result["skipped"].items():
        print(f"skipped {name}: {reason}", file=out)


def plot_allreduce(result, path):
    """Writes a horizontal bar chart of median step times to ``path`` (PNG).

    Uses matplotlib's Agg canvas directly, so the caller's pyplot backend and
    state are left alone.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = result["results"]
    medians = [r["median_ms"] for r in rows]
    errors = [[r["median_ms"] - r["q1_ms"] for r in rows],
              [r["q3_ms"] - r["median_ms"] for r in rows]]
    colors = ["0.6" if "family" not in r else
              ("C0" if r["family"] in FAMILIES[:5] else "C1") for r in rows]
    fig = Figure(figsize=(8, 0.35 * len(rows) + 1.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.barh(range(len(rows)), medians, xerr=errors, color=colors)
    ax.axvline(result["floor"]["median_ms"], color="k", linestyle=":", linewidth=1)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["name"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("median step (ms); whiskers: quartiles; dotted: memory floor; "
                  "blue: tfreduce")
    cfg = result["config"]
    ax.set_title(f"{cfg['model']}, {cfg['num_tensors']} tensors, "
                 f"{format_bytes(cfg['bytes_per_tower'])}/tower, {cfg['dtype']} "
                 f"{cfg['reduce']}, K={len(cfg['devices'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def configure_logical_devices(num_devices, device_type):
    """Makes sure this process has K devices for eager code; returns their names.

    MirroredStrategy and ReplicatedTrainer run eagerly, so logical CPU
    devices must exist in the eager context (a v1 Session makes its own).
    They can only be created before TensorFlow initialises its runtime; if
    that already happened, the existing devices are used.

    Raises:
      ValueError: fewer than K devices exist and no more can be made.
    """
    kind = "GPU" if device_type == "gpu" else "CPU"
    if kind == "CPU":
        cpu = tf.config.list_physical_devices("CPU")[0]
        if tf.config.get_logical_device_configuration(cpu) is None:
            try:
                tf.config.set_logical_device_configuration(
                    cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)])
            except RuntimeError:
                pass  # Already initialised: checked below.
    existing = tf.config.list_logical_devices(kind)
    if len(existing) < num_devices:
        raise ValueError(
            f"{num_devices} {kind} devices needed but this process has {len(existing)}, "
            f"and TensorFlow is already initialised so no more logical devices can be made")
    return [tf.DeviceSpec.from_string(d.name).to_string() for d in existing[:num_devices]]


def example_cnn(input_shape, num_classes):
    """The CNN of examples/image_classification.py, with fixed seeds.

    Two conv(3x3, no bias)-BatchNorm-ReLU-maxpool blocks of 32 and 64
    filters and a dense classifier, so the train mode times the same model
    the example trains.
    """
    import keras
    inputs = keras.Input(input_shape)
    x = inputs
    for block, filters in enumerate((32, 64)):
        x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False,
                                kernel_initializer=keras.initializers.HeNormal(seed=block))(x)
        x = keras.layers.BatchNormalization(momentum=0.9)(x)
        x = keras.layers.ReLU()(x)
        x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Flatten()(x)
    outputs = keras.layers.Dense(
        num_classes, kernel_initializer=keras.initializers.GlorotUniform(seed=2))(x)
    return keras.Model(inputs, outputs, name="cnn")


def run_train(args, log):
    """The train mode: ReplicatedTrainer vs MirroredStrategy + model.fit, per K."""
    counts = args.grid_devices or [2, 4, 8]
    if len(counts) == 1:
        rows = [_train_one(args, counts[0], log)]
    else:
        # MirroredStrategy on CPUs reduces with collective ops whose group
        # keys restart at 1 in every strategy, so strategies over different
        # device sets cannot share a process: each K runs in its own.
        rows = [_train_in_child(args, num_devices, log) for num_devices in counts]
    return {
        "mode": "train",
        "config": {"model": "example CNN", "image_size": args.image_size,
                   "batch_size": args.batch_size, "steps_per_round": args.steps,
                   "rounds": args.rounds, "algorithm": (args.algorithms or ["auto"])[0],
                   "device_type": args.device_type},
        "results": rows,
        "environment": _environment(),
    }


def _train_in_child(args, num_devices, log):
    log(f"K={num_devices}: timing in a child process")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train.json")
        argv = [sys.executable, "-m", "tfreduce.bench", "--mode", "train", "--grid-devices",
                str(num_devices), "--device-type", args.device_type, "--batch-size",
                str(args.batch_size), "--image-size", str(args.image_size), "--steps",
                str(args.steps), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                "--json", path, "--quiet"]
        if args.algorithms:
            argv += ["--algorithms", ",".join(args.algorithms)]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            row = json.load(f)["results"][0]
    log(f"K={num_devices}: trainer {row['trainer_images_per_s']:.0f} images/s, "
        f"fit {row['fit_images_per_s']:.0f} images/s")
    return row


def _train_one(args, num_devices, log):
    # Times both contenders for one K in this process; returns the result row.
    import keras

    from tfreduce.trainer import ReplicatedTrainer

    devices = configure_logical_devices(num_devices, args.device_type)
    batch, side, num_classes, num_batches = args.batch_size, args.image_size, 10, 8
    rng = np.random.default_rng(0)
    x = rng.random((batch * num_batches, side, side, 1), dtype=np.float32)
    y = rng.integers(0, num_classes, size=batch * num_batches).astype(np.int32)
    algorithm = (args.algorithms or ["auto"])[0]
    log(f"K={num_devices}: building ReplicatedTrainer({algorithm}) and MirroredStrategy")

    def loss():
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    trainer = ReplicatedTrainer(
        model_fn=lambda: example_cnn((side, side, 1), num_classes), loss=loss(),
        optimizer_fn=lambda: keras.optimizers.Adam(1e-3), devices=devices,
        algorithm=algorithm, average=True)
    batches = [(tf.constant(x[i * batch:(i + 1) * batch]),
                tf.constant(y[i * batch:(i + 1) * batch])) for i in range(num_batches)]

    def trainer_round(steps):
        # train_step returns the loss as a float, so each step is waited for.
        trainer.train_step(*batches[0])
        start = time.perf_counter()
        for step in range(1, steps + 1):
            trainer.train_step(*batches[step % num_batches])
        return time.perf_counter() - start

    strategy = tf.distribute.MirroredStrategy(devices=devices)
    with strategy.scope():
        model = example_cnn((side, side, 1), num_classes)
        # No XLA on either side: ReplicatedTrainer does not compile either.
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss(),
                      jit_compile=False)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch, drop_remainder=True).repeat()
    stamps = []

    class StepClock(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            # Reading the loss waits for the step, as train_step does.
            float(logs["loss"])
            stamps.append(time.perf_counter())

    def fit_round(steps):
        # Timed from the end of the first step to the end of the last, so
        # fit's per-call set-up (iterators, callbacks) is left out.
        stamps.clear()
        model.fit(dataset, epochs=1, steps_per_epoch=steps + 1, verbose=0,
                  shuffle=False, callbacks=[StepClock()])
        return stamps[-1] - stamps[0]

    contenders_ = {"ReplicatedTrainer": trainer_round, "MirroredStrategy.fit": fit_round}
    for run in contenders_.values():
        run(max(args.warmup, 1))  # the first call traces
    rates = {name: [] for name in contenders_}
    for r in range(args.rounds):
        order = list(contenders_) if r % 2 == 0 else list(contenders_)[::-1]
        for name in order:
            rates[name].append(args.steps * batch / contenders_[name](args.steps))
    medians = {name: statistics.median(v) for name, v in rates.items()}
    log(f"K={num_devices}: trainer {medians['ReplicatedTrainer']:.0f} images/s, "
        f"fit {medians['MirroredStrategy.fit']:.0f} images/s")
    return {
        "devices": num_devices,
        "trainer_images_per_s": medians["ReplicatedTrainer"],
        "fit_images_per_s": medians["MirroredStrategy.fit"],
        # Rounds alternate between the two, so compare them round by round.
        "trainer_over_fit": statistics.median(
            t / f for t, f in zip(rates["ReplicatedTrainer"], rates["MirroredStrategy.fit"])),
        "trainer_rounds": rates["ReplicatedTrainer"],
        "fit_rounds": rates["MirroredStrategy.fit"],
        # Which reduction MirroredStrategy chose here (no public accessor).
        "strategy_cross_device_ops": type(
            getattr(strategy.extended, "_cross_device_ops", None)
            or getattr(strategy.extended, "_inferred_cross_device_ops", None)).__name__,
    }


def print_train(result, out=None):
    """Prints the train result as a table to ``out`` (a file; None: stdout)."""
    cfg = result["config"]
    print(f"\n{cfg['model']}, {cfg['image_size']}x{cfg['image_size']} images, global batch "
          f"{cfg['batch_size']}, median of {cfg['rounds']} rounds of {cfg['steps_per_round']} "
          f"steps; ReplicatedTrainer(algorithm={cfg['algorithm']!r})", file=out)
    # trainer/fit: median over rounds of the two rates' ratio in each round.
    header = f"{'K':>3s} {'trainer img/s':>14s} {'fit img/s':>10s} {'trainer/fit':>12s}"
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in result["results"]:
        print(f"{r['devices']:3d} {r['trainer_images_per_s']:14.0f} "
              f"{r['fit_images_per_s']:10.0f} {r['trainer_over_fit']:12.2f}", file=out)


def _scaling_inputs(num_tensors, elements, devices):
    # One variable per device split into N equal pieces: a split along the
    # first dimension into 64-byte-aligned pieces shares the buffer, so the
    # inputs cost K ops, not K*N as with one variable per tensor.
    variables, grads = [], []
    for k, device in enumerate(devices):
        with tf.device(device):
            v = tf.Variable(_input_values([num_tensors * elements], tf.float32, [k, 0]),
                            trainable=False, name=f"tower{k}_grads")
            read = tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=tf.float32)
            grads.append(tf.split(read, num_tensors, name=f"tower{k}_split"))
        variables.append(v)
    return variables, grads


def run_scaling(args, log):
    """The scaling mode: cost of tfreduce algorithms over a grid of K and N."""
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
        _warm_up([Contender(name, algorithm, name, _tfreduce_builder(algorithm, pack_bytes))],
                 device_names(counts[0], args.device_type), average, tf.float32)
        for num_devices in counts:
            devices = device_names(num_devices, args.device_type)
            for num_tensors in sizes:
                graph = tf.Graph()
                with graph.as_default():
                    variables, grads = _scaling_inputs(num_tensors, elements, devices)
                    before = len(graph.get_operations())
                    start = time.thread_time()
                    out = tfreduce.allreduce_grads(grads, devices, average=average,
                                                   algorithm=algorithm, pack_bytes=pack_bytes)
                    build_s = time.thread_time() - start
                    num_ops = len(graph.get_operations()) - before
                    fetch = consume(out, devices, "step")
                    init = tf.compat.v1.initializers.variables(variables)
                config = session_config(num_devices, args.device_type)
                with tf.compat.v1.Session(graph=graph, config=config) as sess:
                    sess.run(init)
                    for _ in range(max(args.warmup, 1)):
                        sess.run(fetch)
                    times = []
                    for _ in range(args.steps):
                        start = time.perf_counter()
                        sess.run(fetch)
                        times.append(time.perf_counter() - start)
                step_s = statistics.median(times)
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
        "environment": _environment(),
    }


def print_scaling(result, out=None):
    """Prints the scaling result to ``out`` (a file; None: stdout); /KN: per K*N."""
    cfg = result["config"]
    print(f"\nK devices x N tensors of {format_bytes(cfg['tensor_bytes'])}, {cfg['reduce']}, "
          f"median of {cfg['steps']} steps; +pack = pack_bytes {cfg['pack_bytes']}", file=out)
    header = (f"{'algorithm':18s} {'K':>3s} {'N':>5s} {'ops':>8s} {'ops/KN':>7s} "
              f"{'build s':>8s} {'build us/KN':>12s} {'step ms':>9s} {'step us/KN':>11s}")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in result["results"]:
        print(f"{r['algorithm']:18s} {r['devices']:3d} {r['tensors']:5d} {r['num_ops']:8d} "
              f"{r['ops_per_cell']:7.1f} {r['build_s']:8.3f} {r['build_us_per_cell']:12.1f} "
              f"{r['step_ms']:9.2f} {r['step_us_per_cell']:11.2f}", file=out)


def _parse_list(text, convert, what):
    try:
        values = [convert(item) for item in text.split(",") if item.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{what}: {error}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{what}: give at least one value")
    return values


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv):
    """Returns (parser, args); bad values exit with a usage error."""
    parser = argparse.ArgumentParser(
        prog="tfreduce-bench",
        description="Time tfreduce's all-reduce algorithms against tensorpack, "
                    "tf.distribute and the memory floor on K devices.")
    parser.add_argument("--mode", choices=MODES, default="allreduce",
                        help="allreduce (default): reductions of model gradients; train: "
                             "ReplicatedTrainer vs MirroredStrategy model.fit; scaling: "
                             "cost over a grid of K and N")
    parser.add_argument("--devices", type=_positive_int, default=8, metavar="K",
                        help="number of devices (towers); default %(default)s")
    parser.add_argument("--device-type", choices=("cpu", "gpu"), default="cpu",
                        help="cpu (default): K logical CPU devices; gpu: the first K GPUs")
    parser.add_argument("--model", default="resnet50",
                        help="a keras.applications model name, built with weights=None, or "
                             "'synthetic'; default %(default)s")
    parser.add_argument("--num-tensors", type=_positive_int, default=100, metavar="N",
                        help="number of equal tensors for --model synthetic; default "
                             "%(default)s")
    parser.add_argument("--total-bytes", type=parse_bytes, default=None, metavar="BYTES",
                        help="bytes per tower: rescales the model's tensors to this total "
                             "(e.g. 1MB), or sizes the synthetic tensors (default 4KiB each)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "float64"),
                        default="float32", help="gradient dtype; default %(default)s")
    parser.add_argument("--reduce", choices=("mean", "sum"), default="mean",
                        help="default %(default)s")
    parser.add_argument("--steps", type=_positive_int, default=20,
                        help="timed rounds, each running every contender once (train mode: "
                             "steps per round); default %(default)s")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed runs per contender; default %(default)s")
    parser.add_argument("--pack-bytes", default=[DEFAULT_PACK_BYTES], metavar="BYTES[,BYTES]",
                        type=lambda s: _parse_list(s, parse_bytes, "--pack-bytes"),
                        help="pack sizes of the packed variants; default "
                             f"{format_bytes(DEFAULT_PACK_BYTES)} (packing.DEFAULT_PACK_BYTES)")
    parser.add_argument("--packing", choices=("both", "on", "off"), default="both",
                        help="run tfreduce algorithms unpacked, packed, or both (default)")
    parser.add_argument("--contenders", default=None, metavar="NAME[,NAME]",
                        type=lambda s: _parse_list(s, str, "--contenders"),
                        help=f"run only these of {','.join(FAMILIES)}; default all")
    parser.add_argument("--grid-devices", default=None, metavar="K[,K]",
                        type=lambda s: _parse_list(s, _positive_int, "--grid-devices"),
                        help="train and scaling modes: the K values; default 2,4,8 (train), "
                             "2,4,8,16,32 (scaling)")
    parser.add_argument("--grid-tensors", default=None, metavar="N[,N]",
                        type=lambda s: _parse_list(s, _positive_int, "--grid-tensors"),
                        help="scaling mode: the N values; default 10,100,1000")
    parser.add_argument("--tensor-bytes", type=parse_bytes, default=1024, metavar="BYTES",
                        help="scaling mode: bytes per tensor, rounded down to a multiple of "
                             "64; default 1KiB")
    parser.add_argument("--algorithms", default=None, metavar="NAME[,NAME]",
                        type=lambda s: _parse_list(s, str, "--algorithms"),
                        help="scaling mode: tfreduce algorithms, NAME+pack for packed; "
                             "default flat,hierarchical,flat+pack,hierarchical+pack,ring+pack. "
                             "train mode: the trainer's algorithm; default auto")
    parser.add_argument("--batch-size", type=_positive_int, default=128,
                        help="train mode: global batch size; default %(default)s")
    parser.add_argument("--image-size", type=_positive_int, default=28,
                        help="train mode: side of the square one-channel images; default "
                             "%(default)s")
    parser.add_argument("--rounds", type=_positive_int, default=5,
                        help="train mode: timed rounds per contender; default %(default)s")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the run that checks values and pruning")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    parser.add_argument("--png", default=None, metavar="PATH",
                        help="allreduce mode: write a bar chart here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.contenders:
        unknown = sorted(set(args.contenders) - set(FAMILIES))
        if unknown:
            parser.error(f"--contenders: unknown {unknown}; choose from {list(FAMILIES)}")
    if args.algorithms:
        known = set(tfreduce.ALGORITHMS)
        bad = [a for a in args.algorithms if a.partition("+")[0] not in known
               or a.partition("+")[2] not in ("", "pack")]
        if bad:
            parser.error(f"--algorithms: unknown {bad}; use names in {list(known)}, "
                         f"optionally with '+pack'")
    if args.device_type == "gpu":
        found = len(tf.config.list_physical_devices("GPU"))
        if found < args.devices:
            parser.error(f"--devices {args.devices} --device-type gpu: this machine has "
                         f"{found} GPUs")
    return parser, args


def main(argv=None):
    """Runs the benchmark; returns the exit status.

    Args:
      argv: list of command-line arguments, None for sys.argv[1:].
    """
    parser, args = parse_args(argv)

    def log(message):
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    if args.mode == "train" and args.grid_devices and len(args.grid_devices) == 1:
        # In this process, before anything else touches TensorFlow's runtime.
        try:
            configure_logical_devices(args.grid_devices[0], args.device_type)
        except ValueError as error:
            parser.error(str(error))
    if args.mode == "allreduce" and args.model != "synthetic":
        try:
            _keras_application(args.model)
        except ValueError as error:
            parser.error(str(error))
    run, show = {"allreduce": (run_allreduce, print_allreduce),
                 "train": (run_train, print_train),
                 "scaling": (run_scaling, print_scaling)}[args.mode]
    result = run(args, log)
    show(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        log(f"wrote {args.json}")
    if args.png:
        if args.mode == "allreduce":
            plot_allreduce(result, args.png)
            log(f"wrote {args.png}")
        else:
            log(f"--png draws the allreduce mode only; nothing drawn for --mode {args.mode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
