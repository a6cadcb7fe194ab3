"""Horovod-style code as users write it, on 2 processes, for tests/test_user_code.py.

Run under ``tfreduce-launch --workers 2``, every rank:

1. fits the same classifier written three ways (a Sequential with
   ``keras.Input``, one without, a subclassed model) through ``model.fit``,
   ``DistributedOptimizer`` and the broadcast callback, every rank seeded
   alike, and once more without Input from weights of its own;
2. runs Horovod's TF2 custom loop: a ``tf.function`` step with
   ``DistributedGradientTape`` that broadcasts the model's and the
   optimizer's variables when ``first_batch`` is true, given as a Python
   bool and as a tensor; rank 0 records whether every collective op of the
   traced step feeds what the step runs (a pruned one hangs its peers);
3. puts a callback after the broadcast callback that changes rank 0's
   weights at the start of fit (a restore there), and one that moves rank
   0's first epoch (a restore on one rank only): the weights come out equal,
   the epochs raise a ValueError on every rank.

It writes ``rank<r>.npz`` into --out.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_BATCH, EPOCHS = 32, 2


def data():
    """96 examples of 6 features, 3 classes."""
    rng = np.random.default_rng(0)
    return rng.normal(size=(96, 6)).astype("float32"), rng.integers(0, 3, 96)


class Subclassed(keras.Model):
    """Dense(8, relu) -> Dense(3), variables made on the first call."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.logits = keras.layers.Dense(3)

    def call(self, x):
        return self.logits(self.hidden(x))


def make_model(kind, seed):
    keras.utils.set_random_seed(seed)
    if kind == "subclassed":
        return Subclassed()
    layers = [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    return keras.Sequential(([keras.Input((6,))] if kind == "input" else []) + layers)


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def fit(hvdk, kind, seed, extra_callbacks=()):
    model = make_model(kind, seed)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss=loss_fn())
    model.fit(hvdk.DistributedBatches(*data(), GLOBAL_BATCH, shuffle=False), epochs=EPOCHS,
              verbose=0, callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                                    *extra_callbacks])
    return model


def kept_collectives(concrete):
    """Whether every collective op of a traced function feeds its outputs or control outputs."""
    graph = concrete.graph
    needed, todo = set(), [t.op for t in graph.outputs] + list(graph.control_outputs)
    while todo:
        op = todo.pop()
        if op.name in needed:
            continue
        needed.add(op.name)
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    collectives = [op.name for op in graph.get_operations() if op.type.startswith("Collective")]
    return bool(collectives) and all(name in needed for name in collectives)


def first_step_broadcast(hvd, as_tensor):
    """Horovod's TF2 loop; returns (this rank's weights, rank 0's check of the graph)."""
    r = hvd.rank()
    model = make_model("noinput", 10 + r)  # other first weights on every rank
    optimizer = keras.optimizers.Adam(0.01)
    x, y = data()
    half = GLOBAL_BATCH // hvd.size()

    @tf.function
    def step(xb, yb, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn()(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)
        return loss

    for i, start in enumerate(range(0, len(x), GLOBAL_BATCH)):
        rows = slice(start + r * half, start + (r + 1) * half)
        first = tf.constant(i == 0) if as_tensor else i == 0
        step(x[rows], y[rows], first)
    flag = tf.TensorSpec([], tf.bool) if as_tensor else True
    kept = kept_collectives(step.get_concrete_function(
        tf.TensorSpec([half, 6], tf.float32), tf.TensorSpec([half], tf.int64), flag))
    return [v.numpy() for v in model.variables + optimizer.variables], kept


class ChangeRank0(keras.callbacks.Callback):
    """At the start of fit, on rank 0: new weights (what a restore does) or another epoch."""

    def __init__(self, rank, epoch=None):
        super().__init__()
        self.rank, self.epoch = rank, epoch

    def on_train_begin(self, logs=None):
        if self.rank != 0:
            return
        if self.epoch is None:
            for v in self.model.variables:
                v.assign(v + 1.0)
        else:
            self.model._initial_epoch = self.epoch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import tfreduce.tensorflow as hvd
    import tfreduce.tensorflow.keras as hvdk

    hvd.init()
    r = hvd.rank()
    out = {}
    for kind in ("input", "noinput", "subclassed"):
        model = fit(hvdk, kind, seed=1)
        for i, w in enumerate(model.get_weights()):
            out[f"{kind}/{i}"] = w
    for i, w in enumerate(fit(hvdk, "noinput", seed=20 + r).get_weights()):
        out[f"own_seed/{i}"] = w
    for name, as_tensor in (("bool", False), ("tensor", True)):
        weights, kept = first_step_broadcast(hvd, as_tensor)
        for i, w in enumerate(weights):
            out[f"loop_{name}/{i}"] = w
        out[f"loop_{name}/kept"] = np.array(kept)
    model = fit(hvdk, "input", seed=30 + r, extra_callbacks=[ChangeRank0(r)])
    for i, w in enumerate(model.get_weights()):
        out[f"restored_after/{i}"] = w
    try:
        fit(hvdk, "input", seed=1, extra_callbacks=[ChangeRank0(r, epoch=1)])
        out["epoch_error"] = np.array("")
    except ValueError as e:
        out["epoch_error"] = np.array(str(e))
    np.savez(os.path.join(args.out, f"rank{r}.npz"), **out)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
