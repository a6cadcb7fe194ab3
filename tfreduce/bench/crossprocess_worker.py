"""One process of ``tfreduce-bench --mode crossprocess``: one float32 all-reduce, six ways.

Run by ``tfreduce.bench.crossprocess_mode`` under ``tfreduce.launch
--workers W``, or under ``mpirun -np W`` (``hvd.init()`` then forms the TF
cluster of mpirun's processes). For each size, in rounds that interleave
the contenders:

- "tfreduce traced": ``hvd.allreduce(x, op=hvd.Sum)`` in a ``tf.function``;
- "tfreduce eager": the same call eagerly (metrics and custom loops), which
  first checks that every process makes it. Under mpirun both go over MPI
  (the cluster's transport, ``tfreduce.workers.mpi_transport``), and
  "tfreduce traced, gRPC" and "tfreduce eager, gRPC" are the same calls
  with the transport set aside (TF's runtime, as under the launcher);
- "tfreduce 64 fused": one eager ``grouped_allreduce`` of 64 tensors of a
  64th of the bytes each (Horovod's tensor fusion: one buffer over MPI);
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
    """name -> (prepare: NumPy array -> input, call: input -> result, result -> NumPy array).

    Inputs are made once per size, outside the timed calls, and results
    stay as the contender returns them (a tensor, a list, an array)."""
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
    mpi = found.mpi

    def over_grpc(x):  # the call with its agreement and data over TF's runtime
        found.mpi = None
        try:
            return hvd.allreduce(x, op=hvd.Sum)
        finally:
            found.mpi = mpi

    traced_grpc = tf.function(over_grpc, autograph=False)  # traced without the transport

    def pieces(x):  # 64 tensors of one 64th of the bytes each
        return [tf.constant(p) for p in np.array_split(x, FUSED)]

    tensor, joined = tf.constant, (lambda out: np.concatenate([o.numpy() for o in out]))
    out = {"tfreduce traced": (tensor, traced, _numpy),
           "tfreduce eager": (tensor, lambda x: hvd.allreduce(x, op=hvd.Sum), _numpy)}
    if mpi is not None:
        out["tfreduce traced, gRPC"] = (tensor, traced_grpc, _numpy)
        out["tfreduce eager, gRPC"] = (tensor, over_grpc, _numpy)
    out[f"tfreduce {FUSED} fused"] = (pieces, lambda x: hvd.grouped_allreduce(x, op=hvd.Sum),
                                      joined)
    out["TF CollectiveReduceV2"] = (tensor, lambda x: raw[int(x.shape[0]) * 4](x), _numpy)
    if comm is not None:
        from mpi4py import MPI

        def allreduce(x):
            result = np.empty_like(x)
            comm.Allreduce(x, result, op=MPI.SUM)
            return result

        out["MPI (mpi4py)"] = (lambda x: x, allreduce, lambda r: r)
    return out


#: The calls of the fused contender: one grouped_allreduce of this many tensors.
FUSED = 64


def _numpy(result):
    return result.numpy()


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
    arrays = {s: np.full(s // 4, hvd.rank() + 1, np.float32) for s in sizes}
    inputs = {}
    for name, (prepare, function, as_array) in contenders.items():
        for size in sizes:
            inputs[name, size] = prepare(arrays[size])
            got = as_array(function(inputs[name, size]))
            if not np.array_equal(got, np.full_like(got, want)):
                raise SystemExit(f"{name} at {size} bytes: {got[:4]} ..., not {want}")
            for _ in range(args.warmup):
                function(inputs[name, size])
    times = {name: {size: [] for size in sizes} for name in contenders}
    for _ in range(args.rounds):
        for size in sizes:
            # Small calls are many per round, so each round's time is a mean of several.
            calls = max(1, min(20, (1 << 20) // size))
            for name, (_, function, _) in contenders.items():
                times[name][size].append(1000 * _time(function, inputs[name, size], calls))
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
