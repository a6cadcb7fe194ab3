"""Every input structure Keras' fit takes, in ReplicatedTrainer: dicts, lists, weights, PyDataset.

A model with two inputs (a dict, as keras-hub's models take, or a list) is
trained from arrays, from a tf.data.Dataset of (dict, y) batches and from a
keras.utils.PyDataset: the replicas stay equal and the weights equal one
tower's run on the same global batches to float32 rounding. Sample weights
weigh each example's loss as Keras' do (checked against NumPy), from arrays
and from (x, y, sample_weight) datasets. Bad structures get a message that
names the leaf and both batch sizes, and never prints the values.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import CPU_DEVICES
from tfreduce.trainer import ReplicatedTrainer


def two_inputs():
    """A functional model of inputs "ids" [4] and "mask" [4] (a dict), one output of 3."""
    ids, mask = keras.Input((4,), name="ids"), keras.Input((4,), name="mask")
    hidden = keras.layers.Dense(5, activation="tanh")(keras.layers.Concatenate()([ids, mask]))
    return keras.Model({"ids": ids, "mask": mask}, keras.layers.Dense(3)(hidden))


def listed():
    """The same as a model of a list of two inputs."""
    a, b = keras.Input((4,)), keras.Input((4,))
    hidden = keras.layers.Dense(5, activation="tanh")(keras.layers.Concatenate()([a, b]))
    return keras.Model([a, b], keras.layers.Dense(3)(hidden))


def data(n=24, seed=0):
    rng = np.random.default_rng(seed)
    x = {"ids": rng.normal(size=(n, 4)).astype("float32"),
         "mask": rng.normal(size=(n, 4)).astype("float32")}
    return x, rng.integers(0, 3, n)


def trainer(model_fn, k, **kwargs):
    keras.utils.set_random_seed(1)
    return ReplicatedTrainer(model_fn, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                             lambda: keras.optimizers.SGD(0.1), devices=CPU_DEVICES[:k],
                             algorithm="flat", **kwargs)


def weights(run):
    return [v.numpy() for v in run.models[0].trainable_variables]


def assert_same(a, b):
    for got, want in zip(weights(a), weights(b)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_dict_of_arrays_a_dataset_of_dicts_and_a_pydataset_train_alike():
    x, y = data()
    one = trainer(two_inputs, 1)
    one.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
    runs = {}
    for name in ("arrays", "dataset", "pydataset"):
        runs[name] = run = trainer(two_inputs, 4)
        if name == "arrays":
            run.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
        elif name == "dataset":
            run.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=2, verbose=0)
        else:
            run.fit(Batches(x, y, 8), epochs=2, verbose=0)
        assert run.step == 6 and run.check_replicas() == 0.0, name
        assert_same(run, one)
    # evaluate and predict take the same structures; predict keeps the order.
    results = runs["arrays"].evaluate(x, y, batch_size=8)
    assert results == pytest.approx(runs["dataset"].evaluate(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8)))
    outputs = runs["arrays"].predict(x, batch_size=8)
    np.testing.assert_allclose(outputs, runs["arrays"].models[0](x).numpy(), rtol=1e-5, atol=1e-6)
    assert Batches.epochs_ended == 2  # the PyDataset's own on_epoch_end, once per epoch


class Batches(keras.utils.PyDataset):
    """The global batches of (x, y) arrays, by index."""

    epochs_ended = 0

    def __init__(self, x, y, size):
        super().__init__()
        self.x, self.y, self.size = x, y, size

    def __len__(self):
        return len(self.y) // self.size

    def __getitem__(self, i):
        part = slice(i * self.size, (i + 1) * self.size)
        return {k: v[part] for k, v in self.x.items()}, self.y[part]

    def on_epoch_end(self):
        Batches.epochs_ended += 1


@pytest.mark.slow
def test_a_list_of_inputs_trains_as_the_dict_does():
    x, y = data()
    by_dict, by_list = trainer(two_inputs, 2), trainer(listed, 2)
    by_dict.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    by_list.fit([x["ids"], x["mask"]], y, batch_size=8, shuffle=False, verbose=0)
    assert by_list.check_replicas() == 0.0
    assert_same(by_list, by_dict)


def linear():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])


def test_sample_weights_weigh_each_examples_loss_as_keras_does():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(10, 3)).astype("float32")
    y = rng.normal(size=(10, 1)).astype("float32")
    w = rng.uniform(0, 2, size=10).astype("float32")
    run = ReplicatedTrainer(linear, "mse", lambda: keras.optimizers.SGD(0.1),
                            devices=CPU_DEVICES[:4], algorithm="flat")
    kernel = run.models[0].trainable_variables[0].numpy()
    squared = ((x @ kernel - y) ** 2)[:, 0]
    # Keras' sum_over_batch_size: the mean over the batch of w * loss.
    assert run.evaluate(x, y, sample_weight=w)["loss"] == pytest.approx(
        float(np.mean(w * squared)), rel=1e-5)
    dataset = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(4)
    assert run.evaluate(dataset)["loss"] == pytest.approx(float(np.mean(w * squared)), rel=1e-5)
    # One step: the gradient of that weighted mean.
    loss = run.train_step(x, y, sample_weight=w)
    assert loss == pytest.approx(float(np.mean(w * squared)), rel=1e-5)
    gradient = (2 * w[:, None] * (x @ kernel - y) * x).mean(axis=0)[:, None]
    np.testing.assert_allclose(run.models[0].trainable_variables[0].numpy(),
                               kernel - 0.1 * gradient, rtol=1e-5, atol=1e-6)
    assert run.check_replicas() == 0.0


@pytest.mark.slow
def test_a_dataset_of_weighted_batches_trains_as_weighted_arrays():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    w = rng.uniform(0, 2, size=16).astype("float32")
    runs = [ReplicatedTrainer(linear, "mse", lambda: keras.optimizers.SGD(0.1),
                              devices=CPU_DEVICES[:2], algorithm="flat") for _ in range(2)]
    runs[1].models[0].set_weights(runs[0].models[0].get_weights())
    runs[1].broadcast()
    runs[0].fit(x, y, sample_weight=w, batch_size=8, shuffle=False, verbose=0,
                validation_data=(x, y, w))
    runs[1].fit(tf.data.Dataset.from_tensor_slices((x, y, w)).batch(8), verbose=0,
                validation_data=tf.data.Dataset.from_tensor_slices((x, y, w)).batch(8))
    assert_same(runs[1], runs[0])


@pytest.mark.parametrize("call, message", [
    (lambda run, x, y: run.fit({"ids": x["ids"], "mask": x["mask"][:9]}, y, verbose=0),
     "fit: x['ids'] has 24 examples but x['mask'] has 9"),
    (lambda run, x, y: run.fit(x, y[:3], verbose=0), "fit: x['ids'] has 24 examples but y has 3"),
    (lambda run, x, y: run.fit(x, y, sample_weight=np.ones(5), verbose=0),
     "fit: x['ids'] has 24 examples but sample_weight has 5"),
    (lambda run, x, y: run.train_step({"ids": x["ids"], "mask": x["mask"][:3]}, y),
     "train_step: x['ids'] has 24 examples but x['mask'] has 3"),
    (lambda run, x, y: run.fit(
        tf.data.Dataset.from_tensor_slices((x, y, y, y)).batch(8), verbose=0),
     "fit: the dataset's elements are 4 items; give (x, y) or (x, y, sample_weight) global "
     "batches"),
    (lambda run, x, y: run.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), y,
                               verbose=0),
     "fit: y and sample_weight must be None when x is a tf.data.Dataset of (x, y) or (x, y, "
     "sample_weight) batches"),
    (lambda run, x, y: run.fit((b for b in [(x, y)]), verbose=0),
     "fit: x is a generator, which can be read only once; give a keras.utils.PyDataset"),
    (lambda run, x, y: run.evaluate({"ids": x["ids"]}, y[:2]),
     "evaluate: x['ids'] has 24 examples but y has 2"),
])
def test_a_bad_structure_is_named_leaf_by_leaf(call, message):
    x, y = data()
    run = trainer(two_inputs, 2)
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        call(run, x, y)
    assert "0." not in str(raised.value)  # never the values
    assert run.step == 0
