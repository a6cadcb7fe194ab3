"""One worker of the cross-worker collectives test.

Run under TF_CONFIG (by tests/test_collectives.py): starts the worker's
server with 2 logical CPU devices, runs each collective of CASES with
``cluster=`` in a tf.function, and writes its outputs and their devices to
--out (an .npz file) for the test to check against the one-process result
on 4 towers.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfreduce  # noqa: E402
from tfreduce.workers.cluster import Cluster  # noqa: E402

TOWERS = 2  # per worker
# name -> (collective, local algorithm, dtype, same rows on every tower, root, average);
# all-gather and all-to-all join each worker's rows whatever the algorithm.
CASES = {
    "reduce_scatter_flat_f32_mean": ("reduce_scatter", "flat", "float32", True, 0, True),
    "reduce_scatter_ring_bf16": ("reduce_scatter", "ring", "bfloat16", True, 0, False),
    "all_gather_i64": ("all_gather", "flat", "int64", False, 0, False),
    "all_gather_f16": ("all_gather", "collective", "float16", False, 0, False),
    "broadcast_hierarchical_f64": ("broadcast", "hierarchical", "float64", True, 3, False),
    "reduce_collective_i32": ("reduce", "collective", "int32", True, 1, False),
    "all_to_all_f32": ("all_to_all", "ring", "float32", False, 0, False),
    "all_to_all_i64_splits": ("all_to_all", "flat", "int64", False, 0, False),
}
# Global splits of an all-to-all case: SPLITS[case][t], the rows tower t
# sends to each of the 4 towers.
SPLITS = {"all_to_all_i64_splits": [[0, 2, 1, 0], [3, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 2]]}


def tower_arrays(case, tower):
    """The N arrays of global tower ``tower`` (0..3), the same in every process."""
    _, _, dtype, same, _, _ = CASES[case]
    rng = np.random.default_rng([sorted(CASES).index(case), tower])
    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    out = []
    for i, rest in enumerate([(3,), (2, 2), ()]):
        rows = 7 - i * 3 if same else (tower * 3 + i) % 5
        if case in SPLITS:
            rows = sum(SPLITS[case][tower])
        out.append(np.asarray(rng.integers(-8, 9, (rows,) + rest) / 4).astype(dtype)
                   if np.dtype(dtype).kind != "i" else rng.integers(-8, 9, (rows,) + rest)
                   .astype(dtype))
    return out


def run(case, cluster, devices):
    collective, algorithm, _, _, root, average = CASES[case]
    placed = {}

    @tf.function(autograph=False)
    def step():
        tensors = []
        for k, d in enumerate(devices):
            with tf.device(d):
                tensors.append([tf.constant(a) for a in tower_arrays(case, cluster.rank * TOWERS
                                                                     + k)])
        kwargs = {"algorithm": algorithm, "cluster": cluster}
        if collective in ("reduce_scatter", "reduce"):
            kwargs["average"] = average
        if collective in ("broadcast", "reduce"):
            kwargs["root"] = root
        if case in SPLITS:
            kwargs["splits"] = SPLITS[case][cluster.rank * TOWERS:(cluster.rank + 1) * TOWERS]
        out = getattr(tfreduce, collective)(tensors, devices, **kwargs)
        out = [out] if collective == "reduce" else out
        placed["devices"] = [[t.op.device for t in row] for row in out]
        return out

    with cluster.detect_lost_workers():
        values = step()
    return [[v.numpy() for v in row] for row in values], placed["devices"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--out", required=True,
                        help="npz file to write; '{}' in it is replaced by the rank")
    args = parser.parse_args(argv)
    cluster = Cluster.from_tf_config(timeout=args.timeout)
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * TOWERS)
    cluster.start()
    devices = cluster.devices([f"/cpu:{k}" for k in range(TOWERS)])
    results = {"rank": np.array(cluster.rank)}
    for case in sorted(CASES):
        values, placed = run(case, cluster, devices)
        for r, row in enumerate(values):
            for n, v in enumerate(row):
                results[f"{case}/out/{r}/{n}"] = v.view(np.uint16) if v.dtype == \
                    ml_dtypes.bfloat16 else v
        results[f"{case}/devices"] = np.array(json.dumps(placed))
    cluster.finish()
    out = args.out.format(cluster.rank)
    np.savez(out, **results)
    print(f"rank {cluster.rank}: {len(CASES)} cases written to {out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
