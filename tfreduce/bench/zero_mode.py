"""The train mode with --zero-stage: ReplicatedTrainer at each ZeRO stage against MirroredStrategy.

For each K, ReplicatedTrainer (Adam, the --algorithms algorithm) at every
stage of --zero-stage and Keras ``model.fit`` under MirroredStrategy train
the same model (--train-model: the example's CNN, or a keras.applications
model built with weights=None) on the same random images; their rounds
alternate. Besides images/s, each reports the bytes of state on its
busiest device: ``ReplicatedTrainer.state_bytes()``, and for the strategy
one replica of the model's and the optimizer's variables (MirroredStrategy
mirrors all of them on every device). Each K runs in its own process when
several are asked for (MirroredStrategy cannot share one, see train_mode).
Without accumulation stage 2 is stage 1.
"""

import statistics

from tfreduce.basis.devices import logical_devices
from tfreduce.bench.tables import print_table
from tfreduce.bench.train_mode import (alternate_rounds, fit_rounds, image_workload, model_result,
                                       row_in_child, trainer_rounds)

__all__ = ["run", "print_result"]

_CLASSES = 10


def run(args, log):
    """Times ReplicatedTrainer at each --zero-stage and MirroredStrategy.fit, per K.

    Args:
      args: argparse.Namespace from ``cli.parse_args``.
      log: callable(str), progress lines.

    Returns:
      dict with keys mode ("zero"), config, results (one dict per K) and
      environment.

    Raises:
      subprocess.CalledProcessError: a child process for one K failed.
    """
    counts = args.grid_devices or [2, 4, 8]
    if len(counts) == 1:
        rows = [_one(args, counts[0], log)]
    else:
        rows = [_in_child(args, num_devices, log) for num_devices in counts]
    return model_result("zero", args, rows, zero_stages=args.zero_stage)


def _in_child(args, num_devices, log):
    row = row_in_child(args, num_devices, log, [
        "--zero-stage", ",".join(str(s) for s in args.zero_stage),
        "--train-model", args.train_model])
    log(f"K={num_devices}: " + ", ".join(f"{name} {rate:.0f} images/s"
                                        for name, rate in row["images_per_s"].items()))
    return row


def _one(args, num_devices, log):
    # Times every contender for one K in this process; returns the result row.
    devices = logical_devices(num_devices, args.device_type)
    batch = args.batch_size
    x, y, make_model = image_workload(args, _CLASSES)
    algorithm = (args.algorithms or ["auto"])[0]
    rounds, state = {}, {}
    for stage in args.zero_stage:
        log(f"K={num_devices}: building ReplicatedTrainer({algorithm}, zero_stage={stage})")
        trainer, rounds[f"zero {stage}"] = trainer_rounds(devices, algorithm, x, y, batch,
                                                          make_model, zero_stage=stage)
        trainer.train_step(x[:batch], y[:batch])
        state[f"zero {stage}"] = _busiest(trainer.state_bytes())
    log(f"K={num_devices}: building MirroredStrategy + fit")
    strategy, rounds["MirroredStrategy.fit"] = fit_rounds(devices, x, y, batch, make_model)
    del strategy
    rates = alternate_rounds(rounds, args, batch)
    state["MirroredStrategy.fit"] = _mirrored_bytes(make_model)
    first = f"zero {args.zero_stage[0]}"
    return {
        "devices": num_devices,
        "images_per_s": {name: statistics.median(r) for name, r in rates.items()},
        # Round by round, as the contenders alternate within each round.
        "over_first_stage": {name: statistics.median(a / b for a, b in zip(r, rates[first]))
                             for name, r in rates.items()},
        "state_bytes_per_device": state,
        "rounds": rates,
    }


def _busiest(per_tower):
    # The most any one tower holds, of each kind and in total.
    return {kind: max(row[kind] for row in per_tower) for kind in per_tower[0]}


def _mirrored_bytes(make_model):
    # One replica of what MirroredStrategy mirrors: every model variable and
    # Adam's (weights, two slots, counters), built on the host.
    import keras
    import tensorflow as tf

    model = make_model()
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)

    def size(variables):
        return sum(int(v.shape.num_elements()) * tf.as_dtype(v.dtype).size for v in variables)

    weights, slots = size(model.variables), size(optimizer.variables)
    return {"weights": weights, "optimizer": slots, "accumulation": 0, "compression": 0,
            "total": weights + slots}


def print_result(result, out=None):
    """Prints the zero result as a table to ``out`` (a file; None: stdout).

    Args:
      result: dict returned by ``run``.
      out: a text file, or None for stdout.
    """
    cfg = result["config"]
    first = f"zero {cfg['zero_stages'][0]}"
    title = (f"{cfg['model']}, {cfg['image_size']}x{cfg['image_size']} images, global batch "
             f"{cfg['batch_size']}, Adam, median of {cfg['rounds']} rounds of "
             f"{cfg['steps_per_round']} steps, algorithm={cfg['algorithm']!r}; state: the "
             f"busiest device's bytes (weights + optimizer), MiB")
    header = (f"{'K':>3s} {'contender':>22s} {'img/s':>8s} {'/' + first:>9s} "
              f"{'state MiB':>10s} {'optimizer MiB':>14s}")
    lines = []
    for r in result["results"]:
        for name, rate in r["images_per_s"].items():
            held = r["state_bytes_per_device"][name]
            lines.append(f"{r['devices']:3d} {name:>22s} {rate:8.0f} "
                         f"{r['over_first_stage'][name]:9.2f} {held['total'] / 2**20:10.2f} "
                         f"{held['optimizer'] / 2**20:14.2f}")
    print_table(title, header, lines, out)
