"""ReplicatedTrainer on tf_keras (Keras 2) models and optimizers, in a process of its own.

``TF_USE_LEGACY_KERAS=1`` must be set before TensorFlow is imported, so
tests/test_keras2.py runs this file as its own process. For each model (a
Sequential without an Input, a subclassed model, a BatchNormalization CNN)
it fits 2 epochs on 2 towers and on 1, and a run saved after the first
epoch and resumed; then the refusals (ZeRO, mixed float16), TF Model
Garden's two training steps under MirroredStrategy with
tfreduce.CrossDeviceOps, and a deterministic run on 1 and 2 towers. Prints one JSON line of results.
"""

import hashlib
import json
import os
import sys
import tempfile

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import tfreduce  # noqa: E402

DEVICES = tfreduce.logical_devices(2)

import tf_keras  # noqa: E402

from tfreduce.trainer import ReplicatedTrainer  # noqa: E402


def dense(units, seed, **options):
    # Seeded: tf_keras draws unseeded weights from a counter of the ops made
    # before, which differs between a trainer of 1 tower and one of 2.
    return tf_keras.layers.Dense(
        units, kernel_initializer=tf_keras.initializers.GlorotUniform(seed=seed), **options)


class Subclassed(tf_keras.Model):
    """A model of its own call, built on its first batch."""

    def __init__(self):
        super().__init__()
        self.hidden = dense(16, 1, activation="relu")
        self.out = dense(3, 2)

    def call(self, x, training=False):
        return self.out(self.hidden(x))


def sequential():
    return tf_keras.Sequential([dense(16, 1, activation="relu"), dense(3, 2)])


def cnn():
    return tf_keras.Sequential([
        tf_keras.layers.Reshape((4, 4, 1), input_shape=(16,)),
        tf_keras.layers.Conv2D(4, 3, padding="same"),
        tf_keras.layers.BatchNormalization(),
        tf_keras.layers.ReLU(),
        tf_keras.layers.Flatten(),
        dense(3, 2)])


MODELS = {"sequential": sequential, "subclassed": Subclassed, "cnn": cnn}


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1).astype("int32")


def trainer(name, k, **options):
    tf_keras.utils.set_random_seed(1)
    return ReplicatedTrainer(
        MODELS[name], tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: tf_keras.optimizers.Adam(1e-2), devices=DEVICES[:k], algorithm="flat",
        **options)


def weights(run):
    return [v.numpy() for v in run.models[0].variables]


def largest_difference(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def fits(name):
    """2 epochs on 2 towers and on 1; 1 epoch, saved, restored in a new trainer, 1 more."""
    x, y = data()
    two, one = trainer(name, 2), trainer(name, 1)
    for run in (two, one):
        run.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
    folder = tempfile.mkdtemp()
    first = trainer(name, 2)
    first.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
    first.save(folder)
    resumed = trainer(name, 2)
    resumed.restore(folder)
    resumed.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
    return {"keras2": isinstance(two.models[0], tf_keras.Model),
            "steps": two.step, "drift": float(two.check_replicas()),
            "one_device": largest_difference(weights(two), weights(one)),
            "resumed": largest_difference(weights(resumed), weights(two)),
            "evaluate": two.evaluate(x, y), "predict_shape": list(two.predict(x).shape)}


def refusals():
    out = {}
    for case, options in (("zero", {"zero_stage": 1}), ("compression", {"compression": "fp16"})):
        try:
            run = trainer("sequential", 2, **options)
            x, y = data()
            run.fit(x, y, batch_size=16, verbose=0)
            out[case] = {"drift": float(run.check_replicas())}
        except (TypeError, ValueError) as error:
            out[case] = {"raised": type(error).__name__, "message": str(error)}
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        trainer("sequential", 2)
        out["mixed"] = {"raised": None}
    except (TypeError, ValueError) as error:
        out["mixed"] = {"raised": type(error).__name__, "message": str(error)}
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    return out


def deterministic():
    """sha256 of the weights after 4 deterministic steps on 1 and on 2 towers."""
    x, y = data()
    hashes = []
    for k in (1, 2):
        run = trainer("cnn", k, deterministic=True, micro_batches=2)
        for step in range(4):
            run.train_step(x[16 * step:16 * step + 16], y[16 * step:16 * step + 16])
        digest = hashlib.sha256()
        for v in weights(run):
            digest.update(v.tobytes())
        hashes.append(digest.hexdigest())
    return hashes


def compiled():
    """The BatchNormalization CNN on 2 towers, each compiled with XLA, against uncompiled."""
    x, y = data()
    runs = []
    for jit in (False, True):
        tf_keras.utils.set_random_seed(1)
        # SGD: Adam's step, about lr whatever the gradient, turns a rounding into lr.
        runs.append(ReplicatedTrainer(
            cnn, tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            lambda: tf_keras.optimizers.SGD(0.05), devices=DEVICES[:2], jit_compile=jit))
    for run in runs:
        run.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
    graph = runs[1].step_graphs()["train"]
    return {"drift": float(runs[1].check_replicas()),
            "vs_uncompiled": largest_difference(weights(runs[1]), weights(runs[0])),
            "clusters": [op.device for op in graph.get_operations()
                         if op.type == "StatefulPartitionedCall"
                         and "_XlaMustCompile" in op.node_def.attr]}


def model_garden(explicit, cross_device_ops):
    """TF Model Garden's two steps on 2 replicas of a MirroredStrategy, 3 steps of SGD.

    explicit: official/modeling/grad_utils.py's minimize_using_explicit_allreduce
    (the replica context's all-reduce, then apply_gradients with
    experimental_aggregate_gradients=False); else its default, the
    optimizer's own aggregation in apply_gradients. Returns (weights, the
    number of tfreduce reductions the steps built)."""
    import tensorflow as tf

    built = []
    original = tfreduce.Reduction.__call__

    def counted(reduction, *args, **kwargs):
        built.append(reduction)
        return original(reduction, *args, **kwargs)

    tfreduce.Reduction.__call__ = counted
    try:
        strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=cross_device_ops)
        with strategy.scope():
            model = sequential()
            model.build((None, 16))
            optimizer = tf_keras.optimizers.SGD(0.1, momentum=0.9)
        x, y = data()
        loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=tf_keras.losses.Reduction.NONE)

        def replica_step(xs, ys):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(loss_fn(ys, model(xs, training=True))) / 16.0
            grads = tape.gradient(loss, model.trainable_variables)
            if explicit:
                hints = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=0)
                grads = tf.distribute.get_strategy().extended._replica_ctx_all_reduce(
                    tf.distribute.ReduceOp.SUM, grads, hints)
                optimizer.apply_gradients(zip(grads, model.trainable_variables),
                                          experimental_aggregate_gradients=False)
            else:
                optimizer.apply_gradients(zip(grads, model.trainable_variables))

        @tf.function
        def step(xs, ys):
            strategy.run(replica_step, args=(xs, ys))

        batches = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(16).take(3))
        for xs, ys in batches:
            step(xs, ys)
        return [v.numpy() for v in model.trainable_variables], len(built)
    finally:
        tfreduce.Reduction.__call__ = original


def model_gardens():
    """Each Model Garden step with tfreduce.CrossDeviceOps against TF's own ops."""
    import tensorflow as tf

    out = {}
    for case, explicit in (("explicit", True), ("implicit", False)):
        ours, reductions = model_garden(explicit, tfreduce.CrossDeviceOps("flat"))
        theirs, _ = model_garden(explicit, tf.distribute.ReductionToOneDevice())
        out[case] = {"vs_tf_ops": largest_difference(ours, theirs), "reductions": reductions}
    return out


def main():
    result = {name: fits(name) for name in MODELS}
    result["model_garden"] = model_gardens()
    result["refusals"] = refusals()
    result["compiled"] = compiled()
    result["deterministic"] = deterministic()  # last: op determinism stays on
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
