"""Two processes; one makes a collective call that fails its own checks: the calls after it pair as before.

Under the launcher (tests/test_hostile.py), for each case of CASES (a call
that raises on the process making it, before any data moves), in two
forms:

- alone: rank 1 makes the bad call, rank 0 does not; then both all-reduce
  r + 1 and 10 (r + 1) with Sum: 3 and 30 on both;
- both: both make the call, only rank 1's is bad; rank 0 raises a
  CallMismatchError naming rank 1's error, rank 1 its own error; then the
  same two all-reduces.

With ``--join``, rank 1 calls ``join()`` after the alone form's bad call
and rank 0 all-reduces 1.0 alone (rank 1 adds zeros). Prints one JSON line
per case: what each call raised (type and message) or returned.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfreduce.tensorflow as hvd  # noqa: E402


def cases(bad):
    """name -> function(bad: bool) making the call, invalid where `bad`."""
    ones = tf.ones([4, 2])
    return {
        "alltoall splits that do not add up": lambda: hvd.alltoall(
            ones, splits=[1, 1] if bad else [2, 2]),
        "alltoall splits of the wrong length": lambda: hvd.alltoall(
            ones, splits=[1, 1, 2] if bad else [2, 2]),
        "alltoall of a scalar": lambda: hvd.alltoall(tf.constant(1.0) if bad else ones),
        "broadcast from root 5": lambda: hvd.broadcast(tf.ones([2]), root_rank=5 if bad else 0),
        "broadcast_variables from root -1": lambda: hvd.broadcast_variables(
            [tf.Variable([1.0])], root_rank=-1 if bad else 0),
        "allgather of a scalar": lambda: hvd.allgather(tf.constant(1.0) if bad else ones),
        "reducescatter of a scalar": lambda: hvd.reducescatter(tf.constant(1.0) if bad else ones),
        "allreduce of strings": lambda: hvd.allreduce(tf.constant(["a"]) if bad else ones),
        "allreduce with an unknown op": lambda: hvd.allreduce(ones, op="median" if bad else None),
        "allreduce with a process set": lambda: hvd.allreduce(
            ones, process_set=hvd.ProcessSet() if bad else hvd.global_process_set),
        "grouped_allreduce of a non-tensor": lambda: hvd.grouped_allreduce(
            [ones, object()] if bad else [ones]),
        "broadcast_object from root 7": lambda: hvd.broadcast_object(
            {"a": 1}, root_rank=7 if bad else 0),
    }


def outcome(call):
    try:
        out = call()
    except Exception as e:  # noqa: BLE001 - the outcome is what is asked
        return {"raised": type(e).__name__, "message": str(e).splitlines()[0][:300]}
    if isinstance(out, (tuple, list)):
        out = out[0]
    return {"returned": np.asarray(out).tolist() if out is not None else None}


def sums(rank):
    return [outcome(lambda v=v: hvd.allreduce(tf.constant(v * (rank + 1.0)), op=hvd.Sum))
            for v in (1.0, 10.0)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="one case's name")
    args = parser.parse_args(argv)
    hvd.init()
    rank = hvd.rank()
    names = [args.only] if args.only else list(cases(False))
    for name in names:
        record = {"case": name, "rank": rank}
        if rank == 1:
            record["alone"] = outcome(cases(True)[name])
        record["alone_sums"] = sums(rank)
        record["both"] = outcome(cases(rank == 1)[name])
        record["both_sums"] = sums(rank)
        print(json.dumps(record), flush=True)
    # join() after a one-sided bad call: rank 0's all-reduce has rank 1's zeros.
    if rank == 1:
        outcome(cases(True)["broadcast from root 5"])
        joined = int(hvd.join())
        print(json.dumps({"case": "join", "rank": 1, "joined": joined}), flush=True)
    else:
        got = float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum))
        joined = int(hvd.join())
        print(json.dumps({"case": "join", "rank": 0, "sum": got, "joined": joined}), flush=True)
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
