"""A Horovod elastic custom loop, one worker of a job under ``tfreduce-launch --workers MIN:MAX``.

Run by tests/test_elastic.py. A Dense model learns from global batches of
12 rows, the same for any number of workers (each takes its rows by rank
and size); ``hvd.elastic.TensorFlowKerasState`` keeps the model, the
optimizer and the step, committed after every step. Options make one
worker kill itself (``--kill-id ID --kill-step S``, in the first
generation; ``--kill-again GEN:ID:STEP`` a second) or rank 0 rewrite the discovery file at a step (``--hosts-text``)
(``--grow-file PATH --grow-step S``, or before the state exists with
``--grow-at-start``); ``--sleep`` slows the steps. Every worker prints one line per
step, ``step G R N S`` (generation, rank, size, step), and rank 0 prints
the final weights as JSON.
"""

import argparse
import json
import os
import signal
import time

import numpy as np
import tensorflow as tf

import tfreduce.tensorflow as hvd
from tfreduce.workers import generations

GLOBAL_BATCH = 12


def batch(step):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(GLOBAL_BATCH, 3)).astype(np.float32)
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-id", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--kill-generation", type=int, default=0)
    parser.add_argument("--kill-again", default=None, metavar="GEN:ID:STEP",
                        help="a second kill: worker ID at STEP of generation GEN")
    parser.add_argument("--grow-file", default=None)
    parser.add_argument("--grow-step", type=int, default=-1)
    parser.add_argument("--hosts-text", default="127.0.0.1:3",
                        help="what --grow-file gets (lines of host:slots)")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    parser.add_argument("--grow-at-start", action="store_true",
                        help="rank 0 adds the slot before the state exists, then all wait 4 s")
    args = parser.parse_args()
    hvd.init()
    worker = generations.elastic_worker()
    if args.grow_at_start and worker.generation == 0:
        if hvd.rank() == 0:
            with open(args.grow_file, "w") as f:
                f.write(args.hosts_text.replace(",", "\n") + "\n")
        time.sleep(4.0)  # the launcher announces the slot before the state is made
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(
        1, kernel_initializer="zeros")])
    optimizer = tf.keras.optimizers.SGD(0.1, momentum=0.5)
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, step=0)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @hvd.elastic.run
    def train(state):
        while state.step < args.steps:
            kills = [(args.kill_generation, args.kill_id, args.kill_step)]
            if args.kill_again:
                kills.append(tuple(int(n) for n in args.kill_again.split(":")))
            if (worker.generation, worker.worker_id, state.step) in kills:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.grow_file and hvd.rank() == 0 and state.step == args.grow_step:
                with open(args.grow_file, "w") as f:
                    f.write(args.hosts_text.replace(",", "\n") + "\n")
            x, y = batch(state.step)
            rows = np.array_split(np.arange(GLOBAL_BATCH), hvd.size())[hvd.rank()]
            train_step(x[rows], y[rows])
            time.sleep(args.sleep)
            state.step += 1
            print(f"step {worker.generation} {hvd.rank()} {hvd.size()} {state.step}",
                  flush=True)
            state.commit()

    train(state)
    if hvd.rank() == 0:
        print(json.dumps({"weights": [w.tolist() for w in model.get_weights()]}), flush=True)


if __name__ == "__main__":
    main()
