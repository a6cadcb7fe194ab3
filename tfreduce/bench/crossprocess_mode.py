"""The crossprocess mode: one all-reduce across W processes on 127.0.0.1, six ways.

Runs ``tfreduce.bench.crossprocess_worker`` in W processes (``--workers``)
and prints rank 0's median milliseconds per call for each size
(``--sizes``) and contender: tfreduce's ``hvd.allreduce`` traced and eager,
a grouped all-reduce of 64 pieces (fused), TF's own ``CollectiveReduceV2``
in the same processes, and MPI's ``Allreduce`` (mpi4py) when ``mpirun``
and mpi4py are installed, in which case the processes are started by
``mpirun``, every contender runs in them, and tfreduce's eager calls go
over its MPI transport (and once more over gRPC, for the comparison).
The rounds interleave the contenders (``--steps`` rounds), so the ratios
printed under the table compare times taken under the same load: eager
over traced, tfreduce over TF's own op, MPI's bandwidth over tfreduce's
on MPI, and the fused calls over one MPI call of their bytes. The
numbers are the machine's, not a model of it: on a shared host, read the
ratios.
"""

import os
import shutil
import subprocess
import sys
import tempfile

from tfreduce.bench.harness import environment, processes_result
from tfreduce.bench.tables import print_table
from tfreduce.bench.units import format_bytes

__all__ = ["run", "print_result", "DEFAULT_SIZES"]

#: The sizes of the issue's table: 4 KiB, 256 KiB, 4 MiB and 32 MiB.
DEFAULT_SIZES = (4 << 10, 256 << 10, 4 << 20, 32 << 20)
#: The launcher's (or mpirun's) limit on the whole run, seconds.
TIMEOUT_S = 1800


def _mpirun():
    """The mpirun command, or (None, why) when MPI is not installed."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None, "mpirun not found (Debian's openmpi-bin)"
    found = subprocess.run([sys.executable, "-c", "import mpi4py"], capture_output=True)
    if found.returncode != 0:
        return None, "mpi4py does not import (pip install mpi4py)"
    return mpirun, None


def run(args, log):
    """The crossprocess mode; returns the JSON-ready result dict.

    Args:
      args: argparse.Namespace (workers, sizes, steps, warmup).
      log: callable(str), progress lines.

    Returns:
      dict with keys mode, config (workers, sizes, rounds, launcher),
      median_ms and times_ms (contender -> size -> ms), left_out (contender
      -> why) and environment.

    Raises:
      RuntimeError: the processes failed (their output is in the message).
    """
    sizes = list(args.sizes or DEFAULT_SIZES)
    mpirun, why = _mpirun()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.json")
        worker = [sys.executable, "-m", "tfreduce.bench.crossprocess_worker", "--sizes",
                  ",".join(map(str, sizes)), "--rounds", str(args.steps), "--warmup",
                  str(args.warmup), "--json", path]
        if mpirun is not None:
            # Shared memory between the processes (Open MPI's default on one host).
            command = [mpirun, "-np", str(args.workers), "--oversubscribe", "--bind-to",
                       "none"]
            env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
                       OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        else:
            command = [sys.executable, "-m", "tfreduce.launch", "--workers", str(args.workers),
                       "--timeout", str(TIMEOUT_S), "--preload", "tensorflow", "--"]
            env = None
        log(f"{args.workers} processes on 127.0.0.1 ({'mpirun' if mpirun else 'tfreduce.launch'}"
            f"), sizes {', '.join(format_bytes(s) for s in sizes)}, {args.steps} rounds")
        measured = processes_result(subprocess.run, command + worker, path, "the processes",
                                    env=env, timeout=TIMEOUT_S)
    left_out = measured["left_out"]
    if why is not None:
        left_out["MPI (mpi4py)"] = why
    return {"mode": "crossprocess",
            "config": {"workers": measured["workers"], "sizes": sizes, "rounds": args.steps,
                       "launcher": "mpirun" if mpirun else "tfreduce.launch"},
            "median_ms": measured["median_ms"], "times_ms": measured["times_ms"],
            "left_out": left_out, "environment": environment()}


def _ratio(result, over, under, size):
    medians = result["median_ms"]
    if over not in medians or under not in medians:
        return "-"
    return f"{medians[over][str(size)] / medians[under][str(size)]:.2f}"


def print_result(result, out=None):
    """Prints the medians per contender and size, the ratios, and what was left out."""
    cfg = result["config"]
    sizes = cfg["sizes"]
    title = (f"float32 all-reduce across {cfg['workers']} processes on 127.0.0.1 "
             f"({cfg['launcher']}); median ms per call of {cfg['rounds']} interleaved rounds")
    header = f"{'contender':25s}" + "".join(f"{format_bytes(s):>12s}" for s in sizes)
    lines = [f"{name:25s}" + "".join(f"{by[str(s)]:12.3f}" for s in sizes)
             for name, by in result["median_ms"].items()]
    for label, over, under in (
            ("eager / traced", "tfreduce eager", "tfreduce traced"),
            ("eager / traced, gRPC", "tfreduce eager, gRPC", "tfreduce traced, gRPC"),
            ("traced gRPC / MPI", "tfreduce traced, gRPC", "tfreduce traced"),
            ("traced / TF's op", "tfreduce traced", "TF CollectiveReduceV2"),
            ("TF's op / MPI", "TF CollectiveReduceV2", "MPI (mpi4py)"),
            ("MPI / eager (bandwidth)", "MPI (mpi4py)", "tfreduce eager"),
            ("64 fused / MPI", "tfreduce 64 fused", "MPI (mpi4py)")):
        lines.append(f"{label:25s}" + "".join(f"{_ratio(result, over, under, s):>12s}"
                                              for s in sizes))
    print_table(title, header, lines, out)
    for name, why in result["left_out"].items():
        print(f"{name}: left out, {why}", file=out)
