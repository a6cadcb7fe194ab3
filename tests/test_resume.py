"""A run killed or stopped at any point and resumed ends exactly where an uninterrupted one ends.

The image-classification example runs in subprocesses on 2 logical CPU
devices: once straight through, once killed with SIGKILL after its first
checkpoint and resumed, once stopped with SIGTERM mid-epoch and resumed.
Every tensor of the final checkpoints, and the per-epoch losses, must be
equal bit for bit.
"""

import json
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import zygote
from helpers import EXAMPLE

# Each test trains the example in subprocesses, killed and resumed.
pytestmark = pytest.mark.slow

ARGS = ["--devices", "2", "--limit", "256", "--batch-size", "32", "--epochs", "12", "--quiet"]


def command(logdir, *extra):
    return [sys.executable, EXAMPLE, *ARGS, "--logdir", str(logdir), *extra]


def run(logdir, *extra):
    done = zygote.run(command(logdir, *extra), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def start_and_signal(logdir, signum, after_steps_of_epoch_2):
    """Runs the example, signalled once its first checkpoint exists and a little more passed."""
    first = logdir / "checkpoints" / "ckpt-1.index"
    saved, finished = [], threading.Event()

    def signal_once_saved(pid):
        deadline = time.monotonic() + 240
        while not first.exists() and time.monotonic() < deadline and not finished.is_set():
            time.sleep(0.05)
        saved.append(first.exists())
        time.sleep(after_steps_of_epoch_2 if saved[0] else 0)
        if not finished.is_set():  # else its pid may be another process's by now
            os.kill(pid, signum)

    try:
        done = zygote.run(command(logdir), timeout=360, started=signal_once_saved)
    finally:
        finished.set()
    assert saved == [True], "no first checkpoint"
    return done.returncode, done.stdout, done.stderr


def final_state(logdir):
    prefix = tf.train.latest_checkpoint(str(logdir / "checkpoints"))
    reader = tf.train.load_checkpoint(prefix)
    names = sorted(n for n in reader.get_variable_to_shape_map() if "save_counter" not in n)
    return {n: reader.get_tensor(n) for n in names}


def losses(logdir):
    with open(logdir / "history.json") as f:
        return [(h["epoch"], h["loss"], h["val_loss"]) for h in json.load(f)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("straight")
    run(logdir)
    return final_state(logdir), losses(logdir)


def assert_same_run(logdir, straight):
    want_state, want_losses = straight
    got = final_state(logdir)
    assert sorted(got) == sorted(want_state)
    for name, value in want_state.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert losses(logdir) == want_losses


def test_sigkill_then_resume_is_exact(tmp_path, straight):
    logdir = tmp_path / "killed"
    code, _, _ = start_and_signal(logdir, signal.SIGKILL, 0.3)
    assert code == -signal.SIGKILL
    resumed = run(logdir, "--resume")
    assert "resumed from" in resumed.stdout
    assert_same_run(logdir, straight)


def test_sigterm_writes_a_checkpoint_and_exits_143_then_resumes_exactly(tmp_path, straight):
    logdir = tmp_path / "terminated"
    code, _, err = start_and_signal(logdir, signal.SIGTERM, 0.2)
    assert code == 143, err[-3000:]
    assert "stopped by SIGTERM at step" in err and "checkpoint written to" in err
    assert f"terminated; continue with --resume --logdir {logdir} --epochs 12" in err
    run(logdir, "--resume")
    assert_same_run(logdir, straight)
