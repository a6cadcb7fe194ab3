"""The train mode with --overlap (or --trace): how much of the reduction the backward pass hides.

For each K, three ReplicatedTrainers (Adam, the --algorithms algorithm)
train the same model (--train-model) on the same random images, their
rounds alternating:

- "overlap": the trainer as it is: buckets in backward order, each
  bucket's reduction waiting only for its own gradients;
- "no overlap": the same reduction behind a barrier: every tower's every
  gradient exists before any reduction op may start (what a step that
  reduces after the backward pass, or checks all gradients first, does);
- "compute only": no cross-device reduction (each tower applies its own
  gradients): forward, backward and apply of the same towers.

A contender's exposed communication is its step time minus the compute-only
step's (round by round, the median over rounds): the part of the step the
reduction adds. Besides, a few steps of the first two run under the
profiler, and their timelines give the time a reduction op runs while no
tower computes (``Timeline.exposed_communication``), and their median
step time under the profiler (its cost). On CPU, ``predict_step``
then predicts the overlap contender's step on this host from its
profiled layers' times and the probed "host" topology. --trace FILE writes the
overlap contender's timeline (Chrome trace JSON, or a Gantt chart for
".png"). Each K runs in its own process when several are asked for.
"""

import os
import statistics

import tensorflow as tf

import tfreduce
from tfreduce.analysis.profiler import StepProfiler
from tfreduce.analysis.timeline import COMMUNICATION, COMPUTE
from tfreduce.basis.devices import logical_devices
from tfreduce.bench.tables import print_table
from tfreduce.bench.train_mode import (alternate_rounds, image_workload, model_result,
                                       row_in_child, trainer_rounds)

__all__ = ["run", "print_result"]

_CLASSES = 10
_PROFILED_STEPS = 3
CONTENDERS = ("overlap", "no overlap", "compute only")


class _AfterEveryGradient(tfreduce.Reduction):
    """The reduction, started only once every tower's every gradient exists."""

    def __call__(self, all_grads, devices=None, average=False, *, cluster=None):
        every = [g for row in all_grads for g in row if g is not None]
        held = []
        for k, row in enumerate(all_grads):
            with tf.device(devices[k]), tf.control_dependencies(every):
                held.append([None if g is None else tf.identity(g) for g in row])
        return super().__call__(held, devices, average, cluster=cluster)


class _NoCommunication(tfreduce.Reduction):
    """Each tower keeps its own gradients: the step without its reduction."""

    def __call__(self, all_grads, devices=None, average=False, *, cluster=None):
        return [list(row) for row in all_grads]


def run(args, log):
    """Times the three contenders per K and reads their timelines.

    Args:
      args: argparse.Namespace from ``cli.parse_args``.
      log: callable(str), progress lines.

    Returns:
      dict with keys mode ("overlap"), config, results (one dict per K)
      and environment.

    Raises:
      subprocess.CalledProcessError: a child process for one K failed.
    """
    counts = args.grid_devices or [4, 8]
    if len(counts) == 1:
        rows = [_one(args, counts[0], log)]
    else:
        rows = [_in_child(args, num_devices, log) for num_devices in counts]
    return model_result("overlap", args, rows)


def trace_path(path, num_devices, several):
    """--trace's path for one K: FILE itself, or FILE-K<k> before its suffix when several."""
    if not several:
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}-K{num_devices}{suffix}"


def _in_child(args, num_devices, log):
    extra = ["--overlap", "--train-model", args.train_model]
    if args.trace:
        extra += ["--trace", trace_path(args.trace, num_devices, True)]
    row = row_in_child(args, num_devices, log, extra)
    log(_summary(row))
    return row


def _summary(row):
    return (f"K={row['devices']}: step ms " + ", ".join(
        f"{name} {ms:.1f}" for name, ms in row["step_ms"].items())
        + f"; exposed ms: overlap {row['exposed_ms']['overlap']:.1f}, "
          f"no overlap {row['exposed_ms']['no overlap']:.1f}")


def _one(args, num_devices, log):
    # Times the contenders for one K in this process; returns the result row.
    devices = logical_devices(num_devices, args.device_type)
    batch = args.batch_size
    x, y, make_model = image_workload(args, _CLASSES)
    algorithm = (args.algorithms or ["auto"])[0]
    reductions = {"overlap": tfreduce.Reduction(algorithm),
                  "no overlap": _AfterEveryGradient(algorithm),
                  "compute only": _NoCommunication(algorithm)}
    trainers, rounds = {}, {}
    for name, reduction in reductions.items():
        log(f"K={num_devices}: building ReplicatedTrainer ({name}, {algorithm})")
        trainers[name], rounds[name] = trainer_rounds(devices, reduction, x, y, batch, make_model)
    rates = alternate_rounds(rounds, args, batch)
    ms = {name: [batch / rate * 1e3 for rate in r] for name, r in rates.items()}
    compute = ms["compute only"]
    row = {
        "devices": num_devices,
        "step_ms": {name: statistics.median(r) for name, r in ms.items()},
        # Round by round, as the contenders alternate within each round.
        "exposed_ms": {name: statistics.median(a - b for a, b in zip(ms[name], compute))
                       for name in CONTENDERS[:2]},
        "rounds_ms": ms,
    }
    row["exposed_ratio"] = row["exposed_ms"]["overlap"] / row["exposed_ms"]["no overlap"]
    row["timeline"] = {}
    for name in CONTENDERS[:2]:
        timeline = _profile(trainers[name], x[:batch], y[:batch])
        steps = _PROFILED_STEPS
        profiled = [s.duration for s in timeline.slices if s.op_type == "step"]
        row["timeline"][name] = {
            # Under the profiler: its cost is this over the rounds' step_ms.
            "step_ms": statistics.median(profiled) * 1e3,
            "exposed_ms": timeline.exposed_communication() / steps * 1e3,
            "communication_ms": timeline.busy(COMMUNICATION) / steps * 1e3,
            "compute_ms": timeline.busy(COMPUTE) / steps * 1e3}
        if name == "overlap" and args.trace:
            log(f"K={num_devices}: wrote {timeline.save(args.trace)}")
        if name == "overlap" and args.device_type == "cpu":
            log(f"K={num_devices}: probing the host for the predicted step")
            row["predicted"] = _predicted(trainers[name], timeline, reductions[name],
                                          batch // num_devices)
    return row


def _predicted(trainer, timeline, reduction, batch_per_tower):
    # predict_step on this host: each layer's time from the profiled
    # steps, the reduction on the host's probed topology.
    step = tfreduce.predict_step(trainer.models[0], batch_per_tower, "host",
                                 num_towers=len(trainer.devices), reduction=reduction,
                                 compute=timeline)
    return {"step_ms": step.seconds * 1e3, "exposed_ms": step.exposed_seconds * 1e3,
            "compute_ms": step.compute_seconds * 1e3, "apply_ms": step.apply_seconds * 1e3}


def _profile(trainer, x, y):
    # _PROFILED_STEPS train steps of a trainer already traced, profiled.
    with StepProfiler(None, trainer.devices, trainer._steps.graphs,
                      trainer.models) as profiler:
        for step in range(_PROFILED_STEPS):
            profiler.step(f"step {step + 1}", trainer.train_step, x, y)
    return profiler.timeline


def print_result(result, out=None):
    """Prints the overlap result as a table to ``out`` (a file; None: stdout).

    Args:
      result: dict returned by ``run``.
      out: a text file, or None for stdout.
    """
    cfg = result["config"]
    title = (f"{cfg['model']}, {cfg['image_size']}x{cfg['image_size']} images, global batch "
             f"{cfg['batch_size']}, Adam, median of {cfg['rounds']} rounds of "
             f"{cfg['steps_per_round']} steps, algorithm={cfg['algorithm']!r}; exposed: step "
             f"minus the compute-only step; timeline: reduction running while no tower "
             f"computes, per profiled step")
    header = (f"{'K':>3s} {'contender':>14s} {'step ms':>8s} {'exposed ms':>11s} "
              f"{'profiled step ms':>17s} {'timeline exposed ms':>20s} "
              f"{'timeline reduction ms':>22s}")
    lines = []
    for r in result["results"]:
        for name in CONTENDERS:
            seen = r["timeline"].get(name)
            exposed = r["exposed_ms"].get(name)
            lines.append(
                f"{r['devices']:3d} {name:>14s} {r['step_ms'][name]:8.1f} "
                f"{'' if exposed is None else f'{exposed:.1f}':>11s} "
                f"{'' if seen is None else format(seen['step_ms'], '.1f'):>17s} "
                f"{'' if seen is None else format(seen['exposed_ms'], '.1f'):>20s} "
                f"{'' if seen is None else format(seen['communication_ms'], '.1f'):>22s}")
    print_table(title, header, lines, out)
    for r in result["results"]:
        print(f"K={r['devices']}: exposed communication with overlap / without: "
              f"{r['exposed_ratio']:.2f}", file=out)
        if "predicted" in r:
            p = r["predicted"]
            print(f"K={r['devices']}: predicted on this host from the profiled layers: step "
                  f"{p['step_ms']:.1f} ms ({p['step_ms'] / r['step_ms']['overlap']:.2f}x the "
                  f"measured), compute {p['compute_ms']:.1f} ms, exposed "
                  f"{p['exposed_ms']:.1f} ms, update {p['apply_ms']:.1f} ms", file=out)
