"""The command lines as a new user meets them: fast --help, a quiet start, one-line errors."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import EXAMPLE, load_script
from tfreduce.basis.startup import filter_stream, is_startup_noise

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
PROG = "image_classification.py"


@pytest.fixture(scope="module")
def example():
    return load_script(EXAMPLE, "image_classification")


def python(code, *, env=None, timeout=120):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


# --help is answered before TensorFlow is imported (it takes seconds).
HELP = {
    "example": f"import runpy, sys; sys.argv = ['x', '--help']; runpy.run_path({EXAMPLE!r}, "
               f"run_name='__main__')",
    "bench": "from tfreduce.bench.cli import main; main(['--help'])",
    "launcher": "from tfreduce.launch import main; main(['--help'])",
}


@pytest.mark.parametrize("command", sorted(HELP))
def test_help_imports_no_tensorflow(command):
    code = ("import sys\ntry:\n    " + HELP[command] + "\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\n"
            "print('tensorflow' in sys.modules, 'keras' in sys.modules)")
    done = python(code)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
    assert done.stdout.splitlines()[-1] == "False False"


NOISE = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795472389.532581   13680 cudart_stub.cc:31] Could not find cuda drivers "
    "on your machine, GPU will not be used.",
    "E0000 00:00:1795472394.271643   13680 cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild "
    "TensorFlow with the appropriate compiler flags.",
    "W0000 00:00:1795472449.172941   13756 xplane_to_step_stats.cc:84] GPU trace was not "
    "collected.",
    # At the first float16 graph on a CPU without AVX-512 float16 (not this one).
    "E0000 00:00:1795514405.912734    9127 util.cc:131] oneDNN supports DT_HALF only on "
    "platforms with AVX-512. Falling back to the default Eigen-based implementation if present.",
]
KEPT = ["E0000 00:00:1795472394.271643   13680 collective_ops.cc:12] a real failure",
        "Traceback (most recent call last):"]


def test_noise_lines_are_told_from_the_rest():
    # Lines as TensorFlow 2.21 prints them on a machine without a GPU.
    assert [is_startup_noise(line) for line in NOISE] == [True] * len(NOISE)
    assert [is_startup_noise(line) for line in KEPT] == [False] * len(KEPT)


@pytest.mark.slow
def test_the_stderr_filter_drops_the_noise_for_the_whole_run_and_loses_no_last_words():
    # The filter works on file descriptor 2, where TensorFlow's C++ code
    # writes, from the import to the end; the oneDNN line comes long after
    # start-up. A line written just before an abort still gets through, and
    # a partial line (a progress bar's \r) is not held back.
    payload = ("\n".join(NOISE + KEPT[:1]) + "\n").encode()
    code = ("import os, sys\nfrom tfreduce.basis.startup import import_tensorflow\n"
            "tf = import_tensorflow()\n"
            "print(float(tf.function(lambda x: x * x)(tf.constant(2.0, tf.float16))), flush=True)\n"
            f"os.write(2, {payload!r})\n"
            "print('from python', file=sys.stderr)\n"
            "os.write(2, b'\\r 50%')\n"
            "os.write(2, b' of an epoch\\nlast words\\n')\n"
            "os.abort()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120,
                          cwd=ROOT)  # bytes: text mode would turn \r into \n
    assert done.returncode == -6 and done.stdout == b"4.0\n"
    assert done.stderr.decode() == f"{KEPT[0]}\nfrom python\n\r 50% of an epoch\nlast words\n"
    # Unfiltered with --verbose (TFREDUCE_VERBOSE=1): TensorFlow's own lines show.
    verbose = python(code, env=dict(os.environ, TFREDUCE_VERBOSE="1"))
    assert NOISE[-1] in verbose.stderr.splitlines()


def test_a_partial_line_is_written_on_unless_it_may_become_noise():
    read_fd, write_fd = os.pipe()
    out_read, out_write = os.pipe()
    os.write(write_fd, b"I0000 00:00:1.0 1 a.cc:1] hidden\n\rprogress"
                       b" 10%\rprogress 20%\nW0000 00:00:1.0 1 b.cc:2] hidden\nE")
    os.close(write_fd)
    filter_stream(read_fd, out_write)
    os.close(out_write)
    assert os.read(out_read, 1000) == b"\rprogress 10%\rprogress 20%\nE"


@pytest.mark.slow
def test_a_healthy_run_prints_no_error_and_one_line_per_epoch(tmp_path):
    # Off a terminal (a pipe here, a log file or the launcher in real use)
    # the progress bar's \r and ANSI codes are replaced by a line per epoch.
    done = subprocess.run(
        [sys.executable, EXAMPLE, "--limit", "128", "--epochs", "2", "--batch-size", "32",
         "--logdir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    bad = [line for line in done.stderr.splitlines()
           if "error" in line.lower() or "cuinit" in line.lower()]
    assert bad == []
    assert "\r" not in done.stdout and "\x1b" not in done.stdout and "\b" not in done.stdout
    epochs = [line for line in done.stdout.splitlines() if line.startswith("Epoch ")]
    assert [line.split(" - ")[0] for line in epochs] == ["Epoch 1/2", "Epoch 2/2"]
    assert all(" - loss: " in line and " - val_accuracy: " in line for line in epochs)


@pytest.mark.slow
def test_a_healthy_bench_run_prints_no_error(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tfreduce.bench", "--devices", "2", "--model", "synthetic",
         "--num-tensors", "3", "--steps", "2", "--warmup", "1", "--contenders", "flat"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines()
            if "error" in line.lower() or "cuinit" in line.lower()
            or "GPU trace" in line] == []
    assert "checked flat: largest difference from NumPy 0, every op ran" in done.stderr


def usage_error(example, capsys, argv):
    """The exit code and stderr of example.main(argv), which must exit through argparse."""
    with pytest.raises(SystemExit) as info:
        example.main(argv)
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--lr", "-1"], "--lr must be > 0, got -1"),
    (["--lr", "0"], "--lr must be > 0, got 0"),
    (["--lr", "nan"], "--lr must be > 0, got nan"),
    (["--algorithm", "nccl"], "--algorithm nccl runs on GPUs only and this machine has none; "
                              "choose one of auto, flat, hierarchical, ring, collective"),
    (["--batch-size", "2000"], "--batch-size 2000 is larger than the 1437 training images of "
                               "--dataset digits"),
    (["--batch-size", "64", "--limit", "50"], "--batch-size 64 is larger than the 50 training "
                                              "images of --dataset digits --limit 50"),
    (["--resume", "--overwrite"], "argument --overwrite: not allowed with argument --resume"),
    (["--accumulate-steps", "0"], "--accumulate-steps must be at least 1, got 0"),
    (["--powersgd-rank", "0"], "--powersgd-rank must be at least 1, got 0"),
    (["--mixed-precision", "fp8"], "argument --mixed-precision: invalid choice: 'fp8' (choose "
                                   "from 'mixed_float16', 'mixed_bfloat16')"),
])
def test_bad_usage_is_one_line_and_exit_2(example, capsys, tmp_path, argv, message):
    code, err = usage_error(example, capsys, argv + ["--logdir", str(tmp_path / "run")])
    assert code == 2
    assert err == f"{PROG}: error: {message} (see --help)\n"


def write_images(root, classes, count=6):
    for c in classes:
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for i in range(count):
            pixels = np.random.default_rng(i).integers(0, 256, (8, 8, 3), dtype=np.uint8)
            tf.io.write_file(os.path.join(root, c, f"{i}.png"), tf.io.encode_png(pixels))


def test_a_folder_with_one_class(example, capsys, tmp_path):
    write_images(str(tmp_path / "images"), ["cats"])
    code, err = usage_error(example, capsys, ["--dataset", str(tmp_path / "images"),
                                              "--logdir", str(tmp_path / "run")])
    assert code == 2
    assert err == (f"{PROG}: error: --dataset '{tmp_path / 'images'}': only one class ('cats') "
                   f"holds images; a classifier needs at least two class sub-folders "
                   f"(see --help)\n")


@pytest.mark.parametrize("content, what", [
    (b"", "is empty"),
    (b"hello", "does not start as a .png file"),
])
def test_a_file_that_is_no_image_is_named(example, capsys, tmp_path, content, what):
    write_images(str(tmp_path / "images"), ["cats", "dogs"])
    bad = tmp_path / "images" / "dogs" / "bad.png"
    bad.write_bytes(content)
    code, err = usage_error(example, capsys, ["--dataset", str(tmp_path / "images"),
                                              "--logdir", str(tmp_path / "run")])
    assert code == 2
    assert err == (f"{PROG}: error: image '{bad}' {what}: remove it or replace it with a valid "
                   f"image (see --help)\n")


@pytest.mark.slow
def test_a_damaged_image_fails_the_run_in_one_line_naming_it(example, capsys, tmp_path):
    write_images(str(tmp_path / "images"), ["cats", "dogs"])
    bad = tmp_path / "images" / "dogs" / "3.png"
    bad.write_bytes(bad.read_bytes()[:40])  # the signature is intact, the data is not
    code = example.main(["--dataset", str(tmp_path / "images"), "--image-size", "8",
                         "--batch-size", "4", "--epochs", "1", "--quiet",
                         "--logdir", str(tmp_path / "run")])
    assert code == 1
    assert capsys.readouterr().err == (
        f"{PROG}: error: image '{bad}' cannot be decoded (Invalid PNG. Failed to initialize "
        f"decoder.) (--verbose shows the traceback)\n")


@pytest.mark.slow
def test_a_logdir_that_holds_a_run(example, capsys, tmp_path):
    logdir = tmp_path / "run"
    common = ["--limit", "64", "--batch-size", "32", "--epochs", "1", "--quiet",
              "--logdir", str(logdir)]
    assert example.main(common) == 0
    capsys.readouterr()
    code, err = usage_error(example, capsys, common)
    assert code == 2
    assert err == (f"{PROG}: error: --logdir {logdir} already holds a run (checkpoints, "
                   f"curves.png, history.json, 1 TensorBoard event file): continue it with "
                   f"--resume, or start again with --overwrite (see --help)\n")
    # --overwrite removes nothing when a later check stops the run ...
    code, _ = usage_error(example, capsys, common[:-1] + [str(logdir), "--overwrite",
                                                           "--batch-size", "5000"])
    assert code == 2 and (logdir / "checkpoints" / "checkpoint").exists()
    # ... nor on a launcher restart, which continues from the checkpoint.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TFREDUCE_RESTART_COUNT", "1")
        assert example.main(common + ["--overwrite", "--epochs", "2"]) == 0
    assert "resumed from" in capsys.readouterr().out
    # A file of the user's own in the logdir is left alone by --overwrite.
    (logdir / "notes.txt").write_text("mine")
    assert example.main(common + ["--overwrite"]) == 0
    out = capsys.readouterr().out
    assert "resumed" not in out
    assert sorted(os.listdir(logdir / "checkpoints")) == [
        "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index"]
    assert sum(name.startswith("events.out") for name in os.listdir(logdir)) == 1
    assert (logdir / "notes.txt").read_text() == "mine"
    # Resuming a run that has reached --epochs trains nothing, says so, exits 0.
    assert example.main(common + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert (f"the run in {logdir} has already reached --epochs 1 (step 2): nothing to train; "
            f"give a larger --epochs to train on") in out
    assert "test accuracy" not in out


def test_the_dispatcher_refuses_devices_that_do_not_exist():
    with tf.device("/cpu:0"):
        a, b = tf.ones([2]), tf.ones([2])
    message = (r"devices\[1\]='/cpu:99' does not exist in this process; available devices: "
               r"\['/device:CPU:0', .*\]\. For K logical CPU devices, call "
               r"tfreduce\.logical_devices\(K\) before TensorFlow initialises")
    for algorithm in ("flat", "hierarchical", "ring", "collective"):
        with pytest.raises(ValueError, match=message):
            tfreduce.allreduce_grads([[a], [b]], ["/cpu:0", "/cpu:99"], algorithm=algorithm)

    @tf.function
    def traced():
        return tfreduce.allreduce_grads([[a], [b]], ["/cpu:0", "/cpu:99"])

    with pytest.raises(ValueError, match=message):
        traced()
    # A v1 Graph may be built for another machine: nothing here is checked.
    with tf.Graph().as_default():
        x, y = tf.ones([2]), tf.ones([2])
        out = tfreduce.allreduce_grads([[x], [y]], ["/gpu:0", "/gpu:7"], algorithm="flat")
        assert [row[0].device for row in out] == ["/device:GPU:0", "/device:GPU:7"]


def test_the_launcher_passes_verbose_to_its_workers():
    done = subprocess.run(
        [sys.executable, "-m", "tfreduce.launch", "--workers", "2", "--verbose", "--timeout", "60",
         "--", sys.executable, "-c", "import os; print(os.environ.get('TFREDUCE_VERBOSE'))"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env={
            k: v for k, v in os.environ.items() if k != "TFREDUCE_VERBOSE"})
    assert done.returncode == 0, done.stderr
    assert sorted(line for line in done.stdout.splitlines()) == ["[worker 0] 1", "[worker 1] 1"]
