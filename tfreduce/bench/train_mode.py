"""The train mode: ReplicatedTrainer.train_step against MirroredStrategy + model.fit.

Three contenders train the CNN of examples/image_classification.py
(``tfreduce.trainer.models``) on the same random images and K devices:
ReplicatedTrainer, Keras ``model.fit`` under MirroredStrategy with its
default reduction, and the same ``model.fit`` with ``tfreduce.CrossDeviceOps``
(the --algorithms algorithm). Each K runs in its own process when several
are asked for. A fourth, Horovod-style, runs after them in the same run:
K processes under the launcher, each ``model.fit`` on its part of every
global batch with ``tfreduce.tensorflow.keras.DistributedOptimizer``
(``tfreduce.bench.horovod_worker``); its rounds cannot alternate with the
others', so its ratios are of medians.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

import tfreduce
from tfreduce.basis.devices import logical_devices
from tfreduce.bench.harness import environment
from tfreduce.bench.tables import print_table

__all__ = ["run", "print_result"]


def run(args, log):
    """The train mode: ReplicatedTrainer vs MirroredStrategy + model.fit, per K.

    Args:
      args: argparse.Namespace from ``cli.parse_args``.
      log: callable(str), progress lines.

    Returns:
      dict with keys mode, config, results (one dict per K: images per
      second of each, their ratio, the per-round rates) and environment.

    Raises:
      subprocess.CalledProcessError: a child process for one K failed.
      ValueError: this process cannot have K devices.
    """
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
        "environment": environment(),
    }


def row_in_child(args, num_devices, log, extra=()):
    """The result row of the train mode for one K, timed in a child process.

    Args:
      args: argparse.Namespace from ``cli.parse_args``.
      num_devices: int K.
      log: callable(str), progress lines.
      extra: more arguments of the child (``--zero-stage`` and its model).

    Returns:
      dict, the child's only result row.

    Raises:
      subprocess.CalledProcessError: the child failed.
    """
    log(f"K={num_devices}: timing in a child process")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train.json")
        argv = [sys.executable, "-m", "tfreduce.bench", "--mode", "train", *extra,
                "--grid-devices", str(num_devices), "--device-type", args.device_type,
                "--batch-size", str(args.batch_size), "--image-size", str(args.image_size),
                "--steps", str(args.steps), "--rounds", str(args.rounds), "--warmup",
                str(args.warmup), "--json", path, "--quiet"]
        if args.algorithms:
            argv += ["--algorithms", ",".join(args.algorithms)]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return json.load(f)["results"][0]


def _train_in_child(args, num_devices, log):
    row = row_in_child(args, num_devices, log)
    log(f"K={num_devices}: trainer {row['trainer_images_per_s']:.0f} images/s, "
        f"fit {row['fit_images_per_s']:.0f} images/s, fit with tfreduce "
        f"{row['tfreduce_fit_images_per_s']:.0f} images/s, {num_devices} processes "
        f"{row['horovod_images_per_s']:.0f} images/s")
    return row


def _train_one(args, num_devices, log):
    # Times the three contenders for one K in this process; returns the result row.
    devices = logical_devices(num_devices, args.device_type)
    batch, side, num_classes, num_batches = args.batch_size, args.image_size, 10, 8
    rng = np.random.default_rng(0)
    x = rng.random((batch * num_batches, side, side, 1), dtype=np.float32)
    y = rng.integers(0, num_classes, size=batch * num_batches).astype(np.int32)
    algorithm = (args.algorithms or ["auto"])[0]
    log(f"K={num_devices}: building ReplicatedTrainer({algorithm}) and MirroredStrategy, "
        f"by default and with CrossDeviceOps({algorithm})")
    make_model = cnn_builder(x.shape[1:], num_classes)
    _, trainer_round = trainer_rounds(devices, algorithm, x, y, batch, make_model)
    strategy, fit_round = fit_rounds(devices, x, y, batch, make_model)
    _, tfreduce_fit_round = fit_rounds(devices, x, y, batch, make_model,
                                       tfreduce.CrossDeviceOps(algorithm))
    rates = alternate_rounds({"ReplicatedTrainer": trainer_round, "MirroredStrategy.fit": fit_round,
                        "MirroredStrategy.fit+tfreduce": tfreduce_fit_round}, args, batch)
    log(f"K={num_devices}: {num_devices} processes with DistributedOptimizer")
    rates["DistributedOptimizer"] = _horovod_rates(args, num_devices)
    log(f"K={num_devices}: the same without the watchdog (--stall-seconds 0)")
    rates["DistributedOptimizer, no watchdog"] = _horovod_rates(args, num_devices, 0)
    medians = {name: statistics.median(v) for name, v in rates.items()}
    log(f"K={num_devices}: trainer {medians['ReplicatedTrainer']:.0f} images/s, "
        f"fit {medians['MirroredStrategy.fit']:.0f} images/s, fit with tfreduce "
        f"{medians['MirroredStrategy.fit+tfreduce']:.0f} images/s, {num_devices} processes "
        f"{medians['DistributedOptimizer']:.0f} images/s")

    def paired(name):
        # Rounds rotate the contenders' order, so compare them round by round.
        return statistics.median(
            t / f for t, f in zip(rates[name], rates["MirroredStrategy.fit"]))

    return {
        "devices": num_devices,
        "trainer_images_per_s": medians["ReplicatedTrainer"],
        "fit_images_per_s": medians["MirroredStrategy.fit"],
        "tfreduce_fit_images_per_s": medians["MirroredStrategy.fit+tfreduce"],
        "horovod_images_per_s": medians["DistributedOptimizer"],
        "horovod_over_fit": medians["DistributedOptimizer"] / medians["MirroredStrategy.fit"],
        "horovod_over_trainer": medians["DistributedOptimizer"] / medians["ReplicatedTrainer"],
        "horovod_rounds": rates["DistributedOptimizer"],
        # The watchdog's heartbeats and step timing, against the same run
        # without them: images/s with it over images/s without (medians).
        "watchdog_ratio": (medians["DistributedOptimizer"]
                           / medians["DistributedOptimizer, no watchdog"]),
        "no_watchdog_rounds": rates["DistributedOptimizer, no watchdog"],
        "trainer_over_fit": paired("ReplicatedTrainer"),
        "tfreduce_fit_over_fit": paired("MirroredStrategy.fit+tfreduce"),
        "trainer_rounds": rates["ReplicatedTrainer"],
        "fit_rounds": rates["MirroredStrategy.fit"],
        "tfreduce_fit_rounds": rates["MirroredStrategy.fit+tfreduce"],
        # Which reduction MirroredStrategy chose here (no public accessor).
        "strategy_cross_device_ops": type(
            getattr(strategy.extended, "_cross_device_ops", None)
            or getattr(strategy.extended, "_inferred_cross_device_ops", None)).__name__,
    }


def _horovod_rates(args, num_processes, stall_seconds=None):
    # Images/s of each round of the Horovod-style contender: num_processes
    # processes on 127.0.0.1 under the launcher, one device each (with the
    # launcher's --stall-seconds when given; 0: no watchdog).
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "horovod.json")
        worker = [sys.executable, "-m", "tfreduce.bench.horovod_worker", "--batch-size",
                  str(args.batch_size), "--image-size", str(args.image_size), "--steps",
                  str(args.steps), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                  "--json", path]
        stall = [] if stall_seconds is None else ["--stall-seconds", str(stall_seconds)]
        command = [sys.executable, "-m", "tfreduce.launch", "--workers", str(num_processes),
                   "--timeout", "1800", "--preload", "tensorflow", *stall, "--"] + worker
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the DistributedOptimizer processes failed (exit "
                               f"{done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        with open(path) as f:
            return json.load(f)["rates"]


def _loss():
    import keras  # Only the train mode needs Keras; it is slow to import.
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def cnn_builder(input_shape, num_classes):
    """() -> the example's CNN (tfreduce.trainer.models.image_cnn) for these images."""
    from tfreduce.trainer.models import image_cnn
    return lambda: image_cnn(input_shape, num_classes)


def model_result(mode, args, rows, **config):
    """The result of a mode that trains --train-model: its settings, the rows per K, the machine.

    Args:
      mode: str, the result's mode.
      args: argparse.Namespace from ``cli.parse_args``.
      rows: list of dicts, one per K.
      **config: the mode's own settings, added to the config.
    """
    return {
        "mode": mode,
        "config": {"model": args.train_model, "image_size": image_side(args),
                   "batch_size": args.batch_size, "steps_per_round": args.steps,
                   "rounds": args.rounds, "algorithm": (args.algorithms or ["auto"])[0],
                   "device_type": args.device_type, **config},
        "results": rows,
        "environment": environment(),
    }


def model_title(cfg):
    """The start of a table's title for a mode of ``model_result``: model, images, batch, Adam,
    algorithm."""
    return (f"{cfg['model']}, {cfg['image_size']}x{cfg['image_size']} images, global batch "
            f"{cfg['batch_size']}, Adam, algorithm={cfg['algorithm']!r}")


def image_side(args):
    """The side of --train-model's square images (keras.applications take at least 32)."""
    return args.image_size if args.train_model in ("cnn", "mlp") else max(args.image_size, 32)


def image_workload(args, num_classes, num_batches=4):
    """--train-model's random data and builder: (x, y, make_model).

    x: float32 [num_batches * --batch-size, side, side, channels] in [0, 1)
    (one channel for cnn and mlp, three for keras.applications), y: int32
    labels below num_classes, both from seed 0.
    """
    side = image_side(args)
    channels = 1 if args.train_model in ("cnn", "mlp") else 3
    count = args.batch_size * num_batches
    rng = np.random.default_rng(0)
    x = rng.random((count, side, side, channels), dtype=np.float32)
    y = rng.integers(0, num_classes, size=count).astype(np.int32)
    return x, y, model_builder(args, x.shape[1:], num_classes)


def model_builder(args, input_shape, num_classes):
    """() -> --train-model: the example's CNN, an MLP or a keras.applications model.

    "mlp" is 3 Dense layers of 1,024 units on the flattened images (about
    3 M parameters: much to reduce for little compute). A keras.applications
    model is built with weights=None. Every model outputs logits, as the
    trainer's loss takes them.
    """
    if args.train_model == "cnn":
        return cnn_builder(input_shape, num_classes)
    if args.train_model == "mlp":
        import keras

        return lambda: keras.Sequential(
            [keras.Input(input_shape), keras.layers.Flatten()]
            + [keras.layers.Dense(1024, activation="relu") for _ in range(3)]
            + [keras.layers.Dense(num_classes)])
    from tfreduce.bench.workloads import keras_application

    application = keras_application(args.train_model)
    return lambda: application(weights=None, input_shape=input_shape, classes=num_classes,
                               classifier_activation=None)


def trainer_rounds(devices, algorithm, x, y, batch, make_model, zero_stage=0, jit_compile=False):
    """A ReplicatedTrainer (Adam) on the devices, built on the first batch.

    Args:
      algorithm: str, the trainer's algorithm, or a tfreduce.Reduction.
      zero_stage, jit_compile: the trainer's.

    Returns:
      (the trainer, round(steps) -> seconds of `steps` train steps).
    """
    import keras

    from tfreduce.trainer import ReplicatedTrainer

    num_batches = len(x) // batch
    trainer = ReplicatedTrainer(
        model_fn=make_model, loss=_loss(), optimizer_fn=lambda: keras.optimizers.Adam(1e-3),
        devices=devices, average=True, zero_stage=zero_stage, jit_compile=jit_compile,
        **({"reduction": algorithm} if isinstance(algorithm, tfreduce.Reduction)
           else {"algorithm": algorithm}))
    batches = [(tf.constant(x[i * batch:(i + 1) * batch]),
                tf.constant(y[i * batch:(i + 1) * batch])) for i in range(num_batches)]

    def trainer_round(steps):
        # train_step returns the loss as a float, so each step is waited for.
        trainer.train_step(*batches[0])
        start = time.perf_counter()
        for step in range(1, steps + 1):
            trainer.train_step(*batches[step % num_batches])
        return time.perf_counter() - start

    return trainer, trainer_round


def fit_rounds(devices, x, y, batch, make_model, cross_device_ops=None):
    """The model compiled (Adam) under MirroredStrategy on the devices.

    Args:
      cross_device_ops: its reduction; None: the strategy's default.

    Returns:
      (strategy, round(steps) -> seconds of `steps` steps of model.fit).
    """
    import keras

    strategy = tf.distribute.MirroredStrategy(devices=devices,
                                              cross_device_ops=cross_device_ops)
    with strategy.scope():
        model = make_model()
        # No XLA on either side: ReplicatedTrainer does not compile either.
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=_loss(),
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

    return strategy, fit_round


def alternate_rounds(rounds, args, batch):
    """Images per second of each contender over --rounds rounds of --steps steps.

    The first call of each (tracing) is left out; each round starts with the
    next contender, alternating direction too.

    Returns:
      dict name -> list of --rounds rates.
    """
    for run_round in rounds.values():
        run_round(max(args.warmup, 1))  # the first call traces
    rates = {name: [] for name in rounds}
    names = list(rounds)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order if r % 2 == 0 else order[::-1]:
            rates[name].append(args.steps * batch / rounds[name](args.steps))
    return rates


def print_result(result, out=None):
    """Prints the train result as a table to ``out`` (a file; None: stdout).

    Args:
      result: dict returned by ``run`` (config, one result row per K).
      out: a text file, or None for stdout.
    """
    cfg = result["config"]
    title = (f"{cfg['model']}, {cfg['image_size']}x{cfg['image_size']} images, global batch "
             f"{cfg['batch_size']}, median of {cfg['rounds']} rounds of "
             f"{cfg['steps_per_round']} steps; ReplicatedTrainer and CrossDeviceOps with "
             f"algorithm={cfg['algorithm']!r}")
    # x/fit: median over rounds of the two rates' ratio in each round; hvd:
    # K processes with DistributedOptimizer, a ratio of medians; watchdog:
    # hvd's images/s over the same run's without the watchdog.
    header = (f"{'K':>3s} {'trainer img/s':>14s} {'fit img/s':>10s} "
              f"{'fit+tfreduce img/s':>19s} {'hvd img/s':>10s} {'trainer/fit':>12s} "
              f"{'fit+tfreduce/fit':>17s} {'hvd/fit':>8s} {'hvd/trainer':>12s} "
              f"{'watchdog':>9s}")
    print_table(title, header, [
        f"{r['devices']:3d} {r['trainer_images_per_s']:14.0f} {r['fit_images_per_s']:10.0f} "
        f"{r['tfreduce_fit_images_per_s']:19.0f} {r['horovod_images_per_s']:10.0f} "
        f"{r['trainer_over_fit']:12.2f} {r['tfreduce_fit_over_fit']:17.2f} "
        f"{r['horovod_over_fit']:8.2f} {r['horovod_over_trainer']:12.2f} "
        f"{r['watchdog_ratio']:9.3f}"
        for r in result["results"]], out)
