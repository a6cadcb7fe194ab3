"""Models and scripts as users write them, in every door.

Most Keras code builds its model on the first batch (a Sequential without
``keras.Input``, a subclassed model): each door trains such models to the
same weights as the same model with an Input. The 2-process part runs
tests/workers/user_code_worker.py (Horovod-style scripts).
"""

import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES
from test_multiworker import launch_workers

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from user_code_worker import Subclassed  # noqa: E402

KINDS = ("input", "noinput", "subclassed")


def make_model(kind, seed=1, norm=False):
    """Dense(8, relu) [-> BatchNormalization] -> Dense(3) on 6 features, written three ways.

    kind: "input", "noinput" (a Sequential with or without keras.Input) or
    "subclassed" (no norm); the weights are drawn from seed."""
    keras.utils.set_random_seed(seed)
    if kind == "subclassed":
        return Subclassed()
    layers = [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    if norm:
        layers.insert(1, keras.layers.BatchNormalization())
    return keras.Sequential(([keras.Input((6,))] if kind == "input" else []) + layers)


def data(count=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(count, 6)).astype("float32"), rng.integers(0, 3, count)


def trainer(kind, zero_stage=0, seed=1, norm=True):
    return tfreduce.ReplicatedTrainer(
        lambda: make_model(kind, seed, norm),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: keras.optimizers.Adam(0.01), devices=CPU_DEVICES[:2], zero_stage=zero_stage)


def weights(model):
    return [np.array(w) for w in model.get_weights()]


def assert_same(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"variable {i}")


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_trainer_fits_models_built_on_their_first_batch_like_one_with_an_input(
        zero_stage, tmp_path):
    x, y = data()
    runs = {}
    for kind in ("input", "noinput"):
        t = trainer(kind, zero_stage)
        assert t.models[0].built == (kind == "input")
        # evaluate and predict before any training build the models too
        assert set(t.evaluate(x, y)) == {"loss", "accuracy"}
        t.fit(x, y, epochs=2, batch_size=16, verbose=0, logdir=str(tmp_path / kind),
              profile_steps=(2, 2))
        assert t.check_replicas() == 0.0
        assert (tmp_path / kind / "timeline.json.gz").exists()
        runs[kind] = weights(t.models[0])
    assert_same(runs["noinput"], runs["input"])


@pytest.mark.slow
def test_a_subclassed_model_trains_like_the_same_layers_in_a_sequential():
    x, y = data()
    runs = {}
    for kind in ("subclassed", "input"):
        t = trainer(kind, norm=False)
        t.fit(x, y, epochs=2, batch_size=16, verbose=0)
        assert t.check_replicas() == 0.0
        runs[kind] = weights(t.models[0])
    assert_same(runs["subclassed"], runs["input"])


@pytest.mark.slow
def test_a_restore_before_the_first_batch_resumes_at_the_saved_step(tmp_path):
    # The restore waits for the build, but fit must know the step at once:
    # the epochs already trained are not trained again.
    x, y = data()
    first = trainer("noinput")
    first.fit(x, y, epochs=1, batch_size=16, verbose=0, checkpoint_dir=str(tmp_path))
    first.fit(x, y, epochs=3, batch_size=16, verbose=0)
    resumed = trainer("noinput", seed=2)
    resumed.restore(str(tmp_path))
    assert resumed.step == 4 and not resumed.models[0].built
    history = resumed.fit(x, y, epochs=3, batch_size=16, verbose=0)
    assert history["epoch"] == [2, 3]
    assert resumed.step == first.step == 12
    assert_same(weights(resumed.models[0]), weights(first.models[0]))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_mirrored_fit_with_tfreduce_trains_every_kind_of_model_alike(kind):
    x, y = data()
    strategy = tf.distribute.MirroredStrategy(
        CPU_DEVICES[:2], cross_device_ops=tfreduce.CrossDeviceOps("flat", pack_bytes=None))
    with strategy.scope():
        model = make_model(kind)
        model.compile(optimizer="adam", jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    got = weights(model)
    with strategy.scope():
        reference = make_model("input")
        reference.compile(optimizer="adam", jit_compile=False,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    reference.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    assert_same(got, weights(reference))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("user_code")
    code, _, err, _ = launch_workers("user_code_worker.py", "--out", out, timeout=400)
    assert code == 0, err[-3000:]
    return [np.load(out / f"rank{r}.npz") for r in range(2)]


def variables(got, name):
    return [got[k] for k in sorted((k for k in got.files if k.startswith(f"{name}/")
                                    and k.split("/")[1].isdigit()),
                                   key=lambda k: int(k.split("/")[1]))]


@pytest.mark.slow
def test_distributed_optimizer_fits_models_built_on_their_first_batch(ranks):
    for r, got in enumerate(ranks):
        assert_same(variables(got, "noinput"), variables(got, "input"))
        assert_same(variables(got, "subclassed"), variables(got, "input"))
    for name in ("input", "own_seed"):  # the replicas are identical
        assert_same(variables(ranks[1], name), variables(ranks[0], name))


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["bool", "tensor"])
def test_horovods_first_step_broadcast_in_a_tf_function_trains(ranks, flag):
    # It hung after step 0: rank 0's send fed no op its step ran, so the
    # function dropped it and rank 1 waited for it forever.
    assert bool(ranks[0][f"loop_{flag}/kept"])
    assert_same(variables(ranks[1], f"loop_{flag}"), variables(ranks[0], f"loop_{flag}"))


@pytest.mark.slow
def test_the_broadcast_callback_comes_after_any_restore_whatever_the_order(ranks):
    assert_same(variables(ranks[1], "restored_after"), variables(ranks[0], "restored_after"))
    for got in ranks:
        assert str(got["epoch_error"]) == (
            "fit begins rank 0 at epoch 2, rank 1 at epoch 1: a callback restored a checkpoint "
            "on some ranks only, after BroadcastGlobalVariablesCallback sent the first epoch; "
            "put BackupAndRestore before BroadcastGlobalVariablesCallback, or give it to "
            "every rank")
