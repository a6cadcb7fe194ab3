"""Horovod's Keras API on Keras 2 (tf_keras as tf.keras), one rank of a 2-process run.

Run by tests/test_keras2.py under ``tfreduce-launch --workers 2`` with
``TF_USE_LEGACY_KERAS=1`` (set before TensorFlow starts). Each rank:

- fit: a Sequential without an Input trained 2 epochs on its half of each
  global batch, with tf_keras' SGD (momentum) and then the legacy Adam,
  wrapped in DistributedOptimizer, with BroadcastGlobalVariablesCallback
  and MetricAverageCallback; also the same model trained alone on the
  global batches (the reference);
- loop: ``_compute_gradients`` and ``apply_gradients`` in a tf.function
  with backward_passes_per_step=3, a gradient that differs by rank and a
  variable registered local;
- tape: DistributedGradientTape in a tf.function, against one process;
- load: rank 0 saves the SGD model; both load it with ``hvd.load_model``
  and train one more epoch.

Prints one JSON line of what it found.
"""

import json
import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfreduce.tensorflow as hvd_tf  # noqa: E402
import tfreduce.tensorflow.keras as hvd  # noqa: E402

keras = tf.keras
STEPS, PER_RANK = 4, 4


def model():
    init = keras.initializers.GlorotUniform(seed=3)
    return keras.Sequential([keras.layers.Dense(8, activation="tanh", kernel_initializer=init),
                             keras.layers.Dense(2, kernel_initializer=init)])


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, 2, PER_RANK, 5)).astype(np.float32)  # [step, rank, row, 5]
    y = rng.normal(size=(STEPS, 2, PER_RANK, 2)).astype(np.float32)
    return x, y


def fitted(make_optimizer, rank):
    x, y = data()
    distributed = model()
    distributed.compile(hvd.DistributedOptimizer(make_optimizer()), "mse")
    history = distributed.fit(
        x[:, rank].reshape(-1, 5), y[:, rank].reshape(-1, 2), batch_size=PER_RANK, epochs=2,
        shuffle=False, verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                   hvd.callbacks.MetricAverageCallback()])
    alone = model()
    alone.compile(make_optimizer(), "mse")
    alone.fit(x.reshape(-1, 5), y.reshape(-1, 2), batch_size=2 * PER_RANK, epochs=2,
              shuffle=False, verbose=0)
    drift = max(float(np.max(np.abs(a - b)))
                for a, b in zip(distributed.get_weights(), alone.get_weights()))
    return distributed, {"vs_one_process": drift, "loss": history.history["loss"],
                         "optimizer": type(distributed.optimizer).__name__,
                         "iterations": int(distributed.optimizer.iterations.numpy())}


def loop(rank):
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), backward_passes_per_step=3)
    x = tf.Variable([1.0, 1.0])
    mine = tf.Variable([1.0, 1.0])
    optimizer.register_local_var(mine)
    c = tf.constant([rank + 1.0, 2.0 * (rank + 1.0)])

    @tf.function
    def step():
        pairs = optimizer._compute_gradients(lambda: tf.reduce_sum(x * c + mine * c), [x, mine])
        optimizer.apply_gradients(pairs)

    for _ in range(7):
        step()
    return {"x": x.numpy().tolist(), "mine": mine.numpy().tolist(),
            "iterations": int(optimizer.iterations.numpy()),
            "counter": int(optimizer._agg_helper.counter.numpy())}


def tape_step(net, optimizer, distributed):
    def step(xs, ys):
        with tf.GradientTape() as t:
            loss = tf.reduce_mean(tf.square(net(xs) - ys))
        t = hvd_tf.DistributedGradientTape(t) if distributed else t
        grads = t.gradient(loss, net.trainable_variables)
        optimizer.apply_gradients(zip(grads, net.trainable_variables))

    return tf.function(step, autograph=False)


def tape(rank):
    """DistributedGradientTape in a tf.function, a tf_keras model and optimizer, 4 steps:
    the largest difference from one process on the whole batches."""
    x, y = data()
    runs = []
    for distributed in (True, False):
        net = model()
        net.build((None, 5))
        step = tape_step(net, keras.optimizers.SGD(0.1), distributed)
        for n in range(STEPS):
            if distributed:
                step(x[n, rank], y[n, rank])
            else:
                step(x[n].reshape(-1, 5), y[n].reshape(-1, 2))
        runs.append(net.get_weights())
    return max(float(np.max(np.abs(a - b))) for a, b in zip(*runs))


def load(trained, rank, directory):
    path = os.path.join(directory, "model.h5")
    if rank == 0:
        trained.save(path)
    hvd.allreduce(0.0)  # the file is there
    loaded = hvd.load_model(path)
    saved = [v.numpy() for v in trained.optimizer.variables]
    slots_equal = len(saved) > 1 and all(np.array_equal(v.numpy(), w) for v, w in zip(
        loaded.optimizer.variables, saved))
    x, y = data()
    loaded.fit(x[:, rank].reshape(-1, 5), y[:, rank].reshape(-1, 2), batch_size=PER_RANK,
               epochs=1, shuffle=False, verbose=0)
    weights = [w.tolist() for w in loaded.get_weights()]
    return {"distributed": hasattr(loaded.optimizer, "_tfreduce_reduction"),
            "optimizer": type(loaded.optimizer).__name__, "slots_equal": slots_equal,
            "weights": weights}


def main():
    hvd.init()
    rank = hvd.rank()
    sgd, found_sgd = fitted(lambda: keras.optimizers.SGD(0.1, momentum=0.9), rank)
    _, found_adam = fitted(lambda: keras.optimizers.legacy.Adam(0.01), rank)
    found = {"rank": rank, "keras2": "tf_keras" in type(sgd).__module__, "sgd": found_sgd,
             "legacy_adam": found_adam, "loop": loop(rank), "tape_vs_one_process": tape(rank),
             "load": load(sgd, rank, sys.argv[1])}
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
