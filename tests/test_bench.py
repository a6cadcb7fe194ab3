"""tfreduce-bench smoke tests: tiny sizes, K=2, few steps; no timed assertions."""

import json
import re
import runpy
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfreduce
import zygote
from tfreduce import bench
from tfreduce.bench import (horovod_worker, multiworker_mode, multiworker_worker, soak_mode,
                            train_mode, zero_mode)
from tfreduce.bench.workloads import gradient_shapes

CHILD_TIMEOUT = 600


class WarmSubprocess:
    """``subprocess`` as the bench's modes use it, each command forked by the zygote.

    The train and multi-worker modes time each K in a child Python and start
    the launcher for two processes: each a TensorFlow import (7 s of a core
    here) before its first step. Forked from the warm server, the children
    run the same programs (tests/zygote.py; test_launch checks that a forked
    program sees what an exec'd one does).
    """

    DEVNULL = subprocess.DEVNULL
    CalledProcessError = subprocess.CalledProcessError

    @staticmethod
    def run(command, check=False, timeout=CHILD_TIMEOUT, cwd=None, env=None, **_output):
        done = zygote.run(command, timeout, cwd=cwd, env=env)
        if check and done.returncode:
            raise subprocess.CalledProcessError(done.returncode, command, done.stdout,
                                                done.stderr)
        return done


@pytest.fixture(autouse=True)
def warm_children(monkeypatch):
    for module in (train_mode, multiworker_mode):
        monkeypatch.setattr(module, "subprocess", WarmSubprocess)


def run(tmp_path, *argv):
    path = tmp_path / "out.json"
    assert bench.main([*argv, "--json", str(path), "--quiet"]) == 0
    return json.loads(path.read_text())


@pytest.mark.slow
def test_allreduce_mode_reports_every_contender_correct(tmp_path, capsys):
    png = tmp_path / "bars.png"
    result = run(tmp_path, "--model", "synthetic", "--num-tensors", "6", "--total-bytes",
                 "6KB", "--devices", "2", "--steps", "2", "--warmup", "1",
                 "--pack-bytes", "2KiB", "--png", str(png))
    assert png.stat().st_size > 0
    cfg = result["config"]
    assert cfg["num_tensors"] == 6 and cfg["bytes_per_tower"] == 6000
    assert cfg["devices"] == ["/device:CPU:0", "/device:CPU:1"]
    rows = {r["name"]: r for r in result["results"]}
    families = {"flat", "hierarchical", "ring", "collective"}
    want = ({"floor", "inputs", "tf-hierarchical-copy", "tf-reduction-to-one-device"}
            | families | {f"{f}+pack2KiB" for f in families})
    assert set(rows) == want
    # tensorpack asserts K == 8 (or is not installed): skipped, with the reason.
    assert result["skipped"]["tensorpack"]
    for name, r in rows.items():
        assert r["median_ms"] > 0 and r["q1_ms"] <= r["median_ms"] <= r["q3_ms"], name
        if name in ("floor", "inputs"):
            continue
        # The check run compared every output of every device with NumPy.
        assert r["correct"] is True and r["max_abs_error"] == 0, name
        assert r["num_ops"] > 0 and r["build_s"] > 0, name
        assert r["x_floor"] == pytest.approx(r["median_ms"] / result["floor"]["median_ms"])
        if r.get("family") in ("flat", "hierarchical", "ring"):
            # Nothing was pruned: every op the contender built ran.
            assert r["ops_not_run"] == 0, name
            assert r["cross_device_bytes"] > 0, name
    assert rows["ring"]["longest_hop_chain"] == 2
    assert rows["flat"]["max_sent_bytes"] == 6000  # 2(K-1)/K * S for K=2
    assert set(result["ratios"]["flat"]) == set(rows) - {"floor", "inputs"}
    assert result["ratios"]["ring"]["ring"] == 1.0
    out = capsys.readouterr().out
    assert "x floor" in out and "tf-reduction-to-one-device" in out


def test_allreduce_mode_sum_half_precision_selected_contenders(tmp_path):
    result = run(tmp_path, "--model", "synthetic", "--num-tensors", "3", "--total-bytes",
                 "600", "--devices", "3", "--steps", "1", "--warmup", "0", "--dtype",
                 "float16", "--reduce", "sum", "--packing", "on",
                 "--contenders", "ring,tf-hierarchical-copy")
    names = [r["name"] for r in result["results"]]
    assert names[:2] == ["floor", "inputs"] and names[2].startswith("ring+pack")
    assert all(r["correct"] for r in result["results"][2:])
    # tf.distribute's hierarchical copy drops a device for odd K.
    assert "odd K = 3" in result["skipped"]["tf-hierarchical-copy"]


@pytest.mark.slow
def test_allreduce_mode_compression_axis(tmp_path, capsys):
    # A small Keras model: PowerSGD compresses matrices, and synthetic
    # tensors are vectors.
    result = run(tmp_path, "--model", "MobileNetV3Small", "--devices", "2", "--steps", "2",
                 "--warmup", "1", "--contenders", "flat", "--packing", "on",
                 "--compression", "none,bf16,powersgd1")
    rows = {r["name"]: r for r in result["results"]}
    flat = "flat+pack64KiB"
    assert {flat, f"{flat}+bf16", f"{flat}+powersgd1"} <= set(rows)
    assert rows[f"{flat}+bf16"]["correct"] is True  # within 16-bit rounding of NumPy
    assert rows[f"{flat}+powersgd1"]["correct"] is None  # an approximation: not judged
    cut = {c["name"]: c for c in result["compression"]}
    assert set(cut) == {f"{flat}+bf16", f"{flat}+powersgd1"}
    assert cut[f"{flat}+bf16"]["bytes_cut"] == 2.0
    sent, full = tfreduce.PowerSGD(rank=1).payload_elements(
        [list(s) for s in gradient_shapes("MobileNetV3Small")])
    # Flat on K = 2: the busiest pair carries one tower's whole payload.
    assert cut[f"{flat}+powersgd1"]["max_pair_bytes"] == 4 * sent < 4 * full / 20
    assert cut[f"{flat}+bf16"]["time_ratio"] > 0
    out = capsys.readouterr().out
    assert re.search(r"flat\+pack64KiB\+bf16: busiest device pair .* \(2\.0x less than "
                     r"flat\+pack64KiB's", out)


@pytest.mark.slow
def test_multiworker_mode_two_workers_through_the_launcher(tmp_path, capsys):
    # Synthetic vectors (the multi-worker path is the same for a Keras
    # model's shapes; PowerSGD then sends vectors whole).
    result = run(tmp_path, "--mode", "multiworker", "--model", "synthetic", "--num-tensors", "6",
                 "--total-bytes", "24KiB", "--steps", "1", "--warmup", "0",
                 "--powersgd-rank", "2")
    assert result["config"]["workers"] == 2 and result["config"]["devices_per_worker"] == 2
    assert result["config"]["num_tensors"] == 6
    rows = result["results"]
    assert list(rows) == ["per-tensor collective", "tfreduce", "tfreduce+fp16",
                          "tfreduce+powersgd2"]
    for name in ("per-tensor collective", "tfreduce", "tfreduce+fp16"):
        assert rows[name]["relative_error"] == 0, name  # quarters: exact, fp16 included
    shapes = [list(s) for s in gradient_shapes("synthetic", 6, 24 * 1024)]
    full = 4 * sum(int(np.prod(s)) for s in shapes)
    assert full == 24 * 1024
    # What each worker puts into collectives: every local device's copy for
    # the per-tensor collective, one local sum for tfreduce, half of it in
    # float16, PowerSGD's payload.
    assert rows["per-tensor collective"]["cross_worker_bytes"] == 2 * full
    assert rows["tfreduce"]["cross_worker_bytes"] == full
    assert rows["tfreduce+fp16"]["cross_worker_bytes"] == full // 2
    sent, _ = tfreduce.PowerSGD(rank=2).payload_elements(shapes)
    assert rows["tfreduce+powersgd2"]["cross_worker_bytes"] == 4 * sent
    assert rows["tfreduce"]["x_tfreduce"] == 1.0
    out = capsys.readouterr().out
    assert "2 workers x 2 devices on 127.0.0.1" in out and "vs per-tensor" in out


@pytest.mark.slow
def test_crossprocess_mode_times_every_contender_in_the_same_processes(tmp_path, capsys):
    from tfreduce.bench import crossprocess_mode

    result = run(tmp_path, "--mode", "crossprocess", "--sizes", "4KiB,64KiB", "--steps", "2",
                 "--warmup", "0")
    mpirun, why = crossprocess_mode._mpirun()
    # Under mpirun the calls go over the MPI transport, and once more over gRPC.
    names = (["tfreduce traced", "tfreduce eager"]
             + (["tfreduce traced, gRPC", "tfreduce eager, gRPC"] if mpirun else [])
             + ["tfreduce 64 fused", "TF CollectiveReduceV2"])
    assert list(result["median_ms"]) == names + (["MPI (mpi4py)"] if mpirun else [])
    assert result["left_out"] == ({} if mpirun else {"MPI (mpi4py)": why})
    assert result["config"] == {"workers": 2, "sizes": [4096, 65536], "rounds": 2,
                                "launcher": "mpirun" if mpirun else "tfreduce.launch"}
    for name, by in result["median_ms"].items():
        assert all(by[size] > 0 and len(result["times_ms"][name][size]) == 2
                   for size in ("4096", "65536")), name
    out = capsys.readouterr().out
    assert "float32 all-reduce across 2 processes on 127.0.0.1" in out
    assert re.search(r"eager / traced +\d+\.\d\d +\d+\.\d\d", out)
    assert re.search(r"traced / TF's op +\d+\.\d\d +\d+\.\d\d", out)
    if mpirun:
        assert re.search(r"eager / traced, gRPC +\d+\.\d\d +\d+\.\d\d", out)
        assert re.search(r"64 fused / MPI +\d+\.\d\d +\d+\.\d\d", out)


@pytest.mark.slow
def test_allreduce_mode_predicts_on_presets_and_the_host(tmp_path, capsys):
    result = run(tmp_path, "--model", "synthetic", "--num-tensors", "4", "--total-bytes",
                 "16KB", "--devices", "2", "--steps", "2", "--warmup", "1",
                 "--contenders", "flat,ring", "--packing", "off",
                 "--predict", "host,dgx-a100,pcie3x8")
    predictions = result["predictions"]
    assert set(predictions) == {"host", "dgx-a100", "pcie3x8"}
    for preset, seconds in predictions.items():
        assert set(seconds) == {"flat", "ring"}, preset
        assert all(s > 0 for s in seconds.values()), preset
    # 16 KB over PCIe gen3 takes longer than over NVSwitch.
    assert predictions["pcie3x8"]["flat"] > predictions["dgx-a100"]["flat"]
    out = capsys.readouterr().out
    assert "predicted step ms (tfreduce.predict; a model, see README)" in out
    assert re.search(r"host model \(a step = the prediction \+ the inputs row, [0-9.]+ ms\): "
                     r"predicted/measured [0-9.]+-[0-9.]+, \d of 2 within 1.5x; orders \d+ of "
                     r"\d+ pairs", out)
    check = result["host_check"]
    inputs = next(r["median_ms"] for r in result["results"] if r["name"] == "inputs")
    assert check["inputs_ms"] == inputs
    for name, row in ((r["name"], r) for r in result["results"] if "family" in r):
        step = 1e3 * predictions["host"][name] + inputs
        assert check["step_ms"][name] == pytest.approx(step)
        assert check["ratios"][name] == pytest.approx(step / row["median_ms"])


def test_scaling_mode(tmp_path, capsys):
    result = run(tmp_path, "--mode", "scaling", "--grid-devices", "2,3", "--grid-tensors",
                 "4,8", "--algorithms", "flat,ring+pack", "--steps", "2")
    rows = result["results"]
    assert [(r["algorithm"], r["devices"], r["tensors"]) for r in rows] == [
        (a, k, n) for a in ("flat", "ring+pack") for k in (2, 3) for n in (4, 8)]
    for r in rows:
        assert r["num_ops"] > 0 and r["step_ms"] > 0
        cells = r["devices"] * r["tensors"]
        assert r["step_us_per_cell"] == pytest.approx(1e3 * r["step_ms"] / cells)
    assert "step us/KN" in capsys.readouterr().out


@pytest.mark.slow
def test_collective_mode_checks_every_contender_and_reports_bus_bandwidth(tmp_path, capsys):
    result = run(tmp_path, "--collective", "reduce_scatter,all_gather,broadcast,reduce,all_to_all",
                 "--devices", "3", "--total-bytes", "6KiB", "--steps", "2", "--warmup", "1",
                 "--predict", "dgx-a100")
    assert result["mode"] == "collective"
    rows = {(r["collective"], r["name"]): r for r in result["results"]}
    peers = {"all_gather", "broadcast", "reduce"}
    for collective in ("reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"):
        names = {n for c, n in rows if c == collective}
        want = {"flat", "hierarchical", "ring", "collective", "plain"}
        assert names == want | ({"tf.distribute"} if collective in peers else set())
        size = result["config"]["bytes"][collective]
        for name in names:
            r = rows[collective, name]
            assert r["correct"], (collective, name)
            # nccl-tests: algbw = S / t; busbw = algbw * the collective's factor of K.
            factor = {"broadcast": 1.0, "reduce": 1.0}.get(collective, 2 / 3)
            assert r["algbw_GB_per_s"] == pytest.approx(size / r["median_ms"] * 1e-6)
            assert r["busbw_GB_per_s"] == pytest.approx(r["algbw_GB_per_s"] * factor)
        predicted = result["predictions"][collective]["dgx-a100"]
        # Built on GPU names: NCCL where TF has the op.
        assert set(predicted) == {"flat", "hierarchical", "ring", "collective"} | (
            {"nccl"} if collective in ("broadcast", "reduce") else set())
        assert all(p["ms"] > 0 and p["busbw_GB_per_s"] > 0 for p in predicted.values())
    # Each tower gathers S/K: 6 KiB of output is 2 KiB (2 rows of 256 floats) per tower.
    assert result["config"]["bytes"]["all_gather"] == 6 * 1024
    out = capsys.readouterr().out
    assert "busbw" in out and "reduce_scatter: predicted ms (bus GB/s)" in out


@pytest.mark.slow
def test_train_mode(tmp_path):
    result = run(tmp_path, "--mode", "train", "--grid-devices", "2", "--steps", "2",
                 "--rounds", "1", "--warmup", "1", "--batch-size", "8", "--image-size", "8")
    (row,) = result["results"]
    assert row["devices"] == 2
    assert row["trainer_images_per_s"] > 0 and row["fit_images_per_s"] > 0
    assert row["tfreduce_fit_images_per_s"] > 0
    # One round: the paired ratio is the ratio of the two rates.
    assert row["trainer_over_fit"] == pytest.approx(
        row["trainer_images_per_s"] / row["fit_images_per_s"])
    assert row["tfreduce_fit_over_fit"] == pytest.approx(
        row["tfreduce_fit_images_per_s"] / row["fit_images_per_s"])
    # 2 processes with DistributedOptimizer, in the same run.
    assert len(row["horovod_rounds"]) == 1 and row["horovod_images_per_s"] > 0
    assert row["horovod_over_trainer"] == pytest.approx(
        row["horovod_images_per_s"] / row["trainer_images_per_s"])
    # And again without the watchdog: its cost is the ratio of the two.
    assert len(row["no_watchdog_rounds"]) == 1
    assert row["watchdog_ratio"] == pytest.approx(
        row["horovod_images_per_s"] / row["no_watchdog_rounds"][0])


@pytest.mark.slow
def test_train_mode_at_zero_stages_reports_rates_and_state_bytes(tmp_path, capsys):
    result = run(tmp_path, "--mode", "train", "--zero-stage", "0,1", "--grid-devices", "2",
                 "--steps", "2", "--rounds", "1", "--warmup", "1", "--batch-size", "8",
                 "--image-size", "8")
    (row,) = result["results"]
    assert set(row["images_per_s"]) == {"zero 0", "zero 1", "MirroredStrategy.fit"}
    assert all(rate > 0 for rate in row["images_per_s"].values())
    assert row["over_first_stage"]["zero 1"] == pytest.approx(
        row["images_per_s"]["zero 1"] / row["images_per_s"]["zero 0"])
    held = row["state_bytes_per_device"]
    # Adam's two slots: whole on every device, or on each of 2 towers half
    # of them and half of the weights (the pieces it updates).
    assert held["zero 0"]["optimizer"] == held["MirroredStrategy.fit"]["optimizer"]
    weights = held["zero 0"]["weights"]
    assert held["zero 1"]["optimizer"] <= held["zero 0"]["optimizer"] * 3 / 4 + 64
    assert held["zero 1"]["weights"] == weights
    assert "MirroredStrategy.fit" in capsys.readouterr().out


@pytest.mark.slow
def test_train_mode_times_compiled_towers_against_uncompiled_ones(tmp_path, capsys):
    result = run(tmp_path, "--mode", "train", "--jit-compile", "--grid-devices", "2",
                 "--steps", "2", "--rounds", "2", "--warmup", "1", "--batch-size", "16",
                 "--image-size", "8")
    (row,) = result["results"]
    assert result["mode"] == "jit" and row["devices"] == 2
    rates = row["rounds"]
    assert set(rates) == {"compiled", "uncompiled"} and all(len(r) == 2 for r in rates.values())
    ratios = sorted(c / u for c, u in zip(rates["compiled"], rates["uncompiled"]))
    assert row["compiled_over_uncompiled"] == pytest.approx(sum(ratios) / 2)
    first = row["first_step_seconds"]
    assert row["compile_seconds"] == pytest.approx(first["compiled"] - first["uncompiled"])
    assert "compiled/uncompiled" in capsys.readouterr().out


@pytest.mark.slow
def test_train_mode_times_the_deterministic_trainer_against_the_default(tmp_path, capsys):
    # Each variant in a child process: deterministic=True's settings are process-wide.
    result = run(tmp_path, "--mode", "train", "--deterministic", "--grid-devices", "2",
                 "--steps", "2", "--rounds", "1", "--warmup", "1", "--batch-size", "16",
                 "--image-size", "8")
    (row,) = result["results"]
    assert result["mode"] == "determinism" and row["devices"] == 2
    rates = row["images_per_s"]
    assert set(rates) == {"default", "deterministic"} and all(r > 0 for r in rates.values())
    assert row["step_time_ratio"] == pytest.approx(rates["default"] / rates["deterministic"])
    assert "deterministic img/s" in capsys.readouterr().out


@pytest.mark.slow
def test_model_shapes_without_downloading():
    shapes = bench.gradient_shapes("resnet50")
    assert len(shapes) == 214
    assert sum(int(np.prod(s)) for s in shapes) == 25_583_592
    shrunk = bench.gradient_shapes("ResNet50", total_bytes=10**6)
    assert len(shrunk) == 214 and all(len(s) == 1 and s[0] >= 1 for s in shrunk)
    assert abs(sum(s[0] for s in shrunk) * 4 - 10**6) < 214 * 4
    assert bench.gradient_shapes("synthetic", num_tensors=4, total_bytes=64) == [(4,)] * 4


@pytest.mark.parametrize("text, want", [("65536", 65536), ("64KiB", 65536), ("1MB", 10**6),
                                        ("4mib", 4 * 2**20), ("0", 0), ("1.5KiB", 1536)])
def test_parse_bytes(text, want):
    assert bench.parse_bytes(text) == want


def test_format_bytes():
    assert [bench.format_bytes(n) for n in (4 * 2**20, 65536, 10**6, 1536, 12)] == [
        "4MiB", "64KiB", "1MB", "1.5KiB", "12B"]


@pytest.mark.parametrize("argv, message", [
    (["--contenders", "flat,nope"], "--contenders: unknown ['nope']"),
    (["--pack-bytes", "4XB"], "'4XB' is not a byte count"),
    (["--algorithms", "flat+zip"], "--algorithms: unknown ['flat+zip']"),
    (["--devices", "0"], "must be >= 1, got 0"),
    (["--predict", "dgx-2"], "--predict: unknown ['dgx-2']; choose from host, dgx-a100"),
    (["--compression", "fp16,zip"], "--compression: unknown ['zip']; use none, fp16, bf16 "
                                    "or powersgdR (R the rank, e.g. powersgd4)"),
    (["--device-type", "gpu", "--devices", "99"], "--device-type gpu: this machine has"),
    (["--model", "NoSuchNet"], "unknown Keras application 'NoSuchNet'"),
    (["--collective", "gather"], "--collective: unknown ['gather']; choose from "
                                 "['reduce_scatter', 'all_gather'"),
    (["--collective", "reduce", "--mode", "train"],
     "--collective runs the collective mode, not --mode train"),
    (["--mode", "train", "--zero-stage", "1,3"], "--zero-stage: stages are 0, 1 and 2, got [1, 3]"),
    (["--zero-stage", "1"], "--zero-stage runs the train mode, not --mode allreduce"),
    (["--mode", "train", "--zero-stage", "1", "--train-model", "resnet5"],
     "unknown Keras application 'resnet5'"),
    (["--trace", "t.json"], "--trace records the train mode (--mode train), not --mode allreduce"),
    (["--mode", "train", "--overlap", "--zero-stage", "1"],
     "--overlap runs the train mode, without --zero-stage"),
    (["--deterministic"], "--deterministic runs the train mode, without --zero-stage or "
                          "--overlap"),
    (["--mode", "train", "--deterministic", "maybe"], "argument --deterministic: invalid choice"),
    (["--mode", "train", "--jit-compile", "--zero-stage", "1"],
     "--jit-compile runs the train mode, without --zero-stage, --overlap or --deterministic"),
])
def test_bad_arguments_exit_with_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_python_m_tfreduce_bench_is_the_command(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tfreduce-bench", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("tfreduce.bench", run_name="__main__")
    assert exit_info.value.code == 0
    assert "--collective" in capsys.readouterr().out


def test_collective_mode_checks_a_broadcast(tmp_path, capsys):
    # The quick tier's run of the mode (the slow test runs every collective).
    result = run(tmp_path, "--collective", "broadcast", "--devices", "2", "--total-bytes",
                 "2KiB", "--steps", "1", "--warmup", "0")
    rows = {r["name"]: r for r in result["results"]}
    assert set(rows) == {"flat", "hierarchical", "ring", "collective", "plain", "tf.distribute"}
    for r in rows.values():
        assert r["correct"], r["name"]
        assert r["busbw_GB_per_s"] == pytest.approx(r["algbw_GB_per_s"])  # a broadcast's factor 1
    assert "busbw" in capsys.readouterr().out


def test_the_multiworker_workers_reference_and_rotation():
    # The worker program runs under the launcher in the slow tier; here its parts.
    shapes = [[3], [2, 2]]
    want = multiworker_worker._expected(shapes, 2, 3, True)
    for n, shape in enumerate(shapes):
        values = [multiworker_worker._values(shape, r, k, n) for r in range(2) for k in range(3)]
        assert all(v.dtype == np.float32 and np.all(v * 4 == np.round(v * 4)) for v in values)
        np.testing.assert_array_equal(want[n], np.mean(values, axis=0, dtype=np.float64))
    calls = []
    times = multiworker_worker._time_rounds({n: lambda n=n: calls.append(n) for n in "abc"},
                                            steps=3, warmup=1)
    assert "".join(calls) == "abc" + "abc" + "bca" + "cab"
    assert {n: len(t) for n, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert multiworker_worker._relative_error(
        [tf.constant([1.0, 2.0])], [np.array([1.0, 2.5])]) == pytest.approx(0.2)

    @tf.function(autograph=False)
    def cross():  # traced, never run
        return tf.raw_ops.CollectiveReduceV2(
            input=tf.zeros([3, 5]), group_size=2, group_key=1, instance_key=1,
            ordering_token=[], merge_op="Add", final_op="Id")

    assert multiworker_worker._cross_bytes(cross) == 3 * 5 * 4
    args = multiworker_worker.parse_args(["--json", "out.json", "--devices", "3"])
    assert (args.devices, args.model, args.reduce, args.json) == (3, "resnet50", "mean", "out.json")


def test_the_horovod_worker_trains_in_one_process(tmp_path):
    # One process is rank 0 of 1: the worker's whole program, as under the launcher.
    path = tmp_path / "rates.json"
    assert horovod_worker.main(["--batch-size", "4", "--image-size", "8", "--steps", "1",
                                "--rounds", "1", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["processes"] == 1 and len(result["rates"]) == 1 and result["rates"][0] > 0


def test_the_soak_modes_resident_memory_is_procs():
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    assert soak_mode._resident_mb() == pytest.approx(rss_kb * 1024 / 1e6, abs=8)


def test_the_zero_modes_mirrored_state_is_one_replica_of_weights_and_adam():
    make = lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])  # noqa: E731
    held = zero_mode._mirrored_bytes(make)
    weights = (3 * 2 + 2) * 4
    # Adam's two float32 slots per weight, and its scalars (step, learning rate).
    assert held["weights"] == weights and held["total"] == weights + held["optimizer"]
    assert 2 * weights < held["optimizer"] <= 2 * weights + 16
    assert zero_mode._busiest([{"a": 1, "b": 5}, {"a": 3, "b": 2}]) == {"a": 3, "b": 5}


@pytest.mark.slow
def test_soak_mode_traces_once_and_keeps_memory_flat(tmp_path, capsys):
    # A short soak: epochs whose last batch is smaller and uneven over the
    # towers must not retrace the step function (the full one, 2,000 steps
    # at K=4, is in the README).
    result = run(tmp_path, "--mode", "soak", "--devices", "2", "--soak-steps", "90",
                 "--batch-size", "15", "--image-size", "8")
    summary = result["summary"]
    assert result["config"]["steps"] == 90 and result["config"]["last_batch"] == 8
    assert summary["traces"] == {"train": 1, "evaluate": 1, "predict": 0}
    assert all(s["traces"]["train"] == 1 for s in result["samples"])
    assert abs(summary["growth_mb_after_first_epoch"]) < 50
    assert "resident MB" in capsys.readouterr().out


@pytest.mark.slow
def test_train_mode_overlap_reports_exposed_communication_and_writes_a_trace(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    result = run(tmp_path, "--mode", "train", "--trace", str(trace), "--grid-devices", "2",
                 "--steps", "2", "--rounds", "1", "--warmup", "1", "--batch-size", "8",
                 "--image-size", "8")
    assert result["mode"] == "overlap"
    (row,) = result["results"]
    steps = row["step_ms"]
    assert set(steps) == {"overlap", "no overlap", "compute only"}
    assert all(ms > 0 for ms in steps.values())
    # One round: the medians are that round's differences.
    for name in ("overlap", "no overlap"):
        assert row["exposed_ms"][name] == pytest.approx(steps[name] - steps["compute only"])
        seen = row["timeline"][name]
        assert seen["compute_ms"] > 0 and 0 <= seen["exposed_ms"] <= seen["communication_ms"]
        assert seen["step_ms"] > 0  # the profiled steps were timed
    assert row["exposed_ratio"] == pytest.approx(
        row["exposed_ms"]["overlap"] / row["exposed_ms"]["no overlap"])
    doc = json.loads(trace.read_text())
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert {"tower 0", "tower 1"} <= names
    # The overlap contender's step predicted on this host from its own
    # profiled steps: compute, then the exposed reduction, then the update.
    predicted = row["predicted"]
    assert predicted["compute_ms"] > 0 and predicted["exposed_ms"] >= 0
    assert predicted["apply_ms"] > 0
    assert predicted["step_ms"] == pytest.approx(predicted["compute_ms"]
                                                 + predicted["exposed_ms"] + predicted["apply_ms"])
    out = capsys.readouterr().out
    assert "exposed communication with overlap / without" in out
    assert "predicted on this host from the profiled layers: step" in out
