"""A small data-parallel training run, on one worker of a cluster or on one process.

Under TF_CONFIG (tests/test_multiworker.py starts it through the launcher or
directly), each worker trains K towers of a two-layer softmax classifier on
its part of every global batch, with tfreduce.allreduce_grads_multiworker,
after a broadcast from rank 0 (every rank starts from different random
weights, so the broadcast matters). ``reference`` trains the same model on
W*K towers of one process with a hierarchical all-reduce over the same
groups, the result multi-worker training must reproduce.

Faults: ``--die-at S --die-rank R`` makes rank R kill itself (SIGKILL) at step
S (with ``--die-once``, only at the first start: the launcher's restarts set
TFREDUCE_RESTART_COUNT); ``--ckpt DIR`` makes rank 0 write a checkpoint after
every step and ``--resume`` restores the newest one on rank 0, then
broadcasts it, as a restart does when a checkpoint exists.
"""

import argparse
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfreduce.workers.cluster import Cluster  # noqa: E402
from tfreduce.doors.multiworker import (allreduce_grads_multiworker,  # noqa: E402
                                  broadcast_variables_multiworker)

FEATURES, HIDDEN, CLASSES = 8, 16, 3
GLOBAL_BATCH = 10  # not a multiple of 4 towers: shards of 3, 3, 2, 2
LEARNING_RATE = 0.5


def global_batch(step):
    """The global batch of one step: x [10, 8] float32, y [10] int32."""
    rng = np.random.default_rng(1000 + step)
    return (rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32),
            rng.integers(0, CLASSES, GLOBAL_BATCH).astype(np.int32))


def initial_weights(seed):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(FEATURES, HIDDEN)).astype(np.float32) * 0.5,
            np.zeros(HIDDEN, np.float32),
            rng.normal(size=(HIDDEN, CLASSES)).astype(np.float32) * 0.5,
            np.zeros(CLASSES, np.float32)]


def shard_sizes(batch, towers):
    base, extra = divmod(batch, towers)
    return [base + (t < extra) for t in range(towers)]


def tower_grads(weights, x, y, scale):
    """Gradients of scale * sum of the shard's cross-entropy losses."""
    with tf.GradientTape() as tape:
        hidden = tf.nn.relu(tf.matmul(x, weights[0]) + weights[1])
        logits = tf.matmul(hidden, weights[2]) + weights[3]
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        loss = tf.reduce_sum(losses) * scale
    return tape.gradient(loss, weights)


def make_towers(devices, seed):
    towers = []
    for d in devices:
        with tf.device(d):
            towers.append([tf.Variable(w) for w in initial_weights(seed)])
    return towers


def make_train_step(towers, devices, total_towers, reduce):
    """A tf.function that trains every tower on its shard of x, y."""
    scale = total_towers / GLOBAL_BATCH  # average=True divides by total_towers

    @tf.function(autograph=False)
    def train_step(x, y):
        sizes = shard_sizes(int(x.shape[0]), len(devices))
        xs, ys = tf.split(x, sizes), tf.split(y, sizes)
        grads = []
        for k, d in enumerate(devices):
            with tf.device(d):
                grads.append(tower_grads(towers[k], xs[k], ys[k], scale))
        reduced = reduce(grads, devices)
        updates = []
        for k, d in enumerate(devices):
            with tf.device(d):
                for v, g in zip(towers[k], reduced[k]):
                    updates.append(v.assign_sub(LEARNING_RATE * g))
        with tf.control_dependencies(updates):
            return tf.constant(0)

    return train_step


def reference(devices, steps, groups):
    """Trains len(devices) towers in this process; returns tower 0's weights."""
    import tfreduce

    towers = make_towers(devices, seed=0)
    step = make_train_step(
        towers, devices, len(devices),
        lambda g, d: tfreduce.allreduce_grads(g, d, average=True,
                                              algorithm="hierarchical", groups=groups))
    for s in range(steps):
        step(*global_batch(s))
    return [v.numpy() for v in towers[0]]


def train(cluster, num_devices, steps, ckpt, resume, die_at, die_rank, step_seconds):
    devices = cluster.devices([f"/cpu:{k}" for k in range(num_devices)])
    # Every rank starts elsewhere: only the broadcast makes them agree.
    towers = make_towers(devices, seed=cluster.rank)
    with tf.device(devices[0]):
        counter = tf.Variable(np.int64(0))
    manager = None
    if ckpt and cluster.is_chief:
        manager = tf.train.CheckpointManager(
            tf.train.Checkpoint(weights=towers[0], step=counter), ckpt, max_to_keep=2)
        if resume:
            manager.checkpoint.restore(manager.latest_checkpoint).assert_consumed()
            print(f"rank 0: restored {manager.latest_checkpoint} at step "
                  f"{int(counter.numpy())}", flush=True)
    # The step counter travels with tower 0's weights: only rank 0 reads
    # checkpoints, and every rank learns where to continue from it.
    counters = [[counter]] + [[tf.Variable(np.int64(0))] for _ in devices[1:]]
    with cluster.detect_lost_workers():
        broadcast_variables_multiworker(
            [towers[k] + counters[k] for k in range(num_devices)], cluster)
    start, stop = cluster.batch_slice(GLOBAL_BATCH, num_devices)
    step_fn = make_train_step(
        towers, devices, cluster.num_workers * num_devices,
        lambda g, d: allreduce_grads_multiworker(g, d, average=True, cluster=cluster,
                                                 local_algorithm="flat"))
    first = int(counter.numpy())
    for s in range(first, steps):
        if s == die_at and cluster.rank == die_rank:
            print(f"rank {cluster.rank}: killing myself at step {s}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = global_batch(s)
        with cluster.detect_lost_workers():
            step_fn(x[start:stop], y[start:stop])
        counter.assign(s + 1)
        if manager is not None:
            manager.save(checkpoint_number=s + 1)
        print(f"rank {cluster.rank}: step {s + 1} done", flush=True)
        time.sleep(step_seconds)
    cluster.finish()
    return towers


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--out", default=None,
                        help="directory where rank r writes rank<r>.npz, its towers' weights")
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--die-rank", type=int, default=1)
    parser.add_argument("--die-once", action="store_true")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--pid-dir", default=None, help="write <pid-dir>/<pid> at start")
    args = parser.parse_args(argv)
    if args.pid_dir:
        open(os.path.join(args.pid_dir, str(os.getpid())), "w").close()
    cluster = Cluster.from_tf_config(timeout=args.timeout)
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * args.devices)
    cluster.start()
    restart = int(os.environ.get("TFREDUCE_RESTART_COUNT", "0"))
    resume = args.resume or (restart > 0 and args.ckpt is not None
                             and tf.train.latest_checkpoint(args.ckpt) is not None)
    die_at = -1 if args.die_once and restart > 0 else args.die_at
    towers = train(cluster, args.devices, args.steps, args.ckpt, resume,
                   die_at, args.die_rank, args.step_seconds)
    if args.out:
        np.savez(os.path.join(args.out, f"rank{cluster.rank}.npz"), **{f"{k}/{n}": v.numpy() for k, tower in enumerate(towers)
                              for n, v in enumerate(tower)})
    print(f"rank {cluster.rank}: finished", flush=True)


if __name__ == "__main__":
    sys.exit(main())
