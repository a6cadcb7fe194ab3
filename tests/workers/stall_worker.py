"""Two workers train; one freezes itself (SIGSTOP) mid-run: the other must name it and end.

Under the launcher (tests/test_watchdog.py), each worker trains a small
Dense model on random data for up to 10,000 steps through one door:

- ``tape``: Horovod's custom loop, ``DistributedGradientTape`` in a
  ``tf.function`` with the first-step broadcast;
- ``fit``: Keras ``fit`` with ``DistributedOptimizer`` and
  ``BroadcastGlobalVariablesCallback``;
- ``trainer``: ``ReplicatedTrainer`` with ``cluster="auto"``, 2 towers each.

Rank ``--freeze-rank`` stops itself with SIGSTOP before step ``--freeze-at``
(printing "rank R: freezing at step S" first), or with ``--fail`` raises
an uncaught RuntimeError there, or with ``--pause S`` sleeps S seconds
there (alive, outside its steps); ``--freeze-at -1`` never freezes (a clean
run). ``--lag-ms M`` makes rank 1 of the tape loop (or of fit) sleep
M ms before each step (a straggler), from step ``--lag-from`` on (tape); fit with ``--logdir`` runs 150
batches with WorkerTimesCallback writing to LOGDIR/rank<r>; ``--slow-trace S`` makes its first step's
trace take S seconds more (a big model's first step, not a hang). The survivor's watchdog is expected to abort its
collectives; the error then ends it with a non-zero code.
"""

import argparse
import os
import signal
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

STEPS = 10_000


def freeze(rank, step, args):
    if rank == args.freeze_rank and step == args.freeze_at:
        if args.fail:
            raise RuntimeError(f"rank {rank}: failing at step {step} on purpose")
        if args.pause:
            print(f"rank {rank}: pausing {args.pause:g} s at step {step}", flush=True)
            time.sleep(args.pause)  # alive (its heartbeats go on), outside its steps
            return
        print(f"rank {rank}: freezing at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


def data(rank, rows=64):
    x = np.random.RandomState(rank).rand(rows, 4).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def model():
    return keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])


def tape(args):
    import tfreduce.tensorflow as hvd
    hvd.init(stall_seconds=args.init_stall, timeout_seconds=args.init_timeout)
    from tfreduce.tensorflow.process import cluster
    print(f"rank {hvd.rank()}: {cluster()!r}", flush=True)
    r = hvd.rank()
    net, optimizer = model(), keras.optimizers.SGD(0.01)
    x, y = data(r)

    @tf.function
    def step(first):
        if r == 1 and args.slow_trace and first:
            # A first trace that takes long (a big model): pure Python, the GIL
            # taken back every few ms, as a long trace does. (Only the first
            # step's: the step is traced again for first=False.)
            end = time.monotonic() + args.slow_trace
            while time.monotonic() < end:
                sum(range(1000))
        with tf.GradientTape() as g:
            loss = tf.reduce_mean((net(x) - y) ** 2)
        g = hvd.DistributedGradientTape(g)
        grads = g.gradient(loss, net.trainable_variables)
        optimizer.apply_gradients(zip(grads, net.trainable_variables))
        if first:
            hvd.broadcast_variables(net.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)
        return loss

    from tfreduce.workers.watchdog import progress
    for s in range(args.steps):
        freeze(r, s, args)
        if r == 1 and args.lag_ms and s >= args.lag_from:
            time.sleep(args.lag_ms / 1000)  # outside the step: the others wait for it
        with progress.timed():
            step(s == 0)


def fit(args):
    import tfreduce.tensorflow.keras as hvdk
    hvdk.init()
    r = hvdk.rank()
    net = model()
    net.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = data(r, rows=8 * (150 if args.logdir else 1000))

    class Freeze(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            freeze(r, batch, args)
            if r == 1 and args.lag_ms:
                time.sleep(args.lag_ms / 1000)  # before the batch's timer starts

    callbacks = [Freeze(), hvdk.callbacks.BroadcastGlobalVariablesCallback(0)]
    if args.logdir:
        callbacks.append(hvdk.callbacks.WorkerTimesCallback(
            os.path.join(args.logdir, f"rank{r}"), update_freq=20))
    net.fit(x, y, batch_size=8, epochs=1 if args.logdir else 10, verbose=0,
            callbacks=callbacks)


def trainer(args):
    from tfreduce.workers.cluster import Cluster
    from tfreduce.trainer import ReplicatedTrainer
    r = Cluster.from_tf_config().rank
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    x, y = data(r, rows=16 * args.steps)

    def watch():  # the trainer's steps are counted in tfreduce.workers.watchdog.progress
        from tfreduce.workers.watchdog import progress
        while progress.step < args.freeze_at or args.freeze_at < 0:
            time.sleep(0.01)
        freeze(r, args.freeze_at, args)

    threading.Thread(target=watch, daemon=True).start()
    run = ReplicatedTrainer(model, keras.losses.MeanSquaredError(),
                            lambda: keras.optimizers.SGD(0.01), devices=["/cpu:0", "/cpu:1"],
                            cluster="auto")
    run.fit(x, y, epochs=1 if args.logdir else 10, batch_size=16, shuffle=False, verbose=0,
            logdir=args.logdir and os.path.join(args.logdir, f"rank{r}"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("door", choices=["tape", "fit", "trainer"])
    parser.add_argument("--freeze-rank", type=int, default=1)
    parser.add_argument("--freeze-at", type=int, default=20)
    parser.add_argument("--steps", type=int, default=STEPS,
                        help="tape: steps to run; trainer: steps per epoch")
    parser.add_argument("--logdir", default=None,
                        help="trainer, fit: one epoch, summaries in LOGDIR/rank<r>")
    parser.add_argument("--slow-trace", type=float, default=0.0,
                        help="tape: rank 1's step traces this many seconds longer")
    parser.add_argument("--fail", action="store_true",
                        help="--freeze-rank raises an uncaught error at --freeze-at instead")
    parser.add_argument("--pause", type=float, default=0.0,
                        help="--freeze-rank sleeps this many seconds at --freeze-at instead")
    parser.add_argument("--lag-ms", type=float, default=0.0,
                        help="tape, fit: rank 1 sleeps this long before every step (a straggler)")
    parser.add_argument("--lag-from", type=int, default=0,
                        help="tape: the first step --lag-ms delays")
    parser.add_argument("--init-stall", type=float, default=None,
                        help="tape: hvd.init(stall_seconds=)")
    parser.add_argument("--init-timeout", type=float, default=None,
                        help="tape: hvd.init(timeout_seconds=)")
    args = parser.parse_args(argv)
    {"tape": tape, "fit": fit, "trainer": trainer}[args.door](args)
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
