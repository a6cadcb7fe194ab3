"""The image-classification example's command line, on tiny runs."""

import json
import os
import re
import sys

import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits

import tfreduce
import zygote
from helpers import EXAMPLE, NUM_CPUS, load_script



@pytest.fixture(scope="module")
def example():
    return load_script(EXAMPLE, "image_classification")


@pytest.mark.slow
def test_digits_run_then_resume(example, tmp_path, capsys):
    logdir = str(tmp_path / "run")
    common = [
        "--devices",
        "2",
        "--limit",
        "320",
        "--batch-size",
        "32",
        "--logdir",
        logdir,
        "--quiet",
    ]
    assert example.main(common + ["--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert "digits: 320 train / 360 test images, 10 classes, input (8, 8, 1)" in out
    auto = tfreduce.choose_algorithm(["/device:CPU:0", "/device:CPU:1"])
    assert (
        f"2 devices ['/device:CPU:0', '/device:CPU:1'], all-reduce auto -> {auto}, global batch 32"
        in out
    )
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", out).group(1))
    # One epoch of ten steps is far from done, but well above chance (0.1).
    assert 0.3 < accuracy <= 1.0
    assert re.search(r"training images/s: \d+ \(mean over 1 epoch\)", out)
    assert tf.train.latest_checkpoint(os.path.join(logdir, "checkpoints")).endswith("ckpt-1")
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(logdir))
    with open(os.path.join(logdir, "curves.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    assert example.main(common + ["--epochs", "2", "--resume", "--algorithm", "hierarchical"]) == 0
    out = capsys.readouterr().out
    assert "at step 10" in out
    with open(os.path.join(logdir, "history.json")) as f:
        history = json.load(f)
    assert [h["epoch"] for h in history] == [1, 2]
    assert history[1]["val_accuracy"] > 0.3


@pytest.mark.slow
def test_mnist_subset_tiny_run(example, tmp_path, capsys):
    argv = [
        "--dataset",
        "mnist",
        "--devices",
        "4",
        "--limit",
        "64",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--algorithm",
        "collective",
        "--logdir",
        str(tmp_path),
        "--quiet",
    ]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    assert "mnist: 64 train / 1000 test images, 10 classes, input (28, 28, 1)" in out
    assert 0.0 <= float(re.search(r"test accuracy: ([0-9.]+)", out).group(1)) <= 1.0


def write_image_folder(root, per_class=6):
    """Digits 0-2 from scikit-learn as 8x8 PNGs, one sub-folder per class."""
    digits = load_digits()
    for label in range(3):
        os.makedirs(os.path.join(root, f"class{label}"))
        images = digits.images[digits.target == label][:per_class]
        for i, image in enumerate(images):
            pixels = tf.constant((image * 255 / 16).astype(np.uint8)[..., None])
            tf.io.write_file(
                os.path.join(root, f"class{label}", f"{i}.png"), tf.io.encode_png(pixels)
            )


@pytest.mark.slow
def test_image_folder_dataset(example, tmp_path, capsys):
    folder = str(tmp_path / "images")
    write_image_folder(folder)
    argv = [
        "--dataset",
        folder,
        "--image-size",
        "8",
        "--devices",
        "2",
        "--epochs",
        "1",
        "--batch-size",
        "4",
        "--logdir",
        str(tmp_path / "run"),
        "--quiet",
    ]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    assert "images from a folder, 3 classes, input (8, 8, 3)" in out
    assert 0.0 <= float(re.search(r"test accuracy: ([0-9.]+)", out).group(1)) <= 1.0


def test_missing_dataset_folder(example, tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"--dataset '.*nowhere': no such folder"):
        example.check_image_folder(missing)
    with pytest.raises(SystemExit) as exit_info:
        example.main(["--dataset", missing, "--logdir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert "no such folder (nor 'digits' or 'mnist')" in capsys.readouterr().err


def test_dataset_folder_without_images(example, tmp_path, capsys):
    os.makedirs(tmp_path / "images" / "cats")
    (tmp_path / "images" / "cats" / "notes.txt").write_text("not an image")
    with pytest.raises(SystemExit):
        example.main(["--dataset", str(tmp_path / "images"), "--logdir", str(tmp_path / "run")])
    assert re.search(
        r"no images found; expected one sub-folder per class .* \(found sub-folders: \['cats'\]\)",
        capsys.readouterr().err,
    )


def test_more_devices_than_exist(example, tmp_path, capsys):
    with pytest.raises(SystemExit):
        example.main(["--devices", str(NUM_CPUS + 1), "--logdir", str(tmp_path)])
    assert (
        f"--devices {NUM_CPUS + 1}: only {NUM_CPUS} logical CPU devices exist"
        in capsys.readouterr().err
    )


def test_bad_arguments(example, tmp_path, capsys):
    with pytest.raises(SystemExit):
        example.main(["--algorithm", "butterfly", "--logdir", str(tmp_path)])
    assert "argument --algorithm: invalid choice: 'butterfly'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        example.main(["--devices", "4", "--batch-size", "2", "--logdir", str(tmp_path)])
    assert "--batch-size 2 is smaller than --devices 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        example.main(["--resume", "--logdir", str(tmp_path / "empty")])
    assert "--resume: no checkpoint in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        example.main(["--trainer", "keras", "--jit-compile", "--logdir", str(tmp_path)])
    assert "--jit-compile needs --trainer replicated, got --trainer keras" in (
        capsys.readouterr().err)


@pytest.mark.slow
def test_two_workers_under_the_launcher(tmp_path):
    """Two worker processes on 127.0.0.1: the same results, one writer."""
    logdir = tmp_path / "run"
    command = [
        sys.executable, "-m", "tfreduce.launch", "--workers", "2", "--timeout", "150",
        "--preload", "tensorflow", "--", sys.executable, EXAMPLE, "--devices", "2", "--epochs", "1", "--limit", "200",
        "--logdir", str(logdir), "--quiet",
    ]
    # The launcher stops its workers at --timeout; this bounds the launcher.
    run = zygote.run(command, timeout=200)
    assert run.returncode == 0, run.stderr[-3000:]
    accuracy = [
        re.search(rf"\[worker {r}\] test accuracy: ([0-9.]+)", run.stdout).group(1)
        for r in range(2)
    ]
    assert accuracy[0] == accuracy[1], run.stdout
    assert "[worker 1] worker 1 of 2 (4 towers in all); worker 0 writes logs" in run.stdout
    assert "[worker 1] TensorBoard logs" not in run.stdout
    # One writer: one event file and checkpoint 1 only (two would make ckpt-2).
    names = sorted(os.listdir(logdir))
    assert sum(n.startswith("events.out") for n in names) == 1, names
    assert sorted(os.listdir(logdir / "checkpoints")) == [
        "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index",
    ]
    with open(logdir / "history.json") as f:
        assert [h["epoch"] for h in json.load(f)] == [1]


@pytest.mark.slow
def test_keras_trainer_fits_through_tfreduce_cross_device_ops(example, tmp_path, capsys):
    logdir = tmp_path / "run"
    common = ["--trainer", "keras", "--devices", "2", "--limit", "128", "--batch-size", "32",
              "--algorithm", "ring", "--logdir", str(logdir), "--quiet"]
    assert example.main(common + ["--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert ("2 devices ['/device:CPU:0', '/device:CPU:1'], Keras model.fit with "
            "tfreduce.CrossDeviceOps('ring'): all-reduce ring, global batch 32") in out
    assert 0.2 < float(re.search(r"test accuracy: ([0-9.]+)", out).group(1)) <= 1.0
    with open(logdir / "history.json") as f:
        history = json.load(f)
    assert [h["epoch"] for h in history] == [1, 2]
    assert {"loss", "accuracy", "val_loss", "val_accuracy", "images_per_sec"} <= set(history[0])
    assert os.path.isdir(logdir / "backup") and os.path.isdir(logdir / "train")
    # Keras' BackupAndRestore continues the run: one more epoch.
    assert example.main(common + ["--epochs", "3", "--resume"]) == 0
    with open(logdir / "history.json") as f:
        assert [h["epoch"] for h in json.load(f)] == [1, 2, 3]
    assert example.main(common + ["--epochs", "3", "--resume"]) == 0
    assert ("has already reached --epochs 3: nothing to train"
            in capsys.readouterr().out)


def test_keras_trainer_refuses_a_cluster(example, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
         "task": {"type": "worker", "index": 0}}))
    with pytest.raises(SystemExit) as info:
        example.main(["--trainer", "keras", "--logdir", str(tmp_path / "run")])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "image_classification.py: error: --trainer keras trains on one machine "
        "(MultiWorkerMirroredStrategy takes no cross-device ops); across processes, use "
        "--trainer replicated (see --help)\n")


@pytest.mark.slow
def test_horovod_trainer_on_two_processes_then_resumed(tmp_path):
    """--trainer horovod: one process per device, Keras fit with DistributedOptimizer."""
    logdir = tmp_path / "run"

    def launch(*more):
        command = [sys.executable, "-m", "tfreduce.launch", "--workers", "2", "--timeout",
                   "150", "--preload", "tensorflow", "--", sys.executable, EXAMPLE, "--trainer", "horovod", "--limit",
                   "400", "--logdir", str(logdir), "--quiet", *more]
        run = zygote.run(command, timeout=200)
        assert run.returncode == 0, run.stderr[-3000:]
        return run

    run = launch("--epochs", "2")
    assert ("[worker 0] 2 processes, Keras model.fit with tfreduce.tensorflow.keras."
            "DistributedOptimizer, global batch 64") in run.stdout
    assert float(re.search(r"\[worker 0\] test accuracy: ([0-9.]+)", run.stdout).group(1)) > 0.5
    assert "[worker 1] test accuracy" not in run.stdout  # rank 0 reports and writes logs
    # A quiet stderr: the launcher's lines only.
    assert [line for line in run.stderr.splitlines() if not line.startswith("[launch]")] == []
    assert os.path.isdir(logdir / "backup")  # rank 0's; the resume reaches every process
    launch("--epochs", "3", "--resume")
    with open(logdir / "history.json") as f:
        history = json.load(f)
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert {"loss", "accuracy", "val_loss", "val_accuracy", "images_per_sec"} <= set(history[0])


@pytest.mark.parametrize("args, message", [
    (["--devices", "2"], "--trainer horovod runs one process per device: start N processes "
                         "with tfreduce-launch --workers N instead of --devices"),
    (["--compression", "powersgd"], "--trainer horovod takes --compression fp16 or bf16 and "
                                    "no --accumulate-steps"),
])
def test_horovod_trainer_usage_errors(example, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as info:
        example.main(["--trainer", "horovod", "--logdir", str(tmp_path / "run"), *args])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"image_classification.py: error: {message} (see --help)\n"


def run_example_process(args, tmp_path):
    """Runs the example in its own process (a Keras dtype policy is process-wide)."""
    result = zygote.run(
        [sys.executable, EXAMPLE, "--logdir", str(tmp_path / "run"), "--quiet", *args],
        timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.slow
def test_powersgd_rank_2_trains_digits_with_a_fraction_of_the_bytes(tmp_path):
    out = run_example_process(["--compression", "powersgd", "--powersgd-rank", "2"], tmp_path)
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", out).group(1))
    assert accuracy >= 0.97
    assert "replica drift (largest difference from tower 0): 0\n" in out
    sent, full = map(int, re.search(
        r"all-reduce payload per tower and update: (\d+) bytes \((\d+) uncompressed", out).groups())
    # The CNN's float32 gradients: two conv kernels 3x3x1x32 and 3x3x32x64,
    # two BatchNorm gammas and betas, the [256, 10] classifier and its bias.
    shapes = [[3, 3, 1, 32], [32], [32], [3, 3, 32, 64], [64], [64], [256, 10], [10]]
    assert full == 4 * sum(int(np.prod(s)) for s in shapes)
    # At most (rows + cols) * 2 numbers for each matrix, all of every vector.
    bound = 4 * sum(int(np.prod(s)) if len(s) == 1 else (int(np.prod(s[:-1])) + s[-1]) * 2
                    for s in shapes)
    assert sent <= bound < full / 10


@pytest.mark.slow
def test_mixed_float16_trains_digits_with_replicas_equal(tmp_path):
    # 4 of the 12 epochs (0.98 measured; 12 took a minute of the suite).
    out = run_example_process(["--mixed-precision", "mixed_float16", "--epochs", "4"], tmp_path)
    assert ", mixed_float16\n" in out
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", out).group(1))
    assert accuracy >= 0.95
    assert "replica drift (largest difference from tower 0): 0\n" in out


@pytest.mark.slow
def test_towers_compiled_with_xla_train_digits_with_replicas_equal(tmp_path):
    # 2 of the 12 epochs (0.94 measured; all 12 reach the uncompiled run's 0.9889).
    out = run_example_process(["--jit-compile", "--epochs", "2"], tmp_path)
    assert ", each tower compiled with XLA\n" in out
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", out).group(1))
    assert accuracy >= 0.9
    assert "replica drift (largest difference from tower 0): 0\n" in out
