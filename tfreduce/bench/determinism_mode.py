"""The train mode with --deterministic: ReplicatedTrainer, deterministic against the default.

``deterministic=True`` changes TensorFlow's settings for the whole process
(op determinism on, three Grappler passes off), so the two trainers never
share one: for each K (--grid-devices; default 4 and 8) one child process
times the default trainer and the next the deterministic one (Adam, the
--algorithms algorithm, 8 micro-batches) on the same model (--train-model)
and random images. The ratio is the deterministic step's time over the
default's, of their medians over --rounds rounds of --steps steps.
"""

import statistics

import tfreduce
from tfreduce.basis.devices import logical_devices
from tfreduce.bench.tables import print_table
from tfreduce.bench.train_mode import (alternate_rounds, image_workload, model_result,
                                       model_title, row_in_child, trainer_rounds)

__all__ = ["run", "print_result"]

_CLASSES = 10


def run(args, log):
    """Times the default and the deterministic ReplicatedTrainer, per K.

    Args:
      args: argparse.Namespace from ``cli.parse_args``; ``args.deterministic``
        is "compare" (a child process per K and variant), or "on" / "off" in
        such a child (one K, one variant, in this process).
      log: callable(str), progress lines.

    Returns:
      dict with keys mode ("determinism"), config, results (one dict per K)
      and environment.

    Raises:
      subprocess.CalledProcessError: a child process failed.
    """
    if args.deterministic in ("on", "off"):
        rows = [_one(args, args.grid_devices[0], args.deterministic == "on", log)]
    else:
        rows = [_pair(args, num_devices, log) for num_devices in args.grid_devices or [4, 8]]
    return model_result("determinism", args, rows)


def _one(args, num_devices, deterministic, log):
    devices = logical_devices(num_devices, args.device_type)
    x, y, make_model = image_workload(args, _CLASSES)
    reduction = tfreduce.Reduction((args.algorithms or ["auto"])[0], deterministic=deterministic)
    log(f"K={num_devices}: ReplicatedTrainer({reduction!r})")
    _, trainer_round = trainer_rounds(devices, reduction, x, y, args.batch_size, make_model)
    rates = alternate_rounds({"trainer": trainer_round}, args, args.batch_size)["trainer"]
    return {"devices": num_devices, "deterministic": deterministic,
            "images_per_s": statistics.median(rates), "rounds": rates}


def _pair(args, num_devices, log):
    rows = {name: row_in_child(args, num_devices, log, ["--deterministic", switch,
                                                        "--train-model", args.train_model])
            for name, switch in (("default", "off"), ("deterministic", "on"))}
    rates = {name: row["images_per_s"] for name, row in rows.items()}
    ratio = rates["default"] / rates["deterministic"]
    log(f"K={num_devices}: default {rates['default']:.0f} images/s, deterministic "
        f"{rates['deterministic']:.0f} images/s: {ratio:.2f}x the step time")
    return {"devices": num_devices, "images_per_s": rates, "step_time_ratio": ratio,
            "rounds": {name: row["rounds"] for name, row in rows.items()}}


def print_result(result, out=None):
    """Prints the determinism result as a table to ``out`` (a file; None: stdout)."""
    cfg = result["config"]
    title = (f"{model_title(cfg)}, median of {cfg['rounds']} rounds of "
             f"{cfg['steps_per_round']} steps; deterministic=True with 8 micro-batches, each "
             f"variant in its own process")
    header = f"{'K':>3s} {'default img/s':>14s} {'deterministic img/s':>20s} {'step time':>10s}"
    lines = []
    for r in result["results"]:
        rates = r["images_per_s"]
        if isinstance(rates, dict):
            lines.append(f"{r['devices']:3d} {rates['default']:14.0f} "
                         f"{rates['deterministic']:20.0f} {r['step_time_ratio']:9.2f}x")
        else:  # a child's one variant
            lines.append(f"{r['devices']:3d} {'':14s} {rates:20.0f} "
                         f"{'deterministic' if r['deterministic'] else 'default':>10s}")
    print_table(title, header, lines, out)
