"""One worker of the multi-worker reduction tests.

Run under TF_CONFIG (by tests/test_multiworker.py): starts the worker's server
(TF2 eager context, or a tf.compat.v1 server and Session with --mode
session), runs every case of CASES with tfreduce.allreduce_grads_multiworker
and a broadcast of variables from rank 0, and writes this worker's inputs,
outputs and output devices to --out (an .npz file) for the test to check
against NumPy.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfreduce.workers.cluster import Cluster  # noqa: E402
from tfreduce.doors.multiworker import (allreduce_grads_multiworker,  # noqa: E402
                                  broadcast_variables_multiworker)

# name -> (dtype, shapes (None: no gradient), average, options). Values are
# multiples of 1/4 in -2..2, so every sum and mean over 4 towers is exact.
CASES = {
    "flat_f32_sum": ("float32", [(3, 4), None, (5,), ()], False,
                     {"local_algorithm": "flat", "pack_bytes": None}),
    "hier_f16_mean_packed": ("float16", [(2, 3), (7,), (1, 1, 2)], True,
                             {"local_algorithm": "hierarchical", "pack_bytes": 64}),
    "collective_f32_mean": ("float32", [(4, 2), (3,)], True,
                            {"local_algorithm": "collective", "pack_bytes": None}),
    "auto_i32_sum": ("int32", [(6,), (2, 2)], False, {}),
    "sparse_f32_mean": ("float32", ["slices", (3,)], True, {"local_algorithm": "flat"}),
    # 16 bits across workers: local sums prescaled by 1/4 are multiples of
    # 1/16 up to 1, and bfloat16 holds sums up to 8 in quarters, exactly.
    "flat_f32_mean_fp16": ("float32", [(3, 4), (5,)], True,
                           {"local_algorithm": "flat", "compression": "fp16"}),
    "hier_f64_sum_bf16": ("float64", [(2, 3)], False,
                          {"local_algorithm": "hierarchical", "compression": "bf16"}),
}


def tower_inputs(case, rank, tower):
    """The gradients of one tower as numpy arrays (None, array or (values, indices))."""
    dtype, shapes, _, _ = CASES[case]
    rng = np.random.default_rng([sorted(CASES).index(case), rank, tower])
    out = []
    for shape in shapes:
        if shape is None:
            out.append(None)
        elif shape == "slices":
            out.append((rng.integers(-8, 9, (2, 3)).astype(dtype) / 4, np.array([tower, 4])))
        else:
            out.append((rng.integers(-8, 9, shape) / 4).astype(dtype))
    return out


def to_tensor(a, dense_shape=(5, 3)):
    if a is None:
        return None
    if isinstance(a, tuple):
        return tf.IndexedSlices(tf.constant(a[0]), tf.constant(a[1], tf.int64),
                                tf.constant(dense_shape, tf.int64))
    return tf.constant(a)


def build_case(case, cluster, devices):
    """Builds the reduction of one case; returns (outputs K x N, inputs K x N)."""
    _, _, average, options = CASES[case]
    arrays = [tower_inputs(case, cluster.rank, k) for k in range(len(devices))]
    grads = []
    for k, d in enumerate(devices):
        with tf.device(d):
            grads.append([to_tensor(a) for a in arrays[k]])
    out = allreduce_grads_multiworker(grads, devices, average=average, cluster=cluster,
                                      **options)
    return out, arrays


def make_vars(cluster, devices):
    """K x 2 variables, different on every tower of every worker."""
    all_vars = []
    for k, d in enumerate(devices):
        with tf.device(d):
            seed = 10 * cluster.rank + k + 1
            all_vars.append([tf.Variable(np.full((2, 3), seed, np.float32)),
                             tf.Variable(np.int64(seed))])
    return all_vars


def to_numpy(v):
    """(dense array, was it IndexedSlices) of a result, eager or from a session."""
    if hasattr(v, "indices"):
        values = np.asarray(v.values)
        dense = np.zeros(np.asarray(v.dense_shape), values.dtype)
        np.add.at(dense, np.asarray(v.indices), values)
        return dense, True
    return np.asarray(v), False


def record(results, case, arrays, values, devices):
    for k, row in enumerate(arrays):
        for n, a in enumerate(row):
            if isinstance(a, tuple):
                results[f"{case}/in/{k}/{n}/values"], results[f"{case}/in/{k}/{n}/indices"] = a
            elif a is not None:
                results[f"{case}/in/{k}/{n}"] = a
    for k, row in enumerate(values):
        for n, v in enumerate(row):
            if v is not None:
                results[f"{case}/out/{k}/{n}"], sparse = to_numpy(v)
                results[f"{case}/sparse/{k}/{n}"] = np.array(sparse)
    results[f"{case}/devices"] = np.array(json.dumps(devices))


def run_function(cluster, num_devices, results):
    devices = cluster.devices([f"/cpu:{k}" for k in range(num_devices)])
    for case in sorted(CASES):
        placed = {}

        @tf.function(autograph=False)
        def step():
            out, arrays = build_case(case, cluster, devices)
            placed["arrays"] = arrays
            placed["devices"] = [[None if t is None else t.op.device for t in row]
                                 for row in out]
            return out

        with cluster.detect_lost_workers():
            values = step()

        record(results, case, placed["arrays"], values, placed["devices"])
    all_vars = make_vars(cluster, devices)
    with cluster.detect_lost_workers():
        broadcast_variables_multiworker(all_vars, cluster)
    for k, row in enumerate(all_vars):
        for n, v in enumerate(row):
            results[f"broadcast/{k}/{n}"] = v.numpy()
    cluster.finish()


def run_session(cluster, num_devices, results):
    config = tf.compat.v1.ConfigProto(device_count={"CPU": num_devices})
    server = cluster.start_server(config)
    devices = cluster.devices([f"/cpu:{k}" for k in range(num_devices)])
    graph = tf.Graph()
    with graph.as_default():
        built = {case: build_case(case, cluster, devices) for case in sorted(CASES)}
        all_vars = make_vars(cluster, devices)
        init = tf.compat.v1.global_variables_initializer()
        bcast = broadcast_variables_multiworker(all_vars, cluster)
        with tf.compat.v1.Session(server.target, config=cluster.session_config(config)) as sess:
            sess.run(init)
            for case, (out, arrays) in built.items():
                fetch = [[t for t in row if t is not None] for row in out]
                with cluster.detect_lost_workers():
                    got = sess.run(fetch)
                values = []
                for row, got_row in zip(out, got):
                    it = iter(got_row)
                    values.append([None if t is None else next(it) for t in row])
                record(results, case, arrays, values,
                       [[None if t is None else t.op.device for t in row] for row in out])
            with cluster.detect_lost_workers():
                sess.run(bcast)
            for k, row in enumerate(sess.run(all_vars)):
                for n, v in enumerate(row):
                    results[f"broadcast/{k}/{n}"] = v
            cluster.finish(sess)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("function", "session"), default="function")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--out", required=True,
                        help="npz file to write; '{}' in it is replaced by the rank")
    args = parser.parse_args(argv)
    cluster = Cluster.from_tf_config(timeout=args.timeout)
    results = {"rank": np.array(cluster.rank)}
    if args.mode == "function":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * args.devices)
        cluster.start()
        run_function(cluster, args.devices, results)
    else:
        run_session(cluster, args.devices, results)
    out = args.out.format(cluster.rank)
    np.savez(out, **results)
    print(f"rank {cluster.rank}: {len(CASES)} cases written to {out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
