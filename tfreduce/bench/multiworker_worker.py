"""One worker of ``tfreduce-bench --mode multiworker``, started by the launcher.

Under TF_CONFIG, each of the W workers makes K logical devices, joins the
cluster, and holds one tower's gradients (a Keras model's shapes, values
seeded by worker and tower) on each device. Every worker then builds the
same contenders in the same order, as tf.functions (so the collectives'
keys agree), and runs them in the same rotating order; rank 0 times each
call and writes the result as JSON:

- ``per-tensor collective``: one ``CollectiveReduceV2`` per tensor over all
  W x K devices, chained per device, then 1/T: what
  MultiWorkerMirroredStrategy does with its default (no packing);
- ``tfreduce``: ``allreduce_grads_multiworker`` (local flat sum, cross-worker
  collective of packed local sums, local broadcast);
- ``tfreduce+fp16``: the same, the local sums crossing workers in float16;
- ``tfreduce+powersgdR``: PowerSGD of rank R around ``tfreduce``.

Each contender's result on rank 0's tower 0 is compared with NumPy.
"""

import argparse
import json
import sys
import time

import numpy as np

from tfreduce.basis.startup import import_tensorflow

# Bytes a worker puts into its cross-worker collectives are read from the
# graph: the inputs of its CollectiveReduceV2 ops.
_CROSS_OPS = ("CollectiveReduceV2",)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--num-tensors", type=int, default=100, help="N of --model synthetic")
    parser.add_argument("--total-bytes", type=int, default=None)
    parser.add_argument("--reduce", choices=("mean", "sum"), default="mean")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--json", required=True)
    parser.add_argument("--verbose", action="store_true")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    tf = import_tensorflow(args.verbose)
    from tfreduce.basis.devices import logical_devices
    from tfreduce.bench.workloads import gradient_shapes
    from tfreduce.workers.cluster import Cluster

    cluster = Cluster.from_tf_config()
    local = logical_devices(args.devices)
    cluster.start()
    devices = cluster.devices(local)
    shapes = gradient_shapes(args.model, args.num_tensors, args.total_bytes)
    grads = _inputs(tf, shapes, devices, cluster.rank)
    average = args.reduce == "mean"
    contenders = _contenders(tf, cluster, local, devices, grads, average, args.powersgd_rank)
    expected = _expected(shapes, cluster.num_workers, len(devices), average)
    rows = {}
    with cluster.detect_lost_workers():
        for name, function in contenders.items():
            start = time.perf_counter()
            out = function()
            rows[name] = {"first_call_s": time.perf_counter() - start,
                          "cross_worker_bytes": _cross_bytes(function),
                          "relative_error": _relative_error(out, expected)}
        times = _time_rounds(contenders, args.steps, args.warmup)
    for name, samples in times.items():
        rows[name].update(median_ms=1e3 * float(np.median(samples)),
                          times_ms=[1e3 * t for t in samples])
    if cluster.is_chief:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "num_tensors": len(shapes),
                       "bytes_per_tower": 4 * sum(int(np.prod(s)) for s in shapes),
                       "workers": cluster.num_workers, "devices_per_worker": len(devices)}, f)
    cluster.finish()
    return 0


def _inputs(tf, shapes, devices, rank):
    # K x N float32 gradients, multiples of 1/4, seeded by (rank, tower, tensor).
    grads = []
    for k, device in enumerate(devices):
        with tf.device(device):
            grads.append([tf.Variable(_values(s, rank, k, n), trainable=False)
                          for n, s in enumerate(shapes)])
    return grads


def _values(shape, rank, tower, n):
    rng = np.random.default_rng([rank, tower, n])
    return (rng.integers(-32, 33, shape) / 4).astype(np.float32)


def _expected(shapes, workers, towers, average):
    # Tower 0's result: the sum (or mean) over every tower of every worker.
    out = []
    for n, s in enumerate(shapes):
        total = sum(_values(s, r, k, n).astype(np.float64)
                    for r in range(workers) for k in range(towers))
        out.append(total / (workers * towers) if average else total)
    return out


def _contenders(tf, cluster, local, devices, grads, average, rank):
    import tfreduce
    from tfreduce.algorithms.powersgd import PowerSGD, PowerSGDState, powersgd_allreduce
    from tfreduce.blocks.collective import CollectiveChain, CollectiveOptions

    total = cluster.num_workers * len(devices)

    def read():
        return [[v.read_value() for v in row] for row in grads]

    def per_tensor():
        # One collective per tensor over all W x K devices, as
        # MultiWorkerMirroredStrategy's CollectiveAllReduce does unpacked.
        chain = CollectiveChain(CollectiveOptions("auto", cluster.op_timeout))
        group_key = cluster.group_key(local)
        values, out = read(), [[] for _ in devices]
        for n in range(len(values[0])):
            instance_key = cluster.keys.instance_key()
            for k, device in enumerate(devices):
                chain.token(device, f"bench_per_tensor_{group_key}", "per_tensor_order")
                with chain.after_previous(device):
                    summed = chain.all_reduce(values[k][n], device, total, group_key,
                                              instance_key, name=f"tensor{n}_dev{k}")
                    out[k].append(summed / total if average else summed)
        return out

    def multiworker(compression=None):
        def allreduce(all_grads, mean):
            return tfreduce.allreduce_grads_multiworker(all_grads, devices, average=mean,
                                                        cluster=cluster, compression=compression)
        return allreduce

    powersgd = PowerSGD(rank=rank)
    state = PowerSGDState(powersgd, devices, [v for v in grads[0]])
    fp16 = tfreduce.Compression.fp16
    builders = {
        "per-tensor collective": per_tensor,
        "tfreduce": lambda: multiworker()(read(), average),
        f"tfreduce+{fp16.name}": lambda: multiworker(fp16)(read(), average),
        f"tfreduce+{powersgd.name}": lambda: powersgd_allreduce(
            read(), state, multiworker(), average, total),
    }
    # Tower 0's outputs: an eager call returns once the whole reduction ran.
    return {name: tf.function(lambda build=build: build()[0], autograph=False)
            for name, build in builders.items()}


def _cross_bytes(function):
    graph = function.get_concrete_function().graph
    return sum(op.inputs[0].shape.num_elements() * op.inputs[0].dtype.size
               for op in graph.get_operations() if op.type in _CROSS_OPS)


def _relative_error(out, expected):
    # Largest difference from NumPy on tower 0, relative to the largest value.
    worst = max(float(np.max(np.abs(t.numpy() - e))) for t, e in zip(out, expected))
    return worst / max(max(float(np.max(np.abs(e))) for e in expected), 1e-30)


def _time_rounds(contenders, steps, warmup):
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    times = {name: [] for name in names}
    for step in range(steps):
        # Every worker rotates the same way: their calls must pair up.
        for name in names[step % len(names):] + names[:step % len(names)]:
            start = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - start)
    return times


if __name__ == "__main__":
    sys.exit(main())
