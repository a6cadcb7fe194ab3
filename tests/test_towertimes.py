"""A tower the others wait for is named, in the log and in TensorBoard; a clean run is not.

The slow tower waits on a queue that a Python thread answers 50 ms after
each request: like a GPU that takes longer, it holds no thread of the
executor while it waits (a sleep inside a py_function would hold one, and
slow every tower of the process alike).
"""

import re
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import scalars
from tfreduce.trainer import ReplicatedTrainer
from tfreduce.trainer.towertimes import TowerTimes
from tfreduce.workers.stragglers import lagging, median_ms

DEVICES = [f"/device:CPU:{k}" for k in range(4)]


def test_lagging_names_the_member_the_others_wait_for_either_way():
    # A tower takes more time; a worker slowed outside its steps takes less inside them.
    assert lagging({0: 5.0, 1: 60.0, 2: 6.0, 3: 4.0}, "higher") == [(1, 60.0, 5.0, 55.0)]
    assert lagging({0: 55.0, 1: 54.0, 2: 4.0, 3: 56.0}, "lower") == [(2, 4.0, 55.0, 51.0)]
    # The others' median, also of an even number of others (three towers).
    assert lagging({0: 5.0, 1: 40.0, 2: 30.0}, "higher") == [(1, 40.0, 17.5, 22.5)]
    assert lagging({0: 10.0, 1: 40.0, 2: 100.0}, "lower") == [(0, 10.0, 70.0, 60.0)]
    # Under 20 ms, or under half of the others' median, is jitter.
    assert lagging({0: 5.0, 1: 24.0}, "higher") == []
    assert lagging({0: 100.0, 1: 140.0}, "higher") == []
    with pytest.raises(ValueError, match="slower must be 'higher' or 'lower', got 'up'"):
        lagging({0: 1.0}, "up")


def test_one_long_pause_is_not_a_lag_but_a_slow_majority_is():
    assert median_ms([0.005] * 19) is None  # the window is not full
    assert median_ms([0.005] * 19 + [2.0]) == pytest.approx(5.0)
    assert median_ms([0.005] * 9 + [0.060] * 11) == pytest.approx(60.0)


def test_tower_times_report_a_lagging_tower_once_per_500_steps(capfd):
    times = TowerTimes(DEVICES, "worker 1 (127.0.0.1:5)")
    for step in range(1, 20):
        times.add(step, [0.005, 0.060, 0.006, 0.004])
    assert times.reported == [] and times.medians() is None
    times.add(20, [0.005, 0.060, 0.006, 0.004])
    line = ("tower 1 (/device:CPU:1) of worker 1 (127.0.0.1:5) lags: the other towers wait about "
            "55 ms per step for its gradients (its forward and backward take 60 ms, theirs "
            "5 ms, over the last 20 steps)")
    assert times.reported == [line]
    assert f"tfreduce: at step 20: {line}\n" in capfd.readouterr().err
    for step in range(21, 520):
        times.add(step, [0.005, 0.060, 0.006, 0.004])
    assert len(times.reported) == 1
    times.add(520, [0.005, 0.060, 0.006, 0.004])
    assert len(times.reported) == 2
    with pytest.raises(ValueError, match="TowerTimes.add: 3 times for 4 towers"):
        times.add(521, [0.1, 0.1, 0.1])


@pytest.mark.parametrize("onset", range(101, 111))
def test_a_tower_that_becomes_slow_is_named_within_20_steps(onset):
    times = TowerTimes(DEVICES)
    for step in range(1, 151):
        times.add(step, [0.005, 0.060 if step >= onset else 0.005, 0.006, 0.004])
        if times.reported:
            break
    # It holds the window's median about 10 steps after its onset; the
    # window is looked at every 10 steps.
    assert onset + 9 <= step <= onset + 19
    assert times.reported[0].startswith("tower 1 (/device:CPU:1) of this process lags")


class _Answered(keras.layers.Layer):
    """Passes x on after a request to `ask` is answered on `answer` (tower 1's slowness)."""

    def __init__(self, ask, answer, **kwargs):
        super().__init__(**kwargs)
        self.ask, self.answer = ask, answer

    def call(self, x):
        with tf.control_dependencies([self.ask.enqueue(tf.reduce_mean(x))]):
            return x + 0.0 * self.answer.dequeue()


def _slow_tower_trainer(delay):
    """A trainer on 4 towers whose tower 1 waits `delay` s in its forward pass, and the stop."""
    ask = tf.queue.FIFOQueue(100, tf.float32, shapes=[])
    answer = tf.queue.FIFOQueue(100, tf.float32, shapes=[])
    done = threading.Event()

    def serve():
        while not done.is_set():
            try:
                ask.dequeue()
            except (tf.errors.CancelledError, tf.errors.OutOfRangeError):  # closed by stop()
                return
            time.sleep(delay)
            answer.enqueue(0.0)

    built = []

    def model_fn():  # a model without an Input, built on its first batch
        layers = [keras.layers.Dense(8, activation="relu")]
        if len(built) == 1:
            layers.append(_Answered(ask, answer))
        built.append(True)
        return keras.Sequential(layers + [keras.layers.Dense(1)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def stop():
        done.set()
        ask.close(cancel_pending_enqueues=True)

    trainer = ReplicatedTrainer(model_fn, "mse", lambda: keras.optimizers.SGD(0.01),
                                devices=DEVICES)
    return trainer, stop


@pytest.mark.slow
def test_a_tower_slower_by_50_ms_is_named_within_20_steps_and_drawn(tmp_path, capfd):
    trainer, stop = _slow_tower_trainer(0.05)
    x = np.random.RandomState(0).rand(30 * 16, 4).astype("float32")
    try:
        trainer.fit(x, x.sum(axis=1, keepdims=True), batch_size=16, shuffle=False, verbose=0,
                    logdir=str(tmp_path))
    finally:
        stop()
    err = capfd.readouterr().err
    found = [line for line in err.splitlines() if "lags" in line]
    assert len(found) == 1, err[-3000:]
    step, ms = map(int, re.search(
        r"^tfreduce: at step (\d+): tower 1 \(/device:CPU:1\) of this process lags: the other "
        r"towers wait about "
        r"(\d+) ms per step for its gradients", found[0]).groups())
    assert step == 20 and ms >= 45
    values = scalars(tmp_path, "towers/")
    assert sorted(values) == [f"towers/ms_to_gradients/tower_{k}" for k in range(4)]
    # From step 20 on: tower 1's median over the last 20 steps, against the others'.
    assert all(len(series) == 11 for series in values.values())
    slow = values["towers/ms_to_gradients/tower_1"]
    others = [v for k in (0, 2, 3) for v in values[f"towers/ms_to_gradients/tower_{k}"]]
    assert min(slow) >= 45 and min(slow) > max(others) + 20


@pytest.mark.slow
def test_a_clean_run_of_1000_steps_names_no_tower(capfd):
    trainer = ReplicatedTrainer(
        lambda: keras.Sequential([keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)]),
        "mse", lambda: keras.optimizers.SGD(0.01), devices=DEVICES)
    x = np.random.RandomState(0).rand(16, 4).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    for _ in range(1000):
        trainer.train_step(x, y)
    assert "lags" not in capfd.readouterr().err
