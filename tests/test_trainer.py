"""ReplicatedTrainer: equivalence with one device, replica sync, checkpoints, errors."""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES, scalars
from tfreduce.trainer import ReplicatedTrainer

CPU_ALGORITHMS = [a for a in tfreduce.ALGORITHMS if a != "nccl"]
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# Global batch sizes of the 10 equivalence steps; 11 splits unevenly over
# 2 towers (6, 5) and 4 towers (3, 3, 3, 2).
BATCH_SIZES = [16] * 9 + [11]


def mlp(regularizer=None):
    """A float64 two-layer classifier: 5 features -> 3 classes."""
    return keras.Sequential(
        [
            keras.Input((5,), dtype="float64"),
            keras.layers.Dense(
                7, activation="tanh", dtype="float64", kernel_regularizer=regularizer
            ),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )


def bn_mlp():
    """A float64 classifier with BatchNormalization on its inputs."""
    return keras.Sequential(
        [
            keras.Input((5,), dtype="float64"),
            keras.layers.BatchNormalization(dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )


def data(count, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(count, 5)), rng.integers(0, 3, size=count)


def sgd():
    return keras.optimizers.SGD(0.1)


def values(variables):
    return [np.array(v.numpy()) for v in variables]


def single_device_run(model_fn, optimizer_fn, initial, batches):
    """Trains one model on CPU:0 on whole global batches with a plain tape."""
    with tf.device(CPU_DEVICES[0]):
        model = model_fn()
        optimizer = optimizer_fn()
    for v, w in zip(model.trainable_variables, initial):
        v.assign(w)
    for x, y in batches:
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            )
            if model.losses:
                loss += tf.add_n(model.losses)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return values(model.trainable_variables)


def assert_equivalent(trainer, model_fn, optimizer_fn):
    initial = values(trainer.models[0].trainable_variables)
    x, y = data(sum(BATCH_SIZES))
    ends = np.cumsum(BATCH_SIZES)
    batches = [(x[end - size : end], y[end - size : end]) for size, end in zip(BATCH_SIZES, ends)]
    for xb, yb in batches:
        trainer.train_step(xb, yb)
    expected = single_device_run(model_fn, optimizer_fn, initial, batches)
    for k, model in enumerate(trainer.models):
        for got, want in zip(values(model.trainable_variables), expected):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"tower {k}")
    assert trainer.check_replicas() == pytest.approx(0.0, abs=1e-12)
    assert trainer.step == len(BATCH_SIZES)


@pytest.mark.parametrize("num_towers", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("algorithm", [
    pytest.param(a, marks=[pytest.mark.slow] * (a == "collective")) for a in CPU_ALGORITHMS])
def test_k_towers_train_like_one_device(algorithm, num_towers):
    trainer = ReplicatedTrainer(
        mlp, LOSS, sgd, devices=CPU_DEVICES[:num_towers], algorithm=algorithm
    )
    assert_equivalent(trainer, mlp, sgd)


@pytest.mark.slow
@pytest.mark.parametrize("average", [True, False])
def test_equivalence_with_adam_and_regularisation(average):
    def model_fn():
        return mlp(keras.regularizers.L2(0.01))

    def adam():
        return keras.optimizers.Adam(0.01)

    trainer = ReplicatedTrainer(
        model_fn, LOSS, adam, devices=CPU_DEVICES[:4], algorithm="flat", average=average
    )
    assert_equivalent(trainer, model_fn, adam)


def test_replicas_and_optimizer_state_live_on_their_devices():
    trainer = ReplicatedTrainer(
        mlp, "sparse_categorical_crossentropy", sgd, devices=CPU_DEVICES[:3]
    )
    for k, (model, optimizer) in enumerate(zip(trainer.models, trainer.optimizers)):
        for v in list(model.variables) + list(optimizer.variables):
            assert v.value.device.endswith(f"device:CPU:{k}"), (k, v.path, v.value.device)


def test_default_devices_are_every_cpu_without_gpus():
    if tf.config.list_logical_devices("GPU"):
        pytest.skip("the default is every GPU on a machine that has GPUs")
    trainer = ReplicatedTrainer(mlp, LOSS, sgd)
    assert trainer.devices == CPU_DEVICES


def test_tower_zero_is_broadcast_at_start():
    initial = []

    def model_fn():
        model = mlp()  # unseeded: every tower starts from different weights
        initial.append(values(model.variables))
        return model

    trainer = ReplicatedTrainer(model_fn, LOSS, sgd, devices=CPU_DEVICES[:3])
    assert not np.allclose(initial[0][0], initial[1][0])
    for model in trainer.models:
        for got, want in zip(values(model.variables), initial[0]):
            np.testing.assert_array_equal(got, want)
    assert trainer.check_replicas() == 0.0


def test_unbuilt_model_is_built_on_the_first_batch():
    def model_fn():
        return keras.Sequential([keras.layers.Dense(3, dtype="float64")])

    trainer = ReplicatedTrainer(model_fn, LOSS, sgd, devices=CPU_DEVICES[:2])
    assert not trainer.models[0].built
    with pytest.raises(ValueError, match="check_replicas: the models are not built yet"):
        trainer.check_replicas()
    x, y = data(8)
    trainer.train_step(x, y)
    assert trainer.models[1].variables[0].value.device.endswith("device:CPU:1")
    assert trainer.check_replicas() == 0.0


def test_fit_builds_a_model_without_an_input_on_its_first_batch():
    # Once, fit raised AttributeError ('NoneType' object has no attribute
    # 'graphs') before its first batch could build the model.
    def model_fn():
        return keras.Sequential([keras.layers.Dense(3, dtype="float64")])

    trainer = ReplicatedTrainer(model_fn, LOSS, sgd, devices=CPU_DEVICES[:2])
    x, y = data(8)
    history = trainer.fit(x, y, batch_size=4, verbose=0)
    assert trainer.step == 2 and history["epoch"] == [1]
    assert trainer.models[0].built and trainer.check_replicas() == 0.0


@pytest.mark.slow
def test_periodic_rebroadcast_repairs_drift():
    x, y = data(8)
    drifting = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], bcast_period=3)
    never = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2])
    for trainer in (drifting, never):
        kernel = trainer.models[1].trainable_variables[0]
        kernel.assign(kernel + 0.5)
        assert trainer.check_replicas() == pytest.approx(0.5)
    for step in (1, 2):
        drifting.train_step(x, y)
        assert drifting.check_replicas() > 0.1, f"re-synced early, at step {step}"
    drifting.train_step(x, y)
    assert drifting.check_replicas() == 0.0
    for _ in range(3):
        never.train_step(x, y)
    assert never.check_replicas() > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["flat", "collective"])
def test_batchnorm_statistics_are_synced_as_shard_weighted_means(algorithm):
    trainer = ReplicatedTrainer(bn_mlp, LOSS, sgd, devices=CPU_DEVICES[:4], algorithm=algorithm)
    x, y = data(10)
    trainer.train_step(x, y)
    # Shards of 10 over 4 towers: 3, 3, 2, 2.
    shards = np.split(x, [3, 6, 8])
    weights = np.array([3, 3, 2, 2]) / 10
    momentum = 0.99  # Keras' BatchNormalization default
    expected_mean = (1 - momentum) * x.mean(axis=0)
    expected_variance = momentum + (1 - momentum) * sum(
        w * s.var(axis=0) for w, s in zip(weights, shards)
    )
    for k, model in enumerate(trainer.models):
        bn = model.layers[0]
        np.testing.assert_allclose(
            bn.moving_mean.numpy(), expected_mean, rtol=1e-12, err_msg=f"tower {k}"
        )
        np.testing.assert_allclose(
            bn.moving_variance.numpy(), expected_variance, rtol=1e-12, err_msg=f"tower {k}"
        )
    assert trainer.check_replicas() == 0.0


@pytest.mark.slow
def test_fit_reports_history_and_skips_a_last_batch_smaller_than_k():
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:4])
    x, y = data(41)  # batches of 8: five full ones and one of 1 < 4 towers
    history = trainer.fit(x, y, epochs=2, batch_size=8, verbose=0, validation_data=data(12, seed=1))
    assert trainer.step == 10
    assert history["epoch"] == [1, 2]
    assert set(history) == {
        "epoch",
        "loss",
        "accuracy",
        "images_per_sec",
        "val_loss",
        "val_accuracy",
    }
    assert all(0.0 <= a <= 1.0 for a in history["accuracy"] + history["val_accuracy"])
    assert all(rate > 0 for rate in history["images_per_sec"])
    fresh = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:4])
    fresh.fit(*data(45), epochs=1, batch_size=8, verbose=0)  # the last batch of 5 splits 2, 1, 1, 1
    assert fresh.step == 6


def test_fit_prints_one_line_per_epoch_off_a_terminal(capsys):
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2])
    x, y = data(16)
    for verbose in (1, 2):  # capsys's stdout is no terminal: 1 gives what 2 gives
        trainer.fit(x, y, epochs=trainer.step // 2 + 1, batch_size=8, verbose=verbose)
        out = capsys.readouterr().out
        assert "\r" not in out and "\x1b" not in out
        assert re.fullmatch(r"Epoch \d/\d - loss: [0-9.e-]+ - accuracy: [0-9.]+ - "
                            r"images_per_sec: \d+\n", out), out
    with pytest.raises(ValueError, match=r"fit: verbose must be 0 \(silent\), 1 \(a progress "
                                         r"bar\) or 2 \(one line per epoch\), got 3"):
        trainer.fit(x, y, epochs=5, batch_size=8, verbose=3)


def test_fit_on_a_dataset_of_global_batches_and_tensorboard_logs(tmp_path):
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2])
    x, y = data(40)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    history = trainer.fit(
        dataset, epochs=1, verbose=0, validation_data=dataset, logdir=str(tmp_path)
    )
    assert trainer.step == 5
    assert history["val_loss"][0] == pytest.approx(trainer.evaluate(x, y)["loss"], rel=1e-12)
    tags = set(scalars(tmp_path))
    assert {
        "train/loss",
        "train/accuracy",
        "train/learning_rate",
        "train/step_time_s",
        "epoch/loss",
        "epoch/accuracy",
        "epoch/images_per_sec",
        "epoch/val_loss",
        "epoch/val_accuracy",
    } <= tags


@pytest.mark.slow
def test_evaluate_and_predict_match_the_model_on_any_batch_split():
    trainer = ReplicatedTrainer(bn_mlp, LOSS, sgd, devices=CPU_DEVICES[:4])
    x, y = data(38, seed=3)
    trainer.train_step(x[:16], y[:16])
    # Batches of 7: the last holds 3 examples, so one tower gets none.
    results = trainer.evaluate(x, y, batch_size=7)
    logits = trainer.models[0](x, training=False).numpy()
    want_loss = np.mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
    assert results["loss"] == pytest.approx(want_loss, rel=1e-12)
    assert results["accuracy"] == pytest.approx(np.mean(logits.argmax(axis=1) == y))
    np.testing.assert_allclose(trainer.predict(x, batch_size=7), logits, rtol=1e-12)


def resumable_trainer():
    return ReplicatedTrainer(
        bn_mlp, LOSS, lambda: keras.optimizers.Adam(0.05), devices=CPU_DEVICES[:2]
    )


def full_state(trainer):
    return values(trainer.models[0].variables) + values(trainer.optimizers[0].variables)


def assert_same_state(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


@pytest.fixture(scope="module")
def uninterrupted():
    """State after 2 epochs of 5 shuffled steps, trained in one go."""
    trainer = resumable_trainer()
    x, y = data(40)
    initial = full_state(trainer)
    trainer.fit(x, y, epochs=2, batch_size=8, verbose=0)
    assert trainer.step == 10
    return initial, full_state(trainer)


def start_like(trainer, initial):
    for v, w in zip(
        list(trainer.models[0].variables) + list(trainer.optimizers[0].variables), initial
    ):
        v.assign(w)
    trainer.broadcast()


@pytest.mark.slow
def test_restore_continues_the_run_exactly(tmp_path, uninterrupted):
    initial, want = uninterrupted
    x, y = data(40)
    first = resumable_trainer()
    start_like(first, initial)
    first.fit(x, y, epochs=1, batch_size=8, verbose=0, checkpoint_dir=str(tmp_path))
    second = resumable_trainer()  # fresh weights, overwritten by the restore
    assert second.restore(str(tmp_path)) == str(tmp_path / "ckpt-1")
    assert second.step == 5
    assert second.check_replicas() == 0.0
    second.fit(x, y, epochs=2, batch_size=8, verbose=0)
    assert_same_state(full_state(second), want)


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_resumes_mid_epoch(tmp_path, uninterrupted):
    initial, want = uninterrupted
    x, y = data(40)
    trainer = resumable_trainer()
    start_like(trainer, initial)

    def interrupted_step(step, phase):
        if step == 7 and phase == "start":
            raise KeyboardInterrupt

    trainer.fault_hook = interrupted_step
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(x, y, epochs=2, batch_size=8, verbose=0, checkpoint_dir=str(tmp_path))
    # One checkpoint at the end of epoch 1, one at the interrupt.
    assert tf.train.latest_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt-2")
    resumed = resumable_trainer()
    resumed.restore(str(tmp_path))
    assert resumed.step == 7
    resumed.fit(x, y, epochs=2, batch_size=8, verbose=0)
    assert_same_state(full_state(resumed), want)


@pytest.mark.slow
def test_save_never_overwrites_and_restores_a_named_checkpoint(tmp_path):
    trainer = resumable_trainer()
    x, y = data(8)
    trainer.train_step(x, y)
    first = trainer.save(str(tmp_path))
    state_one = full_state(trainer)
    trainer.train_step(x, y)
    second = trainer.save(str(tmp_path))
    assert (os.path.basename(first), os.path.basename(second)) == ("ckpt-1", "ckpt-2")
    assert tf.train.latest_checkpoint(str(tmp_path)) == second
    assert not [name for name in os.listdir(tmp_path) if "tmp" in name or "temp" in name]
    trainer.restore(first)
    assert trainer.step == 1
    assert_same_state(full_state(trainer), state_one)
    assert trainer.check_replicas() == 0.0


# ---------------------------------------------------------------- errors


def test_unknown_algorithm():
    with pytest.raises(
        ValueError, match=r"unknown all-reduce algorithm 'butterfly'; choose one of \('auto', "
    ):
        ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], algorithm="butterfly")


def test_device_that_does_not_exist():
    with pytest.raises(
        ValueError, match=r"devices\[1\]='/cpu:42' does not exist in this process; available"
    ):
        ReplicatedTrainer(mlp, LOSS, sgd, devices=["/cpu:0", "/cpu:42"])


def test_repeated_device():
    with pytest.raises(ValueError, match=r"are the same device '/device:CPU:1'"):
        ReplicatedTrainer(mlp, LOSS, sgd, devices=["/cpu:1", "/device:CPU:1"])


def test_more_towers_than_examples():
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:4])
    x, y = data(3)
    with pytest.raises(ValueError, match="the global batch has 3 examples but there are 4 towers"):
        trainer.train_step(x, y)
    with pytest.raises(ValueError, match="batch_size=2 is smaller than the 4 towers"):
        trainer.fit(*data(10), batch_size=2)


def test_optimizer_instead_of_a_factory():
    with pytest.raises(
        TypeError, match="optimizer_fn must be a function that returns a new optimizer"
    ):
        ReplicatedTrainer(mlp, LOSS, keras.optimizers.SGD(0.1), devices=CPU_DEVICES[:2])


def test_model_fn_that_builds_different_models():
    widths = iter([4, 5])

    def model_fn():
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(next(widths))])

    with pytest.raises(
        ValueError, match=r"tower 1 variable '.*kernel' is float32\[5, 5\] but tower 0's"
    ):
        ReplicatedTrainer(model_fn, LOSS, sgd, devices=CPU_DEVICES[:2])


def test_loss_without_per_example_values():
    def mean_loss(y_true, y_pred):
        return tf.reduce_mean(
            keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
        )

    trainer = ReplicatedTrainer(mlp, mean_loss, sgd, devices=CPU_DEVICES[:2])
    with pytest.raises(ValueError, match="loss returned a single value for the whole shard"):
        trainer.train_step(*data(4))


def test_mismatched_inputs_and_missing_checkpoint(tmp_path):
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2])
    x, y = data(10)
    with pytest.raises(ValueError, match="train_step: x has 10 examples but y has 9"):
        trainer.train_step(x, y[:9])
    with pytest.raises(ValueError, match="fit: x has 10 examples but y has 9"):
        trainer.fit(x, y[:9])
    with pytest.raises(FileNotFoundError, match="restore: no checkpoint at"):
        trainer.restore(str(tmp_path))


def test_negative_bcast_period():
    with pytest.raises(ValueError, match=r"bcast_period must be an int >= 0 .* got -1"):
        ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], bcast_period=-1)


def test_a_fault_hook_is_a_function_or_none():
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2])
    with pytest.raises(TypeError, match=r"fault_hook must be None or a function \(step, "
                                        r"phase\), got int 3"):
        trainer.fault_hook = 3
    assert trainer.fault_hook is None
    calls = []
    trainer.fault_hook = lambda step, phase: calls.append((step, phase))
    x, y = data(8)
    trainer.train_step(x, y)
    trainer.train_step(x, y)
    assert calls == [(0, "start"), (1, "end"), (1, "start"), (2, "end")]


def test_cluster_argument(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2])  # cluster="auto"
    assert trainer.cluster is None and trainer.is_chief
    with pytest.raises(TypeError, match='cluster must be "auto", None or a tfreduce.Cluster'):
        ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], cluster="worker:0")
