"""One process of ``tfreduce-bench --mode crossprocess``: one float32 all-reduce, four ways.

Run by ``tfreduce.bench.crossprocess_mode`` under ``tfreduce.launch
--workers W``, or under ``mpirun -np W`` (``hvd.init()`` then forms the TF
cluster of mpirun's processes). For each size, in rounds that interleave
the contenders:

- "tfreduce traced": ``hvd.allreduce(x, op=hvd.Sum)`` in a ``tf.function``;
- "tfreduce eager": the same call eagerly (metrics and custom loops), which
  first checks that every process makes it;
- "TF CollectiveReduceV2": TF's own op in a ``tf.function``, in the same
  processes and over the same gRPC runtime: the floor of that transport;
- "MPI (mpi4py)": ``Comm.Allreduce`` of a NumPy buffer (under mpirun only).

Every process's buffer holds rank + 1; each contender's result is checked
against W (W + 1) / 2 once. Rank 0 writes the median milliseconds per call
of each contender and size, the rounds' times, and why a contender was left
out, as JSON.
"""

import argparse
import json
import statistics
import sys
import time

import numpy as np

from tfreduce.basis.tf_config import mpirun_size

#: The instance keys of the raw op's calls, one per size: below the ranges
#: the cluster (from 2**30) and the eager calls (from 3 * 2**29) draw from.
_RAW_KEYS = 2 ** 28


def _mpi_world():
    """mpi4py's COMM_WORLD when mpirun started this process with W > 1, else (None, why)."""
    if (mpirun_size() or 1) < 2:
        return None, "not started by mpirun"
    try:
        from mpi4py import MPI
    except ImportError as error:
        return None, f"mpi4py does not import ({error})"
    return MPI.COMM_WORLD, None


def _contenders(hvd, tf, comm, sizes):
    """name -> (function of a float32 NumPy array -> NumPy result)."""
    import tfreduce.tensorflow.process as process

    found = process.cluster()
    place = process.device()
    traced = tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum), autograph=False)
    group_key = found.group_key(["/device:CPU:0"])
    raw = {}
    for i, size in enumerate(sizes):
        def reduce(x, key=_RAW_KEYS + i):
            with tf.device(place):
                return tf.raw_ops.CollectiveReduceV2(
                    input=x, group_size=found.num_workers, group_key=group_key,
                    instance_key=key, ordering_token=[], merge_op="Add", final_op="Id",
                    communication_hint="ring")
        raw[size] = tf.function(reduce, autograph=False)
    out = {
        "tfreduce traced": lambda x: traced(tf.constant(x)).numpy(),
        "tfreduce eager": lambda x: hvd.allreduce(tf.constant(x), op=hvd.Sum).numpy(),
        "TF CollectiveReduceV2": lambda x: raw[x.nbytes](tf.constant(x)).numpy(),
    }
    if comm is not None:
        from mpi4py import MPI

        def mpi(x):
            result = np.empty_like(x)
            comm.Allreduce(x, result, op=MPI.SUM)
            return result

        out["MPI (mpi4py)"] = mpi
    return out


def _time(function, x, calls):
    start = time.perf_counter()
    for _ in range(calls):
        function(x)
    return (time.perf_counter() - start) / calls


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", required=True, help="bytes, comma-separated")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    comm, why = _mpi_world()
    import tensorflow as tf

    import tfreduce.tensorflow as hvd

    hvd.init()
    contenders = _contenders(hvd, tf, comm, sizes)
    want = hvd.size() * (hvd.size() + 1) / 2
    inputs = {s: np.full(s // 4, hvd.rank() + 1, np.float32) for s in sizes}
    for name, function in contenders.items():
        for size in sizes:
            got = function(inputs[size])
            if not np.array_equal(got, np.full_like(got, want)):
                raise SystemExit(f"{name} at {size} bytes: {got[:4]} ..., not {want}")
            for _ in range(args.warmup):
                function(inputs[size])
    times = {name: {size: [] for size in sizes} for name in contenders}
    for _ in range(args.rounds):
        for size in sizes:
            # Small calls are many per round, so each round's time is a mean of several.
            calls = max(1, min(20, (1 << 20) // size))
            for name, function in contenders.items():
                times[name][size].append(1000 * _time(function, inputs[size], calls))
    if hvd.rank() == 0:
        left_out = {} if comm is not None else {"MPI (mpi4py)": why}
        with open(args.json, "w") as f:
            json.dump({"workers": hvd.size(), "sizes": sizes, "left_out": left_out,
                       "median_ms": {n: {str(s): statistics.median(t) for s, t in by.items()}
                                     for n, by in times.items()},
                       "times_ms": {n: {str(s): t for s, t in by.items()}
                                    for n, by in times.items()}}, f)
    print(f"rank {hvd.rank()} done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
