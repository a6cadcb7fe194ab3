"""A process that ``mpirun -np 2`` started, whose eager Horovod calls go over the MPI transport.

Run by tests/test_mpirun.py. ``--case collectives``: every eager
collective on inputs made from the rank (each dtype; a grouped all-reduce
fused and unfused), then two mismatched calls and one more good call, then
the prepared path against the general one;
``--case frozen``: rank 1 stops itself (SIGSTOP) after one call, rank 0
calls again, records what its call raised and exits normally (its
aborted transport then ends the job). Every process that runs to the end
writes ``--out``/rank-R.json.
"""

import argparse
import json
import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfreduce.tensorflow as hvd  # noqa: E402
from tfreduce.tensorflow.mpi_calls import FUSION_ENV, signature  # noqa: E402
from tfreduce.tensorflow.process import eager_functions  # noqa: E402

DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8", "bool")


def value(rank, dtype):
    """Rank r's input of `dtype`: [[0, 1, 2], [3, 4, 5]] + 3 r (bool: its parity)."""
    x = np.arange(6).reshape(2, 3) + 3 * rank
    return tf.constant(x % 2 == 0) if dtype == "bool" else tf.cast(x, dtype)


def listed(t):
    return tf.cast(t, tf.float64).numpy().tolist() if t.dtype != tf.bool else t.numpy().tolist()


def collectives(rank):
    out = {"mpi_enabled": hvd.mpi_enabled(), "allreduce": {}, "average": {}, "min": {},
           "max": {}}
    for dtype in DTYPES:
        x = value(rank, dtype)
        out["allreduce"][dtype] = [listed(hvd.allreduce(x, op=hvd.Sum)), x.dtype.name]
        if dtype != "bool":
            out["average"][dtype] = listed(hvd.allreduce(x, op=hvd.Average))
            out["min"][dtype] = listed(hvd.allreduce(x, op=hvd.Min))
            out["max"][dtype] = listed(hvd.allreduce(x, op=hvd.Max))
    group = [value(rank, d) for d in ("float32", "int32", "float32", "float64", "float32")]
    fused = hvd.grouped_allreduce(group, op=hvd.Average)
    os.environ[FUSION_ENV] = "0"
    unfused = hvd.grouped_allreduce(group, op=hvd.Average)
    del os.environ[FUSION_ENV]
    out["fused"] = [[listed(t), t.dtype.name] for t in fused]
    out["unfused"] = [[listed(t), t.dtype.name] for t in unfused]
    out["allgather"] = listed(hvd.allgather(tf.fill([rank + 1, 2], float(rank))))
    out["broadcast"] = listed(hvd.broadcast(value(rank, "int64"), root_rank=1))
    variable = tf.Variable(tf.cast(value(rank, "float32"), tf.float32))
    hvd.broadcast_variables([variable], root_rank=1)
    out["broadcast_variables"] = listed(variable)
    out["reducescatter"] = listed(hvd.reducescatter(tf.reshape(value(rank, "float32"), [3, 2]),
                                                    op=hvd.Sum))
    sent = tf.reshape(tf.range(4) + 10 * rank, [4, 1])
    got, splits = hvd.alltoall(sent, splits=[1, 3])
    out["alltoall"] = [listed(got), splits.numpy().tolist()]
    try:  # rank 0 all-reduces, rank 1 all-gathers: both raise, nothing moves
        if rank == 0:
            hvd.allreduce(tf.ones([3]), name="loss")
        else:
            hvd.allgather(tf.ones([3]), name="loss")
        out["mismatch"] = None
    except tf.errors.FailedPreconditionError as error:
        out["mismatch"] = [type(error).__name__, str(error)]
    out["after"] = listed(hvd.allreduce(tf.constant([1.0, 2.0]), op=hvd.Sum))
    out["prepared"] = prepared(rank)
    return out


def _last_call():
    """The description this process's last eager call agreed on (calls.agree keeps it)."""
    return eager_functions()["last_call"]


def prepared(rank):
    """A call on the prepared path (tfreduce.tensorflow.prepared_calls) against the general
    path, which a watching tape takes; each rank on another path; a mismatch of kept calls."""
    group = [value(rank, d) / 7 for d in ("float32", "float64", "float16", "float32")]
    fast, descriptions = [], []
    for _ in range(2):  # prepared, then taken from what was kept
        fast.append([listed(t) for t in hvd.grouped_allreduce(group, op=hvd.Average)])
        descriptions.append(_last_call())
    with tf.GradientTape() as tape:
        tape.watch(group[0])
        general = [listed(t) for t in hvd.grouped_allreduce(group, op=hvd.Average)]
    descriptions.append(_last_call())
    x = value(rank, "int64")
    if rank == 0:  # the general path here, the prepared one on rank 1: the calls agree
        with tf.GradientTape() as tape:
            tape.watch(x)
            mixed = hvd.allreduce(x, op=hvd.Sum, prescale_factor=1, name="steps")
    else:
        mixed = hvd.allreduce(x, op=hvd.Sum, prescale_factor=1, name="steps")
    # Each kept call by its name (key[6]) and its inputs' signature (key[-1]).
    kept = [(key[6], key[-1]) for key, entry in eager_functions()["prepared_allreduces"].items()
            if entry]
    out = {"fast": fast, "general": general, "descriptions": descriptions,
           "mixed": [listed(mixed), _last_call()],
           "taken": [(None, signature(group)) in kept, ("steps", signature([x])) in kept]}
    hvd.allreduce(tf.ones([3]), name="grad")
    try:  # kept on both ranks, then one of another shape
        hvd.allreduce(tf.ones([3 + rank]), name="grad")
        out["mismatch"] = None
    except tf.errors.FailedPreconditionError as error:
        out["mismatch"] = [type(error).__name__, str(error)]
    return out


def frozen(rank):
    hvd.allreduce(tf.ones([4]))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    try:
        hvd.allreduce(tf.ones([4]))
        return {"raised": None}
    except Exception as error:  # noqa: BLE001 - what it raised is the result
        return {"raised": [type(error).__name__, str(error)],
                "seconds": time.monotonic() - start}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=("collectives", "frozen"), required=True)
    parser.add_argument("--out", required=True, help="a folder")
    args = parser.parse_args()
    hvd.init(stall_seconds=3 if args.case == "frozen" else None)
    out = collectives(hvd.rank()) if args.case == "collectives" else frozen(hvd.rank())
    with open(os.path.join(args.out, f"rank-{hvd.rank()}.json"), "w") as f:
        json.dump(out, f)
    # The frozen case's survivor exits as any script does: its aborted transport ends the job.


if __name__ == "__main__":
    main()
