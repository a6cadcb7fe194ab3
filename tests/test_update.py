"""The trainer's update: gradient accumulation, PowerSGD, the non-finite guard, mixed precision."""

import re

import keras
import numpy as np
import pytest

import tfreduce
from helpers import CPU_DEVICES
from test_trainer import LOSS, bn_mlp, data, mlp, sgd, single_device_run, values
from tfreduce.workers.localcluster import LocalCluster
from tfreduce.trainer import ReplicatedTrainer
from tfreduce.trainer.update import nonfinite_error


def adam():
    return keras.optimizers.Adam(0.01)


# ---------------------------------------------------------------- accumulation


@pytest.mark.slow
@pytest.mark.parametrize("optimizer_fn", [sgd, adam], ids=["sgd", "adam"])
@pytest.mark.parametrize("regularizer", [None, "l2"])
def test_accumulated_micro_batches_train_like_their_concatenation(optimizer_fn, regularizer):
    def model():
        return mlp(regularizer)

    trainer = ReplicatedTrainer(model, LOSS, optimizer_fn, devices=CPU_DEVICES[:2],
                                accumulate_steps=3)
    initial = values(trainer.models[0].trainable_variables)
    sizes = [8, 8, 6, 8, 5, 8]  # two updates of 3 micro-batches, uneven ones included
    x, y = data(sum(sizes))
    ends = np.cumsum(sizes)
    micro = [(x[end - size:end], y[end - size:end]) for size, end in zip(sizes, ends)]
    for xb, yb in micro:
        trainer.train_step(xb, yb)
    global_batches = [(np.concatenate([b[0] for b in micro[i:i + 3]]),
                       np.concatenate([b[1] for b in micro[i:i + 3]])) for i in (0, 3)]
    expected = single_device_run(model, optimizer_fn, initial, global_batches)
    for k, m in enumerate(trainer.models):
        for got, want in zip(values(m.trainable_variables), expected):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"tower {k}")
    assert trainer.step == 6
    assert int(trainer.optimizers[0].iterations.numpy()) == 2  # two updates
    assert trainer.check_replicas() == 0.0


def test_a_step_between_updates_has_no_cross_device_reduction():
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], algorithm="flat",
                                accumulate_steps=2)
    x, y = data(16)
    before = values(trainer.models[0].trainable_variables)
    trainer.train_step(x, y)
    # Nothing applied between updates.
    for got, want in zip(values(trainer.models[1].trainable_variables), before):
        np.testing.assert_array_equal(got, want)
    trainer.train_step(x, y)
    graphs = {update: trainer.step_graphs()["train" if update else "accumulate"]
              for update in (True, False)}
    traffic = {update: tfreduce.analyze_traffic(graph) for update, graph in graphs.items()}
    gradient_bytes = sum(int(np.prod(v.shape)) * 8 for v in trainer.models[0].trainable_variables)
    one_to_zero = ("/device:CPU:1", "/device:CPU:0")
    # Between updates tower 1 sends the host only its scalars (loss sum,
    # correct count); an update sends its gradients to the flat root too.
    assert traffic[False].pair_bytes.get(one_to_zero, 0) < 64
    assert traffic[True].pair_bytes[one_to_zero] >= gradient_bytes
    assert not [op.name for op in graphs[False].get_operations() if "allreduce" in op.name]
    assert [op.name for op in graphs[True].get_operations() if "allreduce" in op.name]


def test_batchnorm_statistics_stay_equal_between_updates():
    trainer = ReplicatedTrainer(bn_mlp, LOSS, sgd, devices=CPU_DEVICES[:2], accumulate_steps=3)
    x, y = data(16)
    x[8:] += 3.0  # tower 1's shard has other statistics than tower 0's
    trainer.train_step(x, y)  # no update: the moving statistics are averaged all the same
    assert trainer.check_replicas() == 0.0
    moving = trainer.models[0].layers[0].moving_mean.numpy()
    assert not np.allclose(moving, 0.0)


@pytest.mark.slow
def test_accumulation_state_is_checkpointed_and_restored(tmp_path):
    x, y = data(24)

    def trainer():
        return ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], accumulate_steps=3)

    first, second = trainer(), trainer()
    first.train_step(x[:8], y[:8])
    first.train_step(x[8:16], y[8:16])  # mid-cycle: two micro-batches summed
    first.save(str(tmp_path))
    second.train_step(x[:8], y[:8])  # builds; the restore overwrites everything
    second.restore(str(tmp_path))
    for t in (first, second):
        t.train_step(x[16:], y[16:])  # the update
    for a, b in zip(first.models[1].trainable_variables, second.models[1].trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_a_restore_that_fails_leaves_the_accumulated_gradients(tmp_path):
    x, y = data(16)
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], accumulate_steps=3)
    trainer.train_step(x[:8], y[:8])  # mid-cycle: one micro-batch summed
    sums = [[v.numpy() for v in kinds["accumulation"]] for kinds in trainer.state_variables()]
    assert any(np.any(s) for row in sums for s in row)
    with pytest.raises(FileNotFoundError):
        trainer.restore(str(tmp_path / "nothing"))
    after = [[v.numpy() for v in kinds["accumulation"]] for kinds in trainer.state_variables()]
    for row, kept in zip(sums, after):
        for s, k in zip(row, kept):
            np.testing.assert_array_equal(s, k)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"accumulate_steps": 0}, ValueError,
     "accumulate_steps must be >= 1 (1: an update every step), got 0"),
    ({"accumulate_steps": 2.0}, TypeError, "accumulate_steps must be an int >= 1, got 2.0"),
    ({"on_nonfinite": "ignore"}, ValueError,
     "on_nonfinite must be 'raise' or 'skip', got 'ignore'"),
    ({"compression": tfreduce.PowerSGD}, TypeError,
     "compression=tfreduce.PowerSGD needs an instance: PowerSGD(rank=2)"),
])
def test_bad_update_options(kwargs, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], **kwargs)


# -------------------------------------------------------------------- PowerSGD


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["flat", "ring"])
def test_powersgd_at_full_rank_trains_like_no_compression(algorithm):
    x, y = data(80)
    runs = []
    for compression in (None, tfreduce.PowerSGD(rank=10, min_compression_rate=0)):
        options = {"compression": compression} if compression else {}
        trainer = ReplicatedTrainer(mlp, LOSS, adam, devices=CPU_DEVICES[:2],
                                    algorithm=algorithm, **options)
        if runs:
            for v, w in zip(trainer.models[0].trainable_variables, runs[0][1]):
                v.assign(w)
            trainer.broadcast()
        start = values(trainer.models[0].trainable_variables)
        for i in range(0, 80, 16):
            trainer.train_step(x[i:i + 16], y[i:i + 16])
        runs.append((values(trainer.models[1].trainable_variables), start))
        assert trainer.check_replicas() == 0.0
    for got, want in zip(runs[1][0], runs[0][0]):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


@pytest.mark.slow
def test_powersgd_state_is_per_tower_and_checkpointed(tmp_path):
    x, y = data(32)

    def trainer():
        return ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2],
                                 compression=tfreduce.PowerSGD(rank=1, min_compression_rate=0))

    first = trainer()
    first.train_step(x[:16], y[:16])
    # Each tower's Q and error feedback of the first variable.
    state = [kinds["compression"][:2] for kinds in first.state_variables()]
    # Error feedback differs per tower; Q is shared.
    assert not np.array_equal(state[0][1].numpy(), state[1][1].numpy())
    np.testing.assert_array_equal(state[0][0].numpy(), state[1][0].numpy())
    first.save(str(tmp_path))
    second = trainer()
    second.train_step(x[16:], y[16:])
    second.restore(str(tmp_path))
    restored = [kinds["compression"][:2] for kinds in second.state_variables()]
    for k in range(2):
        np.testing.assert_array_equal(restored[k][1].numpy(), state[k][1].numpy())
    for t in (first, second):
        t.train_step(x[16:], y[16:])
    for a, b in zip(first.models[1].trainable_variables, second.models[1].trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# ------------------------------------------------------------- non-finite guard


def poisoned(x, row):
    bad = np.array(x, copy=True)
    bad[row] = np.nan
    return bad


def test_nan_on_one_tower_raises_naming_step_tower_and_variable(tmp_path):
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2])
    x, y = data(16)
    trainer.fit(x, y, epochs=1, batch_size=16, verbose=0, checkpoint_dir=str(tmp_path))
    before = values(trainer.models[0].trainable_variables)
    # Examples 8..15 are tower 1's shard.
    with pytest.raises(FloatingPointError, match=(
            r"^step 2: tower 1 \(/device:CPU:1\) computed NaN or Inf in the gradient of "
            r"variable '.*dense.*/kernel' \(and \d more\); no update was applied and the "
            r"checkpoints stay as they were; lower the learning rate, or pass "
            r"on_nonfinite='skip' to skip such steps$")):
        trainer.fit(poisoned(x, 12), y, epochs=2, batch_size=16, verbose=0,
                    checkpoint_dir=str(tmp_path))
    assert trainer.step == 1
    for k in range(2):
        for got, want in zip(values(trainer.models[k].trainable_variables), before):
            np.testing.assert_array_equal(got, want)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".index") == ["ckpt-1.index"]


def test_skip_leaves_every_replica_unchanged_and_counts_it():
    trainer = ReplicatedTrainer(mlp, LOSS, adam, devices=CPU_DEVICES[:2], on_nonfinite="skip")
    x, y = data(48)
    trainer.train_step(x[:16], y[:16])
    before = [values(m.variables) for m in trainer.models]
    optimizer_before = values(trainer.optimizers[1].variables)
    trainer.train_step(poisoned(x[16:32], 3), y[16:32])  # tower 0's shard
    assert trainer.skipped_steps == 1
    assert trainer.step == 2
    for k, m in enumerate(trainer.models):
        for got, want in zip(values(m.variables), before[k]):
            np.testing.assert_array_equal(got, want)
    for got, want in zip(values(trainer.optimizers[1].variables), optimizer_before):
        np.testing.assert_array_equal(got, want)  # iterations and moments too
    trainer.train_step(x[32:], y[32:])
    assert trainer.check_replicas() == 0.0
    history = trainer.fit(poisoned(x, 0), y, epochs=4, batch_size=16, shuffle=False, verbose=0)
    # Epochs 2 to 4 (3 steps were one epoch); each one's first batch holds the NaN.
    assert history["skipped_steps"] == [1, 1, 1]
    assert trainer.skipped_steps == 4
    assert trainer.check_replicas() == 0.0


def test_overflow_of_the_sum_alone_is_named():
    towers = type("Towers", (), {
        "devices": ["/device:CPU:0", "/device:CPU:1"],
        "trainable": [[type("V", (), {"path": "dense/kernel"})(),
                       type("V", (), {"path": "dense/bias"})()]]})
    report = np.array([[0, 0], [0, 0], [0, 1]])
    error = nonfinite_error(report, 7, towers, LocalCluster(), tfreduce.Compression.fp16)
    assert str(error).startswith(
        "step 7: the all-reduced gradient of variable 'dense/bias' is NaN or Inf (every "
        "tower's gradient is finite: the sum overflowed; compression='fp16' crosses devices "
        "in float16, at most 65504)")


# ------------------------------------------------------------- mixed precision


def small_classifier():
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(3, dtype="float32")])


@pytest.mark.slow
def test_mixed_float16_scales_the_loss_identically_on_every_tower(mixed_float16):
    trainer = ReplicatedTrainer(small_classifier, LOSS, adam, devices=CPU_DEVICES[:2])
    assert all(isinstance(o, keras.optimizers.LossScaleOptimizer) for o in trainer.optimizers)
    x, y = data(256)
    x = x.astype(np.float32)
    history = trainer.fit(x, y, epochs=3, batch_size=32, verbose=0)
    assert history["loss"][-1] < history["loss"][0]
    scales = [float(o.dynamic_scale.numpy()) for o in trainer.optimizers]
    assert scales[0] == scales[1]
    assert trainer.check_replicas() == 0.0
    assert trainer.models[0].layers[0].compute_dtype == "float16"
    # Gradients that overflow float16 at this scale are the scaler's signal:
    # it skips the step and halves the scale, on every tower alike.
    before = values(trainer.models[1].variables)
    skipped = trainer.skipped_steps
    trainer.train_step(x[:32] * 1e3, y[:32])
    assert trainer.skipped_steps == skipped + 1
    assert [float(o.dynamic_scale.numpy()) for o in trainer.optimizers] == [scales[0] / 2] * 2
    for got, want in zip(values(trainer.models[1].variables), before):
        np.testing.assert_array_equal(got, want)
    assert trainer.check_replicas() == 0.0
