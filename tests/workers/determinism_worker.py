"""Deterministic reductions and trainings, in a process of their own.

``deterministic=True`` turns TF's op determinism on and three Grappler
passes off for the whole process, so tests/test_determinism.py runs it here
rather than in the test process. Prints one JSON line:

- ``--reductions K,K..``: {case: sha256 of every device's result} for
  ``Reduction(deterministic=True)`` on 8 leaves summed by towers of each
  K (of 1, 2, 4 and 8), unpacked and in packs of 64 KiB (one pack holds every tensor: a
  larger pack size builds the same graph); each result, and each shard of ``tfreduce.reduce_scatter`` with the
  same reduction, is also checked here against the tree summed in NumPy,
  bit for bit, and each result's device;
- ``--train JSON``: for each case [K, algorithm, pack_bytes, steps,
  micro_batches, (zero_stage, checkpoint folder)] the sha256 of tower 0's
  weights and optimizer slots after that many steps of a small CNN with
  BatchNormalization and Dropout, the replicas' largest difference and,
  with a folder, the sha256 of a checkpoint's every tensor;
- ``--resume FOLDER``: the same for 20 steps at K=2 (saved in FOLDER
  after 10), and for the 10 steps after a restore of that checkpoint at
  K=1 and at K=4.

With ``--dict`` the model takes its images as {"image": x} (a model of a
dict of inputs), and the data is given so.
"""

import argparse
import hashlib
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfreduce  # noqa: E402

DEVICES = tfreduce.logical_devices(8)
LEAVES = 8


def numpy_tree(values):
    """The fixed tree in NumPy: adjacent pairs per level, an odd last one carried up."""
    level = list(values)
    while len(level) > 1:
        pairs = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        level = pairs + level[len(pairs) * 2:]
    return level[0]


def reductions(tower_counts):
    rng = np.random.default_rng(0)
    # Magnitudes 1e-3 .. 1e3: every order of the sum gives other bits.
    leaves = [[(rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4, shape)).astype(np.float32)
               for shape in ((1000,), (3, 5), ())] for _ in range(LEAVES)]
    want = [numpy_tree([leaf[n] for leaf in leaves]) for n in range(3)]
    hashes = {}
    for num_towers in tower_counts:
        per_tower = LEAVES // num_towers
        devices = DEVICES[:num_towers]
        for algorithm in ("flat", "hierarchical", "ring", "collective"):
            if algorithm == "hierarchical" and num_towers == 1:
                continue
            for pack_bytes in (None, 64 * 1024):
                reduction = tfreduce.Reduction(algorithm, pack_bytes=pack_bytes,
                                               deterministic=True)
                placed = []  # each result's device, as traced

                @tf.function
                def run():
                    grads = []
                    for k, device in enumerate(devices):
                        with tf.device(device):
                            mine = leaves[k * per_tower:(k + 1) * per_tower]
                            grads.append([numpy_tree([tf.constant(leaf[n]) for leaf in mine])
                                          for n in range(3)])
                    out = reduction(grads, devices)
                    placed.extend([t.device for t in row] for row in out)
                    # The sums of the other collectives: shard k of the rows on tower k.
                    rows = [row[:2] for row in grads]
                    return out, tfreduce.reduce_scatter(rows, devices, reduction=reduction)

                out, shards = run()
                case = f"K={num_towers} {algorithm} pack_bytes={pack_bytes}"
                for k, row in enumerate(shards):
                    for n, t in enumerate(row):
                        mine = np.array_split(want[n], num_towers)[k]
                        assert t.numpy().tobytes() == mine.tobytes(), (case, "shard", k, n)
                for k, row in enumerate(out):
                    for n, t in enumerate(row):
                        assert placed[k][n].endswith(f"CPU:{k}"), (case, placed[k][n])
                        assert t.numpy().tobytes() == want[n].tobytes(), (case, k, n)
                hashes[case] = hashlib.sha256(b"".join(
                    t.numpy().tobytes() for row in out for t in row)).hexdigest()
    return hashes


DICT = []  # [True] with --dict
JIT = []  # [True] with --jit: each tower's pass compiled with XLA


def make_model():
    layers = keras.Sequential([
        keras.layers.Conv2D(4, 3, padding="same", use_bias=False),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.3, seed=7),
        keras.layers.Dense(10)])
    if not DICT:
        return layers
    image = keras.Input((8, 8, 1), name="image")
    return keras.Model({"image": image}, layers(image))


def make_trainer(num_towers, algorithm="flat", pack_bytes=None, micro_batches=8, zero_stage=0):
    keras.utils.set_random_seed(1)
    return tfreduce.ReplicatedTrainer(
        make_model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: keras.optimizers.Adam(1e-2), devices=DEVICES[:num_towers],
        algorithm=algorithm, pack_bytes=pack_bytes, deterministic=True,
        micro_batches=micro_batches, zero_stage=zero_stage, jit_compile=bool(JIT))


def take_steps(trainer, first, last):
    """Steps first..last-1 of the run: step s trains on batch s of the data, in turn."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, len(x))
    for step in range(first, last):
        start = (step * 64) % len(x)
        batch = x[start:start + 64]
        trainer.train_step({"image": batch} if DICT else batch, y[start:start + 64])


def weights_hash(trainer):
    """sha256 of tower 0's weights and optimizer slots; the replicas' largest difference;
    the workers that trained (1: this process alone)."""
    digest = hashlib.sha256()
    for v in trainer.models[0].variables + trainer.optimizers[0].variables:
        digest.update(np.asarray(v.numpy()).tobytes())
    workers = 1 if trainer.cluster is None else trainer.cluster.num_workers
    return {"hash": digest.hexdigest(), "drift": float(trainer.check_replicas()),
            "workers": workers}


def saved_hash(trainer, folder):
    """sha256 of every tensor of a checkpoint of the trainer, by name.

    The checkpoint holds the optimizer's state in one layout for any K and
    ZeRO stage, so runs that shard it differently compare. Left out: the
    object graph, the save counter and ``run_layout`` (the K and stage that
    wrote it, which a restore reads to check its pieces).
    """
    trainer.save(folder)
    reader = tf.train.load_checkpoint(folder)
    digest = hashlib.sha256()
    for name in sorted(reader.get_variable_to_shape_map()):
        if not any(part in name for part in ("OBJECT_GRAPH", "save_counter", "run_layout")):
            digest.update(name.encode() + np.asarray(reader.get_tensor(name)).tobytes())
    return digest.hexdigest()


def train(num_towers, algorithm, pack_bytes, steps, micro_batches, zero_stage=0, folder=None):
    trainer = make_trainer(num_towers, algorithm, pack_bytes, micro_batches, zero_stage)
    take_steps(trainer, 0, steps)
    out = weights_hash(trainer)
    if folder:
        out["saved"] = saved_hash(trainer, folder)
    return out


def resume(folder):
    """20 steps at K=2, saved after 10; 10 more after a restore at K=1 and at K=4."""
    whole = make_trainer(2)
    take_steps(whole, 0, 10)
    whole.save(folder)
    take_steps(whole, 10, 20)
    out = {"uninterrupted": weights_hash(whole)}
    for num_towers in (1, 4):
        again = make_trainer(num_towers)
        again.restore(folder)
        assert again.step == 10, again.step
        take_steps(again, 10, 20)
        out[f"resumed at K={num_towers}"] = weights_hash(again)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reductions", type=lambda text: [int(k) for k in text.split(",")],
                        default=[])
    parser.add_argument("--train", type=json.loads, default=[])
    parser.add_argument("--resume", metavar="FOLDER")
    parser.add_argument("--dict", action="store_true")
    parser.add_argument("--jit", action="store_true")
    args = parser.parse_args()
    DICT[:] = [True] if args.dict else []
    JIT[:] = [True] if args.jit else []
    result = {"reductions": reductions(args.reductions)}
    result["train"] = [train(*case) for case in args.train]
    result["resume"] = resume(args.resume) if args.resume else {}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
