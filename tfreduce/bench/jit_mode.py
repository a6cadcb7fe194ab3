"""The train mode with --jit-compile: ReplicatedTrainer with each tower compiled by XLA, or not.

For each K (--grid-devices; default 2 and 4) two trainers train the same
model (--train-model, default the example's CNN) on the same random images
in one process, with Adam and the --algorithms algorithm: one with
``jit_compile=True`` (each tower's forward and backward pass one XLA
cluster on its device, trainer/compiled.py), one without. Their rounds of
--steps steps alternate, so the ratio (compiled images/s over uncompiled,
the median of each round's ratio) compares them under the same load. The
first step of each is timed alone: its tracing, and for the compiled one
XLA's compile of every tower (the difference is the compile time).

Published (GPUs, which this host lacks): ResNet-50 on V100 with
tf_cnn_benchmarks' --xla_compile, 1.58x on 1 GPU and 1.54x on 8 (TF blog,
"Pushing the limits of GPU performance with XLA"); NVIDIA's ResNet-50 v1.5
on DGX A100, 1.08-1.25x. XLA's CPU backend compiles for one thread per
cluster op by default (TF#58142), so on CPUs it may well lose.
"""

import statistics
import time

from tfreduce.basis.devices import logical_devices
from tfreduce.bench.tables import print_table
from tfreduce.bench.train_mode import (alternate_rounds, image_workload, model_result,
                                       model_title, trainer_rounds)

__all__ = ["run", "print_result"]

_CLASSES = 10


def run(args, log):
    """Times ReplicatedTrainer compiled (jit_compile=True) against uncompiled, per K.

    Args:
      args: argparse.Namespace from ``cli.parse_args`` (``args.jit_compile``).
      log: callable(str), progress lines.

    Returns:
      dict with keys mode ("jit"), config, results (one dict per K: the
      images/s of each, their ratio, each first step's seconds, the rounds)
      and environment.

    Raises:
      ValueError: this process cannot have the largest K devices.
    """
    counts = args.grid_devices or [2, 4]
    # Logical devices are fixed once per process: the largest K, then the first K of them.
    devices = logical_devices(max(counts), args.device_type)
    rows = [_one(args, devices[:k], log) for k in counts]
    return model_result("jit", args, rows)


def _one(args, devices, log):
    x, y, make_model = image_workload(args, _CLASSES)
    algorithm = (args.algorithms or ["auto"])[0]
    rounds, first_step = {}, {}
    for name, jit_compile in (("uncompiled", False), ("compiled", True)):
        log(f"K={len(devices)}: ReplicatedTrainer({algorithm}, jit_compile={jit_compile})")
        trainer, rounds[name] = trainer_rounds(devices, algorithm, x, y, args.batch_size,
                                               make_model, jit_compile=jit_compile)
        start = time.perf_counter()
        trainer.train_step(x[:args.batch_size], y[:args.batch_size])
        first_step[name] = time.perf_counter() - start
    rates = alternate_rounds(rounds, args, args.batch_size)
    ratio = statistics.median(c / u for c, u in zip(rates["compiled"], rates["uncompiled"]))
    medians = {name: statistics.median(r) for name, r in rates.items()}
    log(f"K={len(devices)}: compiled {medians['compiled']:.0f} images/s, uncompiled "
        f"{medians['uncompiled']:.0f} images/s ({ratio:.2f}x); first step "
        f"{first_step['compiled']:.1f} s against {first_step['uncompiled']:.1f} s")
    return {"devices": len(devices), "images_per_s": medians, "compiled_over_uncompiled": ratio,
            "first_step_seconds": first_step,
            "compile_seconds": first_step["compiled"] - first_step["uncompiled"],
            "rounds": rates}


def print_result(result, out=None):
    """Prints the jit result as a table to ``out`` (a file; None: stdout)."""
    cfg = result["config"]
    title = (f"{model_title(cfg)}, median of {cfg['rounds']} alternating rounds of "
             f"{cfg['steps_per_round']} steps; compiled: jit_compile=True, each tower one XLA "
             f"cluster")
    header = (f"{'K':>3s} {'uncompiled img/s':>17s} {'compiled img/s':>15s} "
              f"{'compiled/uncompiled':>20s} {'compile s':>10s}")
    print_table(title, header, [
        f"{r['devices']:3d} {r['images_per_s']['uncompiled']:17.0f} "
        f"{r['images_per_s']['compiled']:15.0f} {r['compiled_over_uncompiled']:20.2f} "
        f"{r['compile_seconds']:10.1f}"
        for r in result["results"]], out)
