"""Checkpoints that cannot lose the user's work: no NaN saves, damaged ones detected, no orphans."""

import gc
import logging
import os
import re
import signal

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import CPU_DEVICES
from tfreduce.trainer import ReplicatedTrainer
from tfreduce.trainer.signals import Terminated


def model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer="ones")])


def trainer(lr=0.01):
    return ReplicatedTrainer(model, "mse", lambda: keras.optimizers.SGD(lr),
                             devices=CPU_DEVICES[:2], cluster=None)


def data(count=16, scale=1.0):
    rng = np.random.default_rng(0)
    return (scale * rng.normal(size=(count, 4))).astype(np.float32), rng.normal(
        size=(count, 3)).astype(np.float32)


def kernel(t):
    return t.models[0].layers[-1].kernel.numpy()


@pytest.fixture
def three_checkpoints(tmp_path):
    """A trainer saved after steps 1, 2 and 3: (trainer, dir, kernels by step)."""
    t = trainer()
    x, y = data()
    kernels = {}
    for step in (1, 2, 3):
        t.train_step(x, y)
        t.save(str(tmp_path))
        kernels[step] = kernel(t)
    return t, str(tmp_path), kernels


def restored(path):
    t = trainer()
    t.train_step(*data())  # builds the models; the restore overwrites them
    prefix = t.restore(path)
    return t, prefix


@pytest.fixture
def tf_warnings():
    """The messages TensorFlow's logger emits while the test runs (a list, filled as they come)."""
    messages = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    tf.get_logger().addHandler(handler)
    yield messages
    tf.get_logger().removeHandler(handler)


def adam_trainer(num_towers, zero_stage, **kwargs):
    def make():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    return ReplicatedTrainer(make, "mse", lambda: keras.optimizers.Adam(0.01),
                             devices=CPU_DEVICES[:num_towers], cluster=None,
                             zero_stage=zero_stage, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed,accumulate_steps", [
    ((2, 0), (2, 0), 1), ((2, 1), (2, 1), 1), ((2, 2), (2, 2), 1), ((2, 1), (4, 0), 1),
    ((2, 0), (4, 0), 2)])
def test_a_restore_reports_no_lost_value_and_restores_the_optimizer_state(
        saved, resumed, accumulate_steps, tmp_path, tf_warnings, capsys):
    # Once, TensorFlow logged "Value in checkpoint could not be found in the
    # restored object: (root).optimizer_state" on every restore, though
    # tfreduce had read that state itself, exactly.
    x, y = data(8)
    y = y[:, :2]
    t = adam_trainer(*saved, accumulate_steps=accumulate_steps)
    for _ in range(2):
        t.train_step(x, y)
    t.save(str(tmp_path))
    u = adam_trainer(*resumed, accumulate_steps=accumulate_steps)
    u.train_step(x, y)
    u.restore(str(tmp_path))
    gc.collect()  # TensorFlow reports unrestored values when the restore's status is deleted
    assert [m for m in tf_warnings if "restore" in m] == []
    if saved == resumed:  # every tower's slots, bit for bit
        for a, b in zip(t.optimizers, u.optimizers):
            for v, w in zip(a.variables, b.variables):
                np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=v.path)
    assert (u.step, int(u.optimizers[-1].iterations.numpy())) == (2, 2 // accumulate_steps)
    # The towers' accumulated sums are per tower: at another K they restart,
    # and the restore says so (the cycle had ended: they were zero).
    restarts = "the towers' own state (accumulated gradients, PowerSGD's) restarts"
    assert (restarts in capsys.readouterr().err) == (accumulate_steps > 1)
    for _ in range(accumulate_steps):  # the same update: Adam's moments were restored
        t.train_step(x, y)
        u.train_step(x, y)
    for v, w in zip(t.models[0].trainable_variables, u.models[0].trainable_variables):
        np.testing.assert_allclose(v.numpy(), w.numpy(), rtol=1e-6, atol=1e-7)


def test_non_finite_weights_are_never_saved(three_checkpoints):
    t, path, _ = three_checkpoints
    before = sorted(os.listdir(path))
    t.models[0].layers[-1].kernel.assign(np.full((4, 3), np.nan, np.float32))
    with pytest.raises(FloatingPointError, match=re.escape(
            f"holds NaN or Inf values, so no checkpoint is written and the ones in {path!r} "
            f"stay")):
        t.save(path)
    assert sorted(os.listdir(path)) == before
    assert tf.train.latest_checkpoint(path).endswith("ckpt-3")


def test_a_diverging_fit_stops_before_its_checkpoints_are_rotated_out(tmp_path):
    t = trainer(lr=1e6)  # SGD at this rate overflows to Inf, then NaN
    x, y = data(scale=1e3)
    with pytest.raises(FloatingPointError):
        t.fit(x, y, epochs=20, batch_size=4, verbose=0, checkpoint_dir=str(tmp_path))
    prefix = tf.train.latest_checkpoint(str(tmp_path))
    if prefix is not None:  # every checkpoint written is finite
        reader = tf.train.load_checkpoint(prefix)
        for name in reader.get_variable_to_shape_map():
            value = reader.get_tensor(name)
            if np.issubdtype(np.asarray(value).dtype, np.floating):
                assert np.isfinite(value).all(), name


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "shard missing", "index names nothing"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact(
        three_checkpoints, damage, capsys):
    _, path, kernels = three_checkpoints
    data_file = os.path.join(path, "ckpt-3.data-00000-of-00001")
    if damage == "truncated":
        with open(data_file, "r+b") as f:
            f.truncate(os.path.getsize(data_file) // 2)
    elif damage == "shard missing":
        os.remove(data_file)
    else:
        with open(os.path.join(path, "checkpoint"), "w") as f:
            f.write('model_checkpoint_path: "ckpt-9"\nall_model_checkpoint_paths: "ckpt-9"\n')
    t, prefix = restored(path)
    if damage == "index names nothing":
        # The index names a checkpoint that does not exist: the files count.
        assert prefix.endswith("ckpt-3") and t.step == 3
        np.testing.assert_array_equal(kernel(t), kernels[3])
        return
    assert prefix.endswith("ckpt-2") and t.step == 2
    np.testing.assert_array_equal(kernel(t), kernels[2])
    assert re.search(r"restore: .*ckpt-3 is damaged \(.+\); using .*ckpt-2",
                     capsys.readouterr().err)


@pytest.mark.slow
def test_every_checkpoint_damaged_is_an_error_naming_each(three_checkpoints):
    _, path, _ = three_checkpoints
    for n in (1, 2, 3):
        os.remove(os.path.join(path, f"ckpt-{n}.data-00000-of-00001"))
    with pytest.raises(ValueError, match=r"restore: no intact checkpoint at .*: .*ckpt-3 is "
                                         r"damaged .*ckpt-2 is damaged .*ckpt-1 is damaged"):
        restored(path)


@pytest.mark.slow
def test_a_damaged_named_checkpoint_is_an_error(three_checkpoints):
    _, path, _ = three_checkpoints
    prefix = os.path.join(path, "ckpt-2")
    with open(prefix + ".data-00000-of-00001", "r+b") as f:
        f.truncate(3)
    with pytest.raises(ValueError, match=re.escape(f"{prefix} is damaged")):
        restored(prefix)


@pytest.mark.parametrize("layer, what", [
    (keras.layers.Dense(5, kernel_initializer="ones"), "incompatible tensor with shape (4, 3)"),
    (keras.layers.Dense(3, dtype="float64"), "expected dtype double does not equal original "
                                             "dtype float"),
])
def test_a_checkpoint_of_another_model_is_a_value_error_saying_so(three_checkpoints, layer,
                                                                   what):
    # Once a bare TensorFlow ValueError or InvalidArgumentError.
    _, path, _ = three_checkpoints
    other = ReplicatedTrainer(lambda: keras.Sequential([keras.Input((4,)), layer.from_config(
        layer.get_config())]), "mse", lambda: keras.optimizers.SGD(0.01),
        devices=CPU_DEVICES[:2], cluster=None)
    with pytest.raises(ValueError) as info:
        other.restore(path)
    assert str(info.value).startswith(
        f"restore: checkpoint {os.path.join(path, 'ckpt-3')!r} does not match this trainer's "
        f"model: ")
    assert what in str(info.value)


def test_orphans_of_a_killed_save_are_removed_by_the_next(three_checkpoints):
    t, path, _ = three_checkpoints
    orphan = os.path.join(path, "ckpt-4_temp")
    os.makedirs(orphan)
    with open(os.path.join(orphan, "part-00000-of-00001.data-00000-of-00001"), "wb") as f:
        f.write(b"half")
    assert t.save(path).endswith("ckpt-4")
    assert not os.path.exists(orphan)
    assert sorted(n for n in os.listdir(path) if n.endswith(".index")) == [
        "ckpt-2.index", "ckpt-3.index", "ckpt-4.index"]


def sigterm_after_epoch(epoch_to_signal):
    def callback(epoch, logs):
        if epoch == epoch_to_signal:
            os.kill(os.getpid(), signal.SIGTERM)
    return callback


def test_sigterm_stops_after_the_next_step_with_one_checkpoint(tmp_path):
    t = trainer()
    x, y = data(16)
    with pytest.raises(Terminated) as stopped:
        t.fit(x, y, epochs=3, batch_size=4, verbose=0, checkpoint_dir=str(tmp_path),
              callbacks=[sigterm_after_epoch(1)])
    # Epoch 1 (4 steps) ends, the signal comes in its callback, the first
    # step of epoch 2 completes, then the run stops with its checkpoint.
    assert stopped.value.signum == signal.SIGTERM and t.step == 5
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-2")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored


def test_a_sigterm_after_the_last_step_still_stops_without_a_second_save(tmp_path):
    t = trainer()
    x, y = data(16)
    with pytest.raises(Terminated):
        t.fit(x, y, epochs=2, batch_size=4, verbose=0, checkpoint_dir=str(tmp_path),
              callbacks=[sigterm_after_epoch(2)])
    assert t.step == 8
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".index")) == [
        "ckpt-1.index", "ckpt-2.index"]
