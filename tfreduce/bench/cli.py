"""The ``tfreduce-bench`` command line: options, checks and the run of one mode.

Arguments are parsed before TensorFlow is imported, so ``--help`` and usage
errors answer at once; each mode's module (all import TensorFlow) is loaded
only to run it.
"""

import argparse
import importlib
import json
import sys

from tfreduce.basis.choices import (ALGORITHMS, BENCH_FAMILIES, COLLECTIVES, DEFAULT_PACK_BYTES,
                                    bench_compression)
from tfreduce.basis.startup import ArgumentParser, import_tensorflow
from tfreduce.basis.topology import PRESETS
from tfreduce.bench.units import format_bytes, parse_bytes
from tfreduce.bench.workloads import keras_application

__all__ = ["MODES", "main", "parse_args"]

#: ``--mode`` values; mode M runs ``tfreduce.bench.M_mode`` (run, print_result).
MODES = ("allreduce", "train", "scaling", "soak", "multiworker", "collective", "faults",
         "crossprocess")


def _parse_list(text, convert, what):
    try:
        values = [convert(item) for item in text.split(",") if item.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{what}: {error}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{what}: give at least one value")
    return values


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv):
    """Parses and checks the command line.

    Args:
      argv: list of str, the arguments without the program name (None:
        sys.argv[1:]).

    Returns:
      (parser, args): the argparse.ArgumentParser and its Namespace.

    Raises:
      SystemExit: status 2 with a usage error for a bad value (unknown
        contender or algorithm, a malformed byte count, K < 1).
    """
    parser = ArgumentParser(
        prog="tfreduce-bench",
        description="Time tfreduce's all-reduce algorithms against tensorpack, "
                    "tf.distribute and the memory floor on K devices.")
    parser.add_argument("--mode", choices=MODES, default="allreduce",
                        help="allreduce (default): reductions of model gradients; train: "
                             "ReplicatedTrainer vs MirroredStrategy model.fit; scaling: "
                             "cost over a grid of K and N; soak: --soak-steps of fit, "
                             "watching retracing and memory; multiworker: --workers "
                             "processes on 127.0.0.1 through the launcher, the per-tensor "
                             "collective against tfreduce, fp16 and PowerSGD; collective: "
                             "the --collective list against tf.distribute and plain ops; "
                             "faults: --runs fault drills of 2 workers (--fault); "
                             "crossprocess: one all-reduce across --workers processes, "
                             "tfreduce traced and eager, TF's op and MPI, per --sizes")
    parser.add_argument("--collective", default=None, metavar="NAME[,NAME]",
                        type=lambda s: _parse_list(s, str, "--collective"),
                        help=f"collective mode (implied): any of {','.join(COLLECTIVES)}; "
                             "S per rank is --total-bytes (default 4MiB)")
    parser.add_argument("--devices", type=_positive_int, default=None, metavar="K",
                        help="number of devices (towers); default 8, multiworker mode 2 "
                             "per worker")
    parser.add_argument("--workers", type=_positive_int, default=2, metavar="W",
                        help="multiworker and crossprocess modes: processes on 127.0.0.1; "
                             "default %(default)s")
    parser.add_argument("--sizes", default=None, metavar="BYTES[,BYTES]",
                        type=lambda s: _parse_list(s, parse_bytes, "--sizes"),
                        help="crossprocess mode: the all-reduce sizes; default "
                             "4KiB,256KiB,4MiB,32MiB")
    parser.add_argument("--powersgd-rank", type=_positive_int, default=4, metavar="R",
                        help="multiworker mode: rank of the PowerSGD contender; default "
                             "%(default)s")
    parser.add_argument("--device-type", choices=("cpu", "gpu"), default="cpu",
                        help="cpu (default): K logical CPU devices; gpu: the first K GPUs")
    parser.add_argument("--model", default="resnet50",
                        help="a keras.applications model name, built with weights=None, or "
                             "'synthetic'; default %(default)s")
    parser.add_argument("--num-tensors", type=_positive_int, default=100, metavar="N",
                        help="number of equal tensors for --model synthetic; default "
                             "%(default)s")
    parser.add_argument("--total-bytes", type=parse_bytes, default=None, metavar="BYTES",
                        help="bytes per tower: rescales the model's tensors to this total "
                             "(e.g. 1MB), or sizes the synthetic tensors (default 4KiB each)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "float64"),
                        default="float32", help="gradient dtype; default %(default)s")
    parser.add_argument("--reduce", choices=("mean", "sum"), default="mean",
                        help="default %(default)s")
    parser.add_argument("--steps", type=_positive_int, default=20,
                        help="timed rounds, each running every contender once (train mode: "
                             "steps per round); default %(default)s")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed runs per contender; default %(default)s")
    parser.add_argument("--pack-bytes", default=[DEFAULT_PACK_BYTES], metavar="BYTES[,BYTES]",
                        type=lambda s: _parse_list(s, parse_bytes, "--pack-bytes"),
                        help="pack sizes of the packed variants; default "
                             f"{format_bytes(DEFAULT_PACK_BYTES)} (choices.DEFAULT_PACK_BYTES)")
    parser.add_argument("--packing", choices=("both", "on", "off"), default="both",
                        help="run tfreduce algorithms unpacked, packed, or both (default)")
    parser.add_argument("--compression", default=["none"], metavar="C[,C]",
                        type=lambda s: _parse_list(s, str, "--compression"),
                        help="allreduce mode: run every tfreduce variant with each of none, "
                             "fp16, bf16, powersgdR (PowerSGD of rank R); default none")
    parser.add_argument("--predict", default=None, metavar="PRESET[,PRESET]",
                        type=lambda s: _parse_list(s, str, "--predict"),
                        help="allreduce mode: also print tfreduce.predict's times per contender "
                             "on these topology presets (host: this machine, measured by a "
                             f"probe; {', '.join(sorted(PRESETS))})")
    parser.add_argument("--contenders", default=None, metavar="NAME[,NAME]",
                        type=lambda s: _parse_list(s, str, "--contenders"),
                        help=f"run only these of {','.join(BENCH_FAMILIES)}; default all")
    parser.add_argument("--grid-devices", default=None, metavar="K[,K]",
                        type=lambda s: _parse_list(s, _positive_int, "--grid-devices"),
                        help="train and scaling modes: the K values; default 2,4,8 (train), "
                             "2,4,8,16,32 (scaling)")
    parser.add_argument("--grid-tensors", default=None, metavar="N[,N]",
                        type=lambda s: _parse_list(s, _positive_int, "--grid-tensors"),
                        help="scaling mode: the N values; default 10,100,1000")
    parser.add_argument("--tensor-bytes", type=parse_bytes, default=1024, metavar="BYTES",
                        help="scaling mode: bytes per tensor, rounded down to a multiple of "
                             "64; default 1KiB")
    parser.add_argument("--algorithms", default=None, metavar="NAME[,NAME]",
                        type=lambda s: _parse_list(s, str, "--algorithms"),
                        help="scaling mode: tfreduce algorithms, NAME+pack for packed; "
                             "default flat,hierarchical,flat+pack,hierarchical+pack,ring+pack. "
                             "train mode: the trainer's algorithm; default auto")
    parser.add_argument("--batch-size", type=_positive_int, default=128,
                        help="train mode: global batch size; default %(default)s")
    parser.add_argument("--zero-stage", type=lambda t: _parse_list(t, int, "--zero-stage"),
                        default=None, metavar="S[,S]",
                        help="train mode: ReplicatedTrainer at these ZeRO stages (0, 1, 2) "
                             "beside MirroredStrategy.fit, with state bytes per device")
    parser.add_argument("--deterministic", nargs="?", const="compare",
                        choices=("compare", "on", "off"), default=None,
                        help="train mode: ReplicatedTrainer with deterministic=True against the "
                        "default, each in its own process, per K (default K 4 and 8); on/off: "
                        "one variant in this process")
    parser.add_argument("--jit-compile", action="store_true",
                        help="train mode: ReplicatedTrainer with jit_compile=True (each tower "
                        "one XLA cluster) against uncompiled, alternating rounds in this "
                        "process, per K (default K 2 and 4), with the compile time")
    parser.add_argument("--overlap", action="store_true",
                        help="train mode: ReplicatedTrainer with its reduction overlapping the "
                        "backward pass, behind a barrier, and without one (compute only): "
                        "exposed communication per K (default K 4 and 8)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="train mode (implies --overlap): write the overlapping trainer's "
                        "timeline of a few steps: Chrome trace JSON, or a Gantt chart for .png; "
                        "FILE-K<k> for each K of several")
    parser.add_argument("--train-model", default="cnn", metavar="NAME",
                        help="--zero-stage's and --overlap's model: the example's cnn "
                             "(default), mlp (3 Dense layers of 1,024) or a keras.applications "
                             "name (weights=None), e.g. mobilenetv2")
    parser.add_argument("--image-size", type=_positive_int, default=28,
                        help="train mode: side of the square one-channel images; default "
                             "%(default)s")
    parser.add_argument("--soak-steps", type=_positive_int, default=2000,
                        help="soak mode: training steps (rounded up to whole epochs); "
                             "default %(default)s")
    parser.add_argument("--rounds", type=_positive_int, default=5,
                        help="train mode: timed rounds per contender; default %(default)s")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the run that checks values and pruning")
    parser.add_argument("--fault", choices=("freeze", "lag", "vanish", "clean", "cost",
                                            "recover"),
                        default="freeze",
                        help="faults mode: what rank 1 does at --fault-step: SIGSTOP, 50 ms "
                             "more per step, a clean exit while rank 0 waits, or nothing; "
                             "cost: clean runs with the watchdog on and off, alternately; "
                             "recover: an elastic job of 3 loses one, the time to go on; "
                             "default %(default)s")
    parser.add_argument("--fault-loop", choices=("tape", "eager", "fit", "trainer"),
                        default="tape",
                        help="faults mode: Horovod's DistributedGradientTape in a tf.function, "
                             "the same eagerly, fit with DistributedOptimizer, or (recover "
                             "only) ReplicatedTrainer.fit; default %(default)s")
    parser.add_argument("--fault-step", type=_positive_int, default=30, metavar="S",
                        help="faults mode: the step rank 1 acts at; default %(default)s")
    parser.add_argument("--fault-steps", type=_positive_int, default=300, metavar="N",
                        help="faults mode: steps of each run; default %(default)s")
    parser.add_argument("--commit-every", type=_positive_int, default=10, metavar="N",
                        help="faults mode, recover: steps between two commits; default "
                             "%(default)s")
    parser.add_argument("--runs", type=_positive_int, default=30,
                        help="faults mode: launches, each from fresh processes; default "
                             "%(default)s")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    parser.add_argument("--png", default=None, metavar="PATH",
                        help="allreduce mode: write a bar chart here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--verbose", action="store_true",
                        help="show TensorFlow's start-up and C++ log lines (hidden by default)")
    args = parser.parse_args(argv)
    if args.collective is not None:
        unknown = sorted(set(args.collective) - set(COLLECTIVES))
        if unknown:
            parser.error(f"--collective: unknown {unknown}; choose from {list(COLLECTIVES)}")
        if args.mode not in ("allreduce", "collective"):
            parser.error(f"--collective runs the collective mode, not --mode {args.mode}")
        args.mode = "collective"
    elif args.mode == "collective":
        args.collective = list(COLLECTIVES)
    if args.zero_stage is not None:
        if args.mode != "train":
            parser.error(f"--zero-stage runs the train mode, not --mode {args.mode}")
        if not set(args.zero_stage) <= {0, 1, 2}:
            parser.error(f"--zero-stage: stages are 0, 1 and 2, got {args.zero_stage}")
    if args.trace is not None:
        if args.mode != "train":
            parser.error(f"--trace records the train mode (--mode train), not --mode {args.mode}")
        args.overlap = True
    if args.overlap and (args.mode != "train" or args.zero_stage):
        parser.error("--overlap runs the train mode, without --zero-stage")
    if args.deterministic and (args.mode != "train" or args.zero_stage or args.overlap):
        parser.error("--deterministic runs the train mode, without --zero-stage or --overlap")
    if args.jit_compile and (args.mode != "train" or args.zero_stage or args.overlap
                             or args.deterministic):
        parser.error("--jit-compile runs the train mode, without --zero-stage, --overlap or "
                     "--deterministic")
    if (args.fault_loop == "trainer") != (args.fault == "recover") and args.fault_loop in (
            "trainer", "eager"):
        parser.error(f"--fault-loop {args.fault_loop} runs "
                     f"{'only' if args.fault_loop == 'trainer' else 'every fault but'} "
                     f"--fault recover, not --fault {args.fault}")
    if args.devices is None:
        args.devices = 2 if args.mode == "multiworker" else 8
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.contenders:
        unknown = sorted(set(args.contenders) - set(BENCH_FAMILIES))
        if unknown:
            parser.error(f"--contenders: unknown {unknown}; choose from {list(BENCH_FAMILIES)}")
    unknown = sorted(set(args.predict or []) - set(PRESETS) - {"host"})
    if unknown:
        parser.error(f"--predict: unknown {unknown}; choose from host, "
                     f"{', '.join(sorted(PRESETS))}")
    bad = []
    for item in args.compression:
        try:
            bench_compression(item)
        except ValueError:
            bad.append(item)
    if bad:
        parser.error(f"--compression: unknown {bad}; use none, fp16, bf16 or powersgdR "
                     "(R the rank, e.g. powersgd4)")
    if args.algorithms:
        known = set(ALGORITHMS)
        bad = [a for a in args.algorithms if a.partition("+")[0] not in known
               or a.partition("+")[2] not in ("", "pack")]
        if bad:
            parser.error(f"--algorithms: unknown {bad}; use names in {list(known)}, "
                         f"optionally with '+pack'")
    return parser, args


def main(argv=None):
    """Runs the benchmark; returns the exit status.

    Prints the mode's table to stdout and progress to stderr; writes the
    result as JSON (``--json``) and the allreduce bar chart (``--png``).

    Args:
      argv: list of command-line arguments, None for sys.argv[1:].

    Returns:
      int, 0; 130 after Ctrl-C (one line, no traceback).

    Raises:
      SystemExit: status 2 with a usage error for a bad argument, including
        an unknown Keras model, fewer GPUs than --devices, and a train-mode K
        this process cannot have.
    """
    parser, args = parse_args(argv)
    try:
        return _run(parser, args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _run(parser, args):
    """main's work once the arguments are parsed."""
    tf = import_tensorflow(args.verbose)
    from tfreduce.basis.devices import logical_devices

    if args.device_type == "gpu":
        found = len(tf.config.list_physical_devices("GPU"))
        if found < args.devices:
            parser.error(f"--devices {args.devices} --device-type gpu: this machine has "
                         f"{found} GPUs")

    def log(message):
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    in_process = {"train": args.grid_devices[0] if args.grid_devices
                  and len(args.grid_devices) == 1 else None, "soak": args.devices}
    if in_process.get(args.mode):
        # In this process, before anything else touches TensorFlow's runtime.
        try:
            logical_devices(in_process[args.mode], args.device_type)
        except ValueError as error:
            parser.error(str(error))
    for model in ([args.model] if args.mode == "allreduce" and args.model != "synthetic"
                  else []) + ([args.train_model] if (args.zero_stage or args.overlap
                                                     or args.deterministic
                                                     or args.jit_compile) and
                              args.train_model not in ("cnn", "mlp") else []):
        try:
            keras_application(model)
        except ValueError as error:
            parser.error(str(error))
    name = args.mode
    if args.mode == "train" and (args.zero_stage or args.overlap or args.deterministic
                                 or args.jit_compile):
        name = ("zero" if args.zero_stage else "overlap" if args.overlap
                else "jit" if args.jit_compile else "determinism")
    mode = importlib.import_module(f"tfreduce.bench.{name}_mode")
    result = mode.run(args, log)
    mode.print_result(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        log(f"wrote {args.json}")
    if args.png:
        if args.mode == "allreduce":
            mode.plot(result, args.png)
            log(f"wrote {args.png}")
        else:
            log(f"--png draws the allreduce mode only; nothing drawn for --mode {args.mode}")
    return 0
