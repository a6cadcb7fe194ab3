"""``ReplicatedTrainer.fit`` with ``deterministic=True``, one worker of an elastic job.

Run by tests/test_elastic_trainer.py under ``tfreduce-launch --workers
MIN:MAX`` (or a fixed ``--workers N`` for the uninterrupted run). A small
model with BatchNormalization and Dropout learns 40 steps (4 epochs of 10
global batches of 32) on one CPU device per worker, committing every 5
steps. ``--kill-id ID --kill-step S`` makes worker ID kill itself with
SIGKILL after step S of the first generation; ``--grow-file PATH
--grow-step S`` makes rank 0 write ``--hosts-text`` to the discovery file
after step S; ``--sleep`` slows each step. Every worker prints ``step G R
W S`` (generation, rank, workers, steps taken) after each step, and rank 0
prints the sha256 of the final model and optimizer variables as JSON.
"""

import argparse
import hashlib
import json
import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfreduce  # noqa: E402
from tfreduce.workers import generations  # noqa: E402


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 8)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(8, 4)), axis=1).astype(np.int32)
    return x, y


def model():
    return keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
        keras.layers.BatchNormalization(), keras.layers.Dropout(0.2, seed=3),
        keras.layers.Dense(4)])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-id", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--grow-file", default=None)
    parser.add_argument("--grow-step", type=int, default=-1)
    parser.add_argument("--hosts-text", default="127.0.0.1:4")
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    worker = generations.elastic_worker()
    trainer = tfreduce.ReplicatedTrainer(
        model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: keras.optimizers.Adam(0.01), deterministic=True, micro_batches=4)
    cluster = trainer.cluster
    rank, size = (cluster.rank, cluster.num_workers) if cluster is not None else (0, 1)
    generation, worker_id = (0, rank) if worker is None else (worker.generation, worker.worker_id)

    def hook(step, phase):
        if phase != "end":
            return
        print(f"step {generation} {rank} {size} {step}", flush=True)
        if (generation, worker_id, step) == (0, args.kill_id, args.kill_step):
            os.kill(os.getpid(), signal.SIGKILL)
        if args.grow_file and rank == 0 and step == args.grow_step:
            with open(args.grow_file, "w") as f:
                f.write(args.hosts_text.replace(",", "\n") + "\n")
        time.sleep(args.sleep)

    trainer.fault_hook = hook
    x, y = data()
    trainer.fit(x, y, epochs=4, batch_size=32, commit_every=5, verbose=0)
    if rank == 0:
        digest = hashlib.sha256()
        for v in trainer.models[0].variables + trainer.optimizers[0].variables:
            digest.update(np.asarray(v.numpy()).tobytes())
        print(json.dumps({"sha256": digest.hexdigest(), "step": trainer.step,
                          "drift": trainer.check_replicas()}), flush=True)


if __name__ == "__main__":
    main()
