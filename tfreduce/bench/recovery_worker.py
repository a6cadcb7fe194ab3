"""One worker of the faults mode's recovery drill: the example CNN in an elastic job.

Run by ``tfreduce.bench.faults_mode`` (``--fault recover``) under
``tfreduce.launch --workers 2:3``. The model is the example's CNN on random
28x28 images (global batch 64, split by rank), trained with Horovod's
elastic API, in a ``DistributedGradientTape`` loop (``--loop tape``) or
``fit`` with ``DistributedOptimizer`` and the elastic callbacks (``--loop
fit``), or ``ReplicatedTrainer.fit`` (``--loop trainer``, its commits timed
as the steps that commit less the others), committing every
``--commit-every`` steps. Worker 2 kills itself
with SIGKILL at ``--kill-step`` in the first generation, after printing
``act kill <unix time>``. Rank 0 prints ``step <generation> <step> <unix
time>`` after each step, and at the end ``cost <seconds per commit>
<seconds per step>`` (the medians of the last generation).
"""

import argparse
import json
import os
import signal
import statistics
import time

import numpy as np
import tensorflow as tf

import tfreduce.tensorflow.keras as hvd
from tfreduce.trainer.models import image_cnn
from tfreduce.workers import generations

GLOBAL_BATCH = 64


def _rank():
    """This worker's rank in its generation (the launcher's TF_CONFIG, for every loop)."""
    return json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def _batch(step, rank, size):
    rng = np.random.default_rng(step)
    x = rng.random((GLOBAL_BATCH, 28, 28, 1), np.float32)
    y = rng.integers(0, 10, GLOBAL_BATCH)
    rows = np.array_split(np.arange(GLOBAL_BATCH), size)[rank]
    return x[rows], y[rows]


class _Clock:
    """This worker's step and commit times, and the drill's act."""

    def __init__(self, args, worker):
        self.args, self.worker = args, worker
        self.steps, self.commits, self.last = [], [], None

    def before(self, step):
        if (self.worker.generation == 0 and self.worker.worker_id == 2
                and step == self.args.kill_step):
            print(f"act kill {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        self.last = time.perf_counter()

    def after(self, step):
        self.steps.append(time.perf_counter() - self.last)
        if _rank() == 0:
            print(f"step {self.worker.generation} {step} {time.time():.3f}", flush=True)

    def timing(self, state):
        """Makes `state`'s commits timed; returns the state."""
        commit = state.commit

        def timed():
            start = time.perf_counter()
            try:
                commit()
            finally:
                self.commits.append(time.perf_counter() - start)

        state.commit = timed
        return state


def _tape(args, clock, model, optimizer, loss_fn):
    import tfreduce.tensorflow as hvd_tf

    state = clock.timing(hvd.elastic.KerasState(model, optimizer, step=0))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = hvd_tf.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @hvd.elastic.run
    def train(state):
        while state.step < args.steps:
            clock.before(state.step)
            step(*_batch(state.step, hvd.rank(), hvd.size()))
            state.step += 1
            clock.after(state.step)
            if state.step % args.commit_every == 0:
                state.commit()

    train(state)


def _fit(args, clock, model, optimizer, loss_fn):
    model.compile(hvd.DistributedOptimizer(optimizer), loss_fn)
    state = clock.timing(hvd.elastic.KerasState(model, batch=0, epoch=0))
    per_epoch = 10

    class Timed(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            clock.before(state.epoch * per_epoch + batch)

        def on_train_batch_end(self, batch, logs=None):
            clock.after(state.epoch * per_epoch + batch + 1)

    callbacks = [Timed(), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=args.commit_every)]

    def batches():
        step = 0
        while True:
            yield _batch(step, hvd.rank(), hvd.size())
            step += 1

    @hvd.elastic.run
    def train(state):
        data = tf.data.Dataset.from_generator(batches, output_signature=(
            tf.TensorSpec([None, 28, 28, 1], tf.float32), tf.TensorSpec([None], tf.int64)))
        model.fit(data, steps_per_epoch=per_epoch, epochs=args.steps // per_epoch - state.epoch,
                  callbacks=callbacks, verbose=0)

    train(state)


def _trainer(args, clock, loss_fn):
    import tfreduce

    # The trainer starts its cluster (cluster="auto") before it makes the model.
    trainer = tfreduce.ReplicatedTrainer(lambda: image_cnn((28, 28, 1), 10), loss_fn,
                                         lambda: tf.keras.optimizers.SGD(0.01, momentum=0.9))
    times = {True: [], False: []}  # commits or not -> seconds of those steps

    def hook(step, phase):
        if phase == "start":
            clock.before(step)
        else:
            clock.after(step)
            times[step % args.commit_every == 0].append(clock.steps.pop())

    trainer.fault_hook = hook
    rng = np.random.default_rng(0)
    # One epoch of all the steps: its end's commit is the last step's, so every
    # commit timed is one of commit_every's.
    x = rng.random((GLOBAL_BATCH * args.steps, 28, 28, 1), np.float32)
    y = rng.integers(0, 10, GLOBAL_BATCH * args.steps)
    trainer.fit(x, y, epochs=1, batch_size=GLOBAL_BATCH, shuffle=False,
                commit_every=args.commit_every, verbose=0)
    # A process's first commit also traces TF's save function: the steady cost is the rest.
    commits = times[True][1:] or times[True]
    if commits and times[False]:
        clock.commits.append(max(statistics.median(commits) - statistics.median(times[False]),
                                 0.0))
        clock.steps.extend(times[False])


_LOOPS = {"tape": _tape, "fit": _fit}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--loop", choices=(*_LOOPS, "trainer"), default="tape")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-step", type=int, default=30)
    parser.add_argument("--commit-every", type=int, default=1)
    args = parser.parse_args(argv)
    clock = _Clock(args, generations.elastic_worker())
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if args.loop == "trainer":
        _trainer(args, clock, loss_fn)
    else:
        hvd.init()
        model = image_cnn((28, 28, 1), 10)
        optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)
        _LOOPS[args.loop](args, clock, model, optimizer, loss_fn)
    if _rank() == 0 and clock.commits:
        print(f"cost {statistics.median(clock.commits):.6f} "
              f"{statistics.median(clock.steps[1:] or clock.steps):.6f}", flush=True)


if __name__ == "__main__":
    main()
