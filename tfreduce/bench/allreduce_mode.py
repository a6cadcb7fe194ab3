"""The allreduce mode: every contender, the floor and the inputs row in one graph.

All rows are built into one graph on the same K x N inputs, checked once
against NumPy and timed together in one session (``harness``); the result
is printed as a table and can be drawn as a bar chart.
"""

import statistics
import time

import numpy as np
import tensorflow as tf

from tfreduce.basis.choices import ALGORITHMS
from tfreduce.bench.contenders import contenders
from tfreduce.bench.harness import (build_contender, check, consume, device_names, environment,
                                    graph_session_config, make_floor, make_inputs, time_rounds,
                                    warm_up)
from tfreduce.bench.prediction import host_check, predict_rows, print_predictions
from tfreduce.bench.tables import print_table
from tfreduce.bench.units import format_bytes
from tfreduce.bench.workloads import gradient_shapes

__all__ = ["run", "print_result", "plot"]


def run(args, log):
    """The allreduce mode; returns the JSON-ready result dict.

    Args:
      args: argparse.Namespace from ``cli.parse_args``.
      log: callable(str), progress lines.

    Returns:
      dict with keys mode, config, floor, results (one dict a row: times in
      ms, build time in CPU seconds, op count, cross-device bytes, check
      results), ratios (contender -> contender -> ratio of medians),
      compression (each compressed contender's busiest-pair bytes and step
      time against its uncompressed base), predictions and host_check
      (with --predict: ``prediction.predict_rows``, ``prediction.host_check``),
      skipped (name -> reason) and environment.
    """
    dtype = tf.as_dtype(args.dtype)
    devices = device_names(args.devices, args.device_type)
    shapes = gradient_shapes(args.model, args.num_tensors, args.total_bytes, dtype.size)
    sizes = [int(np.prod(s)) for s in shapes]
    total_bytes = sum(sizes) * dtype.size
    average = args.reduce == "mean"
    chosen, skipped = _select(args)
    log(f"{len(shapes)} tensors, {format_bytes(total_bytes)} per tower, {args.dtype}, "
        f"{args.reduce}, K={args.devices} {args.device_type} devices; "
        f"{len(chosen)} contenders")

    warm_up(chosen, devices, average, dtype)
    graph, init, grads, fetches, rows = _build_graph(chosen, shapes, sum(sizes), devices,
                                                     average, dtype, log)
    with tf.compat.v1.Session(graph=graph, config=graph_session_config(
            args.devices, args.device_type)) as sess:
        sess.run(init)
        inputs = sess.run(grads) if args.check else None
        _first_steps(sess, rows, fetches, inputs, average, dtype, log)
        log(f"timing {len(fetches)} rows x {args.steps} rounds")
        times = time_rounds(sess, fetches, args.steps, args.warmup, log)

    medians = {name: statistics.median(t) for name, t in times.items()}
    names = [c.name for c in chosen]
    # Reads the built graph; the host probe runs eagerly, outside it.
    predictions = predict_rows(rows, grads, args.predict, args.devices, log) if args.predict \
        else {}
    results = _results(times, medians, rows, names)
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
        "compression": _compression(rows, medians),
        "predictions": predictions,
        "host_check": host_check(predictions, results),
        "skipped": skipped,
        "environment": environment(),
    }


def _select(args):
    # The contenders that run here, narrowed to the --contenders families.
    chosen, skipped = contenders(args.devices, args.device_type, args.pack_bytes, args.packing,
                                 args.compression)
    if args.contenders:
        wanted = set(args.contenders)
        skipped.update({c.name: "not selected by --contenders" for c in chosen
                        if c.family not in wanted})
        chosen = [c for c in chosen if c.family in wanted]
    return chosen, skipped


def _build_graph(chosen, shapes, total_elements, devices, average, dtype, log):
    # One graph: the inputs, the floor and every contender, each consumed by
    # its own fetch. Returns (graph, init op, K x N grads, fetches, rows).
    graph = tf.Graph()
    with graph.as_default():
        _, grads = make_inputs(shapes, devices, dtype)
        _, floor_sum = make_floor(total_elements, devices, dtype)
        fetches = {"floor": consume([floor_sum], devices, "floor"),
                   "inputs": consume(grads, devices, "inputs")}
        rows = {}
        for c in chosen:
            rows[c.name] = build_contender(c, graph, grads, devices, average)
            rows[c.name].update(roundoff=c.roundoff, base=c.base)
            fetches[c.name] = rows[c.name].pop("fetch")
            log(f"built {c.name}: {rows[c.name]['num_ops']} ops in "
                f"{rows[c.name]['build_s']:.2f} s")
        # The inputs, the floor and PowerSGD's state.
        init = tf.compat.v1.global_variables_initializer()
    return graph, init, grads, fetches, rows


def _first_steps(sess, rows, fetches, inputs, average, dtype, log):
    # Each contender's first run, timed on its own; then, unless inputs is
    # None (--no-check), the check run of its values and pruning.
    for name, row in rows.items():
        start = time.perf_counter()
        sess.run(fetches[name])
        row["first_step_s"] = time.perf_counter() - start
        if inputs is not None:
            check(sess, row, fetches[name], inputs, average, dtype, row["roundoff"])
            # Ops nothing consumes (tf.distribute's builders leave a few) are
            # pruned by the session; what the check guards is a contender
            # whose reduction was pruned, which its values would show too.
            unused = row["ops_not_run"]
            log(f"checked {name}: largest difference from NumPy {row['max_abs_error']:g}, "
                + (f"{unused} unused ops of its graph pruned" if unused else "every op ran"))


def _compression(rows, medians):
    # Each compressed contender against its uncompressed base, when it ran.
    out = []
    for name, row in rows.items():
        base = rows.get(row["base"]) if row["base"] else None
        if base is None:
            continue
        out.append({"name": name, "base": row["base"],
                    "max_pair_bytes": row["max_pair_bytes"],
                    "base_max_pair_bytes": base["max_pair_bytes"],
                    # None: the bytes move inside a collective op, unseen by the analysis.
                    "bytes_cut": (base["max_pair_bytes"] / max(row["max_pair_bytes"], 1)
                                  if base["max_pair_bytes"] else None),
                    "time_ratio": medians[name] / medians[row["base"]],
                    "relative_error": row.get("relative_error")})
    return out


def _quartiles(samples):
    if len(samples) < 2:
        return samples[0], samples[0]
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return q[0], q[2]


def _results(times, medians, rows, names):
    # One JSON row per timed row: floor, inputs, then the contenders.
    results = []
    for name in ["floor", "inputs"] + names:
        q1, q3 = _quartiles(times[name])
        entry = {"name": name, "median_ms": 1e3 * medians[name], "q1_ms": 1e3 * q1,
                 "q3_ms": 1e3 * q3, "min_ms": 1e3 * min(times[name]),
                 "x_floor": medians[name] / medians["floor"]}
        if name in rows:
            entry["net_ms"] = 1e3 * (medians[name] - medians["inputs"])
            entry.update({k: v for k, v in rows[name].items()
                          if k not in ("outputs", "op_names")})
        results.append(entry)
    return results


def print_result(result, out=None):
    """Prints the allreduce result as a table to ``out`` (a file; None: stdout).

    ``net ms`` is the median minus the ``inputs`` row's median: an estimate
    of the reduction's own time, without the reads of the K x N inputs.
    ``build s`` is the CPU time of the thread that built the graph.

    Args:
      result: dict returned by ``run`` (config, floor, results, skipped).
      out: a text file, or None for stdout.
    """
    cfg = result["config"]
    title = (f"{cfg['model']}: {cfg['num_tensors']} tensors, "
             f"{format_bytes(cfg['bytes_per_tower'])} per tower, {cfg['dtype']} "
             f"{cfg['reduce']}, K={len(cfg['devices'])}; median of {cfg['steps']} steps; "
             f"floor {result['floor']['median_ms']:.2f} ms = "
             f"{result['floor']['GB_per_s']:.1f} GB/s")
    header = (f"{'contender':30s} {'median ms':>10s} {'q1-q3 ms':>15s} {'x floor':>8s} "
              f"{'net ms':>7s} {'build s':>8s} {'ops':>7s} {'max sent/dev':>12s} {'hops':>5s} "
              f"{'ok':>3s}")
    print_table(title, header, [_line(r) for r in result["results"]], out)
    for c in result.get("compression", []):
        error = c["relative_error"]
        moved = (f"busiest device pair {format_bytes(c['max_pair_bytes'])} "
                 f"({c['bytes_cut']:.1f}x less than {c['base']}'s "
                 f"{format_bytes(c['base_max_pair_bytes'])})" if c["bytes_cut"] is not None
                 else "bytes move inside the collective op (not counted)")
        print(f"{c['name']}: {moved}, step time {c['time_ratio']:.2f}x {c['base']}'s"
              + ("" if error is None else f", largest error {error:.2g} of the largest value"),
              file=out)
    print_predictions(result, out)
    for name, reason in result["skipped"].items():
        print(f"skipped {name}: {reason}", file=out)


def _line(r):
    # One table row; floor and inputs (no build) leave the build columns empty.
    extra = ""
    if "build_s" in r:
        ok = {True: "yes", False: "NO"}.get(r.get("correct"), "-")  # -: an approximation
        extra = (f" {r['net_ms']:7.2f} {r['build_s']:8.2f} {r['num_ops']:7d} "
                 f"{format_bytes(r['max_sent_bytes']):>12s} {r['longest_hop_chain']:5d} "
                 f"{ok:>3s}")
    extra = extra or f" {'':7s}"
    return (f"{r['name']:30s} {r['median_ms']:10.2f} "
            f"{r['q1_ms']:7.2f}-{r['q3_ms']:<7.2f} {r['x_floor']:8.2f}{extra}")


def plot(result, path):
    """Writes a horizontal bar chart of median step times to ``path`` (PNG).

    Uses matplotlib's Agg canvas directly, so the caller's pyplot backend and
    state are left alone.

    Args:
      result: dict returned by ``run``.
      path: str, the PNG file to write.

    Raises:
      ImportError: matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = result["results"]
    medians = [r["median_ms"] for r in rows]
    errors = [[r["median_ms"] - r["q1_ms"] for r in rows],
              [r["q3_ms"] - r["median_ms"] for r in rows]]
    # Baselines (floor, inputs) have no family; tfreduce's families are its algorithms.
    kinds = {"baseline": "0.6", "tfreduce": "C0", "peer (tensorpack, tf.distribute)": "C1"}
    colors = [kinds["baseline"] if "family" not in r else
              kinds["tfreduce"] if r["family"] in ALGORITHMS else
              kinds["peer (tensorpack, tf.distribute)"] for r in rows]
    fig = Figure(figsize=(8, 0.35 * len(rows) + 2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.barh(range(len(rows)), medians, xerr=errors, color=colors)
    ax.axvline(result["floor"]["median_ms"], color="k", linestyle=":", linewidth=1)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["name"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("median step (ms); whiskers: first to third quartile")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in kinds.items() if c in colors]
              + [Line2D([], [], color="k", linestyle=":", label="memory floor")],
              loc="lower right", fontsize="small")
    cfg = result["config"]
    ax.set_title(f"{cfg['model']}, {cfg['num_tensors']} tensors, "
                 f"{format_bytes(cfg['bytes_per_tower'])}/tower, {cfg['dtype']} "
                 f"{cfg['reduce']}, K={len(cfg['devices'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
