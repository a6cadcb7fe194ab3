"""A process that ``mpirun -np N`` started: it joins the others through MPI, then all-reduces.

Run by tests/test_mpirun.py. ``--door hvd``: ``hvd.init()``, then a
``hvd.allreduce`` (Sum) of rank + 1 and a ``tf.function``'s; ``--door
trainer``: ``ReplicatedTrainer(cluster="auto")`` and two steps of a Dense
model. Every process writes ``--out``/rank-R.json: its rank, the size,
its cluster's addresses and what it computed.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--door", choices=("hvd", "trainer"), required=True)
    parser.add_argument("--out", required=True, help="a folder")
    args = parser.parse_args()
    if args.door == "hvd":
        import tfreduce.tensorflow as hvd

        hvd.init()
        x = tf.fill([3], float(hvd.rank() + 1))
        eager = hvd.allreduce(x, op=hvd.Sum).numpy().tolist()
        traced = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum))(x).numpy().tolist()
        from tfreduce.tensorflow.process import cluster

        found = cluster()
        out = {"rank": hvd.rank(), "size": hvd.size(), "eager": eager, "traced": traced}
    else:
        import keras

        import tfreduce

        keras.utils.set_random_seed(0)
        trainer = tfreduce.ReplicatedTrainer(
            lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]), "mse",
            lambda: keras.optimizers.SGD(0.1))
        found = trainer.cluster
        x = np.arange(12, dtype=np.float32).reshape(4, 3)
        for _ in range(2):
            trainer.train_step(x, x.sum(axis=1, keepdims=True))
        weights = float(np.abs(trainer.models[0].get_weights()[0]).sum())
        out = {"rank": found.rank, "size": found.num_workers, "weights": weights,
               "drift": trainer.check_replicas()}
    out["addresses"] = [found.address(r) for r in range(found.num_workers)]
    with open(os.path.join(args.out, f"rank-{out['rank']}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
