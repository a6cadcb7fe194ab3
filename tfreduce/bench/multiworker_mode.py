"""The multiworker mode: all-reduce across W worker processes on 127.0.0.1.

Starts ``tfreduce.launch`` with W workers (``--workers``), each running
``tfreduce.bench.multiworker_worker`` on K = ``--devices`` logical devices
(see that module for the contenders), and reports rank 0's timings: the
median call per contender, its ratio to the per-tensor collective (what
MultiWorkerMirroredStrategy does) and to uncompressed tfreduce, the bytes
each worker puts into cross-worker collectives (read from the graph), and
the largest difference from NumPy. The bytes cross processes through TF's
gRPC runtime, as between machines, so this is where compression pays.
"""

import os
import subprocess
import sys
import tempfile

from tfreduce.bench.harness import environment, processes_result
from tfreduce.bench.tables import print_table
from tfreduce.bench.units import format_bytes

__all__ = ["run", "print_result"]

#: The launcher's limit on the whole run, seconds.
TIMEOUT_S = 1800


def run(args, log):
    """The multiworker mode; returns the JSON-ready result dict.

    Args:
      args: argparse.Namespace from ``cli.parse_args``.
      log: callable(str), progress lines.

    Returns:
      dict with keys mode, config, results (one dict a contender: median
      ms, times, cross-worker bytes, relative error, ratios) and environment.

    Raises:
      RuntimeError: the launcher or a worker failed (its output is in the
        message).
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.json")
        worker = [sys.executable, "-m", "tfreduce.bench.multiworker_worker", "--devices",
                  str(args.devices), "--model", args.model, "--num-tensors",
                  str(args.num_tensors), "--reduce", args.reduce,
                  "--steps", str(args.steps), "--warmup", str(args.warmup),
                  "--powersgd-rank", str(args.powersgd_rank), "--json", path]
        if args.total_bytes:
            worker += ["--total-bytes", str(args.total_bytes)]
        command = [sys.executable, "-m", "tfreduce.launch", "--workers", str(args.workers),
                   "--timeout", str(TIMEOUT_S), "--preload", "tensorflow"]
        command += ["--verbose"] if args.verbose else []
        log(f"{args.workers} workers x {args.devices} devices on 127.0.0.1, {args.model}, "
            f"{args.steps} rounds")
        measured = processes_result(subprocess.run, command + ["--"] + worker, path,
                                    "the workers")
    rows = measured["rows"]
    base, ours = "per-tensor collective", "tfreduce"
    for row in rows.values():
        row["x_per_tensor"] = rows[base]["median_ms"] / row["median_ms"]
        row["x_tfreduce"] = rows[ours]["median_ms"] / row["median_ms"]
    return {
        "mode": "multiworker",
        "config": {"model": args.model, "workers": measured["workers"],
                   "devices_per_worker": measured["devices_per_worker"],
                   "num_tensors": measured["num_tensors"],
                   "bytes_per_tower": measured["bytes_per_tower"], "reduce": args.reduce,
                   "steps": args.steps, "warmup": args.warmup},
        "results": rows,
        "environment": environment(),
    }


def print_result(result, out=None):
    """Prints the multiworker table to ``out`` (a file; None: stdout).

    ``speed-up`` columns are the per-tensor collective's (and uncompressed
    tfreduce's) median divided by the row's: above 1 is faster.
    """
    cfg = result["config"]
    title = (f"{cfg['model']}: {cfg['num_tensors']} tensors, "
             f"{format_bytes(cfg['bytes_per_tower'])} per tower, {cfg['reduce']}, "
             f"{cfg['workers']} workers x {cfg['devices_per_worker']} devices on 127.0.0.1; "
             f"median of {cfg['steps']} rounds")
    header = (f"{'contender':26s} {'median ms':>10s} {'vs per-tensor':>14s} "
              f"{'vs tfreduce':>12s} {'into collectives/worker':>24s} {'rel. error':>10s}")
    lines = [f"{name:26s} {r['median_ms']:10.1f} {r['x_per_tensor']:13.2f}x "
             f"{r['x_tfreduce']:11.2f}x {format_bytes(r['cross_worker_bytes']):>24s} "
             f"{r['relative_error']:10.2g}" for name, r in result["results"].items()]
    print_table(title, header, lines, out)
