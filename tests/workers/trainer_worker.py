"""ReplicatedTrainer on one worker of a cluster, or on one process for reference.

Under TF_CONFIG (tests/test_multiworker.py starts it through the launcher),
each worker builds a ``ReplicatedTrainer`` (cluster="auto") on K logical CPU
devices and fits one epoch of 53 examples in global batches of 10 (shards 3,
3, 2, 2 over 2 x 2 towers; the last batch of 3 is smaller than the 4 towers
and skipped: 5 steps). Every rank starts from other random weights, so only
the broadcast from rank 0 makes them agree. Then it evaluates and predicts
on all the data and writes ``rank<r>.npz``. ``fit_reference`` runs the same
fit in one process with 4 towers, what the cluster must reproduce.

``--runs FILE`` fits several settings in turn in one process, on one started
cluster (the JSON file maps each run's name to its arguments), as a user
trains several models in one job; each run's lines then name it.
``--logdir DIR`` gives rank r the directory DIR/rank<r> for summaries and
checkpoints (only rank 0 may write there); ``--resume`` restores rank 0's
latest checkpoint before fitting up to ``--epochs``. ``--nan-row R`` and
``--drop-rows A:B`` change the data fitted on (a NaN in row R; rows A..B-1
left out), not the data evaluated and predicted on. ``--zero-stage S``
shards the optimizer state over the 4 towers of both workers.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
from helpers import thread_count  # noqa: E402

FEATURES, HIDDEN, CLASSES = 8, 16, 3
EXAMPLES, GLOBAL_BATCH = 53, 10


def data(nan_row=None, drop_rows=None):
    """x [53, 8] float32 and y [53] int32 class labels.

    Args:
      nan_row: int, x[nan_row] is NaN; or None.
      drop_rows: (a, b), rows a..b-1 are left out; or None.
    """
    rng = np.random.default_rng(7)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32) + (x[:, 2] > 1).astype(np.int32)
    if nan_row is not None:
        x[nan_row] = np.nan
    if drop_rows is not None:
        keep = np.r_[0:drop_rows[0], drop_rows[1]:EXAMPLES]
        x, y = x[keep], y[keep]
    return x, y


def make_model(seed, hidden=HIDDEN, dict_inputs=False):
    """A dense classifier with BatchNormalization, weights drawn from `seed`.

    With dict_inputs, the same layers as a functional model of the input
    {"features": x}, as models with several inputs take them."""
    layers = [
        keras.layers.Dense(
            hidden,
            activation="relu",
            kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
            bias_initializer=keras.initializers.RandomNormal(seed=seed + 1),
        ),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dense(
            CLASSES, kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 2)
        ),
    ]
    if not dict_inputs:
        return keras.Sequential([keras.Input((FEATURES,))] + layers)
    features = keras.Input((FEATURES,), name="features")
    out = features
    for layer in layers:
        out = layer(out)
    return keras.Model({"features": features}, out)


def make_trainer(devices, seed, cluster, hidden=HIDDEN, dict_inputs=False, **options):
    from tfreduce.trainer import ReplicatedTrainer

    return ReplicatedTrainer(
        lambda: make_model(seed, hidden, dict_inputs),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        devices=devices,
        cluster=cluster,
        **options,
    )


def run(trainer, epochs, logdir, shuffle=True, fit_data=None, profile_steps=None,
        dict_inputs=False):
    """Fits (on `fit_data`, or data()), evaluates and predicts; returns a dict of results."""
    x, y = data()
    if dict_inputs:
        x, fit_data = {"features": x}, ({"features": fit_data[0]}, fit_data[1])
    history = trainer.fit(
        *(fit_data or (x, y)),
        epochs=epochs,
        batch_size=GLOBAL_BATCH,
        shuffle=shuffle,
        seed=3,
        logdir=logdir,
        checkpoint_dir=None if logdir is None else os.path.join(logdir, "ckpt"),
        verbose=0,
        profile_steps=profile_steps,
    )
    results = trainer.evaluate(x, y, batch_size=16)
    out = {
        "step": trainer.step,
        "skipped_steps": trainer.skipped_steps,
        "loss": np.array(history["loss"]),
        "accuracy": np.array(history["accuracy"]),
        "eval_loss": results["loss"],
        "eval_accuracy": results["accuracy"],
        "predict": trainer.predict(x, batch_size=16),
    }
    for k, model in enumerate(trainer.models):
        for n, v in enumerate(model.variables):
            out[f"{k}/{n}"] = v.numpy()
        for n, v in enumerate(trainer.optimizers[k].variables):
            out[f"{k}/optimizer/{n}"] = v.numpy()
    return out


def update_options(accumulate_steps=1, powersgd_rank=0, on_nonfinite="raise",
                   compression="none"):
    """The trainer options of --accumulate-steps, --powersgd-rank (0: none), --on-nonfinite
    and --compression."""
    from tfreduce.algorithms.powersgd import PowerSGD

    options = {"accumulate_steps": accumulate_steps, "on_nonfinite": on_nonfinite,
               "compression": compression}
    if powersgd_rank:
        options["powersgd"] = PowerSGD(rank=powersgd_rank, min_compression_rate=0)
    return options


def fit_reference(devices, epochs=1, **options):
    """One process with len(devices) towers, hierarchical over pairs."""
    trainer = make_trainer(
        devices, 0, None, algorithm="hierarchical", groups=[[0, 1], [2, 3]], **options
    )
    return run(trainer, epochs, None)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=None,
                        help="a JSON file of {name: [arguments]}: each fit in turn, in one "
                             "process and one cluster; the other options are then ignored")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--logdir", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", help="directory for rank<r>.npz")
    parser.add_argument("--accumulate-steps", type=int, default=1)
    parser.add_argument("--powersgd-rank", type=int, default=0, help="0: no PowerSGD")
    parser.add_argument("--on-nonfinite", default="raise")
    parser.add_argument("--compression", default="none")
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--mixed", action="store_true", help="Keras' mixed_float16 policy")
    parser.add_argument("--no-shuffle", action="store_true")
    parser.add_argument("--profile-steps", default=None, help="A,B: fit's profile_steps")
    parser.add_argument("--nan-row", type=int, default=None)
    parser.add_argument("--drop-rows", default=None, help="A:B, rows A..B-1 left out of fit")
    parser.add_argument("--rank1-devices", type=int, default=None,
                        help="rank 1 uses this many devices instead (a mistake to detect)")
    parser.add_argument("--dict-inputs", action="store_true",
                        help="the model takes {'features': x}, the data is given so")
    parser.add_argument("--rank1-hidden", type=int, default=HIDDEN,
                        help="rank 1's hidden layer size (a mistake to detect)")
    return parser.parse_args(argv)


def fit_on_cluster(args, cluster, devices, name=None):
    """One run of the options `args` on this worker's devices; writes rank<r>.npz."""
    rank = cluster.rank
    said = f"rank {rank}: " if name is None else f"rank {rank}: {name}: "
    keras.mixed_precision.set_global_policy("mixed_float16" if args.mixed else "float32")
    hidden = args.rank1_hidden if rank == 1 else HIDDEN
    # Every rank starts from other weights: only the broadcast makes them agree.
    trainer = make_trainer(devices, rank, cluster, hidden=hidden, algorithm="flat",
                           zero_stage=args.zero_stage, dict_inputs=args.dict_inputs,
                           **update_options(args.accumulate_steps, args.powersgd_rank,
                                            args.on_nonfinite, args.compression))
    assert trainer.cluster.rank == rank and trainer.is_chief == (rank == 0)
    logdir = None if args.logdir is None else os.path.join(args.logdir, f"rank{rank}")
    if args.resume:
        restored = trainer.restore(os.path.join(logdir, "ckpt"))
        print(f"{said}restored {restored} at step {trainer.step}", flush=True)
    drop = None if args.drop_rows is None else [int(r) for r in args.drop_rows.split(":")]
    steps = None if args.profile_steps is None else tuple(
        int(s) for s in args.profile_steps.split(","))
    threads = thread_count()
    out = run(trainer, args.epochs, logdir, shuffle=not args.no_shuffle,
              fit_data=data(args.nan_row, drop), profile_steps=steps,
              dict_inputs=args.dict_inputs)
    # No thread per collective (tests/test_multiworker.py): fit, evaluate, predict.
    print(f"{said}threads {threads} -> {thread_count()}", flush=True)
    np.savez(os.path.join(args.out, f"rank{rank}.npz"), **out)
    print(f"{said}finished at step {trainer.step}", flush=True)


def main(argv=None):
    args = parse_args(argv)
    from tfreduce.workers.cluster import Cluster

    # One cluster for every run: its collective keys go on from run to run.
    cluster = Cluster.from_tf_config()
    runs = {None: args}
    if args.runs is not None:
        with open(args.runs) as f:
            runs = {name: parse_args(argv) for name, argv in json.load(f).items()}
    first = next(iter(runs.values()))
    num_devices = (first.rank1_devices if cluster.rank == 1 and first.rank1_devices
                   else first.devices)
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices
    )
    devices = [f"/cpu:{k}" for k in range(num_devices)]
    for name, run_args in runs.items():
        fit_on_cluster(run_args, cluster, devices, name)


if __name__ == "__main__":
    sys.exit(main())
