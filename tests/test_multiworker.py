"""Multi-worker all-reduce: structure, errors, and 2 real workers on 127.0.0.1.

Structure and error tests build graphs for worker 1 of a two-worker cluster
without starting anything. The multi-process tests run two workers with two
logical CPU devices each through ``python -m tfreduce.launch``, on loopback
with free ports, each run bounded by the launcher's --timeout and a harder
limit here (which stops the launcher, and so its workers, if it is reached):

- reductions in a tf.function and in a tf.compat.v1 Session equal NumPy's
  over all 4 towers, on every device of both workers; the broadcast from
  rank 0 reaches every tower;
- 5 training steps on 2 workers x 2 devices give the weights of 1 process
  with 4 devices on the same global batch;
- a worker killed mid-run: the survivor names it and exits on its own, the
  launcher exits non-zero, no process is left; restarting both with
  ``--resume`` continues from rank 0's last checkpoint to the same weights
  as the uninterrupted run;
- ``ReplicatedTrainer`` on 2 workers x 2 devices (BatchNorm, SGD with
  momentum, uneven shards, a skipped small last batch) gives the weights,
  losses, evaluation and predictions of 1 process with 4 devices, resumes
  from rank 0's checkpoint, and only rank 0 writes; so do accumulation,
  PowerSGD, ZeRO and a skipped NaN batch. These fits share two launches
  (``FITS``): each worker trains four in turn on one cluster.
"""

import functools
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from tfreduce.workers.cluster import Cluster
from tfreduce.launch import free_ports
from tfreduce.doors.multiworker import (CROSS_WORKER_PACK_BYTES, allreduce_grads_multiworker,
                                  broadcast_variables_multiworker)
from tfreduce.workers.watchdog import Watchdog

import zygote
from helpers import CPU_DEVICES, alive

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))
import reduce_worker  # noqa: E402
import train_worker  # noqa: E402
import trainer_worker  # noqa: E402

SPEC = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}
GPUS = [f"/gpu:{k}" for k in range(4)]


def full(device, task=1):
    return f"/job:worker/replica:0/task:{task}" + tf.DeviceSpec.from_string(device).replace(
        job=None, replica=None, task=None).to_string()


@pytest.fixture
def graph():
    g = tf.Graph()
    with g.as_default():
        yield g


def grads_on(devices, shapes, dtype=tf.float32):
    out = []
    for k, d in enumerate(devices):
        with tf.device(d):
            out.append([None if s is None else tf.fill(s, tf.constant(k + 1, dtype))
                        for s in shapes])
    return out


def cross_ops(graph):
    return [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"
            and op.name.endswith("_cross_worker")]


def const(tensor):
    return int(tf.get_static_value(tensor))


# ------------------------------------------------------------------ structure

def test_with_a_watchdog_the_cross_worker_ops_carry_no_timeout(graph):
    # TF's per-op timer holds a sleeping thread per op execution for the whole
    # timeout; while the watchdog runs, it bounds the waits instead.
    spec = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    cluster = Cluster(spec, "worker", 1, timeout=42)
    assert cluster.op_timeout == 42.0  # no watchdog (not started): TF's timer
    cluster.watchdog = Watchdog(cluster, 1.0, on_stall=print)
    try:
        assert cluster.op_timeout is None and cluster.timeout == 42.0
        allreduce_grads_multiworker(grads_on(GPUS, [(10,), (3, 4)]), GPUS, cluster=cluster,
                                    local_algorithm="flat", pack_bytes=None)
        ops = cross_ops(graph)
        assert len(ops) == 2
        assert [op.get_attr("timeout_seconds") for op in ops] == [0.0, 0.0]
        # A timeout given to the call is set on each op.
        allreduce_grads_multiworker(grads_on(GPUS, [(10,)]), GPUS, cluster=cluster,
                                    local_algorithm="flat", pack_bytes=None,
                                    communication="nccl", timeout=7)
        ops = cross_ops(graph)[2:]
        assert [(op.get_attr("communication_hint"), op.get_attr("timeout_seconds"))
                for op in ops] == [(b"nccl", 7.0)]
    finally:
        cluster.watchdog.goodbye()


def test_structure_roots_keys_and_placement(graph):
    cluster = Cluster(SPEC, "worker", 1, timeout=42)
    first_key = Cluster(SPEC, "worker", 1).keys.instance_key()
    # 4000, 40, 48 and 28 bytes, entries in backward order (variable 4 is
    # entry 0, variable 0 entry 3): roots by bytes, largest first.
    grads = grads_on(GPUS, [(1000,), (10,), None, (3, 4), (7,)])
    out = allreduce_grads_multiworker(grads, GPUS, average=True, cluster=cluster,
                                      local_algorithm="flat", pack_bytes=None)
    ops = sorted(cross_ops(graph), key=lambda op: const(op.inputs[3]))
    assert [op.name for op in ops] == [f"allreduce_multiworker/entry{m}_cross_worker"
                                       for m in (3, 1, 2, 0)]
    assert [op.device for op in ops] == [full(d) for d in GPUS]
    assert [const(op.inputs[3]) for op in ops] == list(range(first_key, first_key + 4))
    for r, op in enumerate(ops):
        assert const(op.inputs[1]) == 2  # one member per worker
        assert const(op.inputs[2]) == cluster.group_key([f"/device:GPU:{r}"])
        assert op.get_attr("timeout_seconds") == 42.0
        assert op.get_attr("merge_op") == b"Add"
    assert out[0][2] is None and out[3][2] is None
    for k, row in enumerate(out):
        for n, t in enumerate(row):
            if t is not None:
                assert t.op.device == full(GPUS[k]), (k, n)
                assert t.shape == grads[k][n].shape
    # Local stage: one add_n per entry on its flat root, before the cross hop.
    local = [op for op in graph.get_operations() if op.type == "AddN"]
    assert len(local) == 4
    assert all(op.name.startswith("allreduce_multiworker/allreduce_flat/") for op in local)


def test_structure_half_types_cross_in_float32_and_scale_by_all_towers(graph):
    cluster = Cluster(SPEC, "worker", 0)
    grads = grads_on(GPUS[:2], [(8,), (2, 2)], tf.float16)
    out = allreduce_grads_multiworker(grads, GPUS[:2], average=True, cluster=cluster,
                                      local_algorithm="hierarchical")
    [op] = cross_ops(graph)  # both gradients packed into one buffer
    assert op.inputs[0].dtype == tf.float32
    [scale] = [op for op in graph.get_operations() if "scale_1_over_k" in op.name]
    assert tf.get_static_value(scale.inputs[1]) == np.float32(1 / 4)  # 2 workers x 2
    assert [t.dtype for t in out[1]] == [tf.float16, tf.float16]
    casts = [op.name for op in graph.get_operations() if op.name.endswith("_to_float32")]
    assert len(casts) == 2  # one per tower, before the local sum
    assert CROSS_WORKER_PACK_BYTES == 4 * 1024 * 1024


@pytest.mark.parametrize("compression, wire", [("fp16", tf.float16), ("bf16", tf.bfloat16)])
def test_structure_compression_crosses_workers_in_16_bits_prescaled(graph, compression, wire):
    cluster = Cluster(SPEC, "worker", 0)
    grads = grads_on(GPUS[:2], [(8,), (2, 2)])
    out = allreduce_grads_multiworker(grads, GPUS[:2], average=True, cluster=cluster,
                                      local_algorithm="flat", compression=compression)
    [op] = cross_ops(graph)
    assert op.inputs[0].dtype == wire
    cast = op.inputs[0].op
    assert cast.type == "Cast" and cast.inputs[0].dtype == tf.float32
    prescale = cast.inputs[0].op  # 1/T before the cast: a mean cannot overflow
    assert prescale.type == "Mul"
    assert tf.get_static_value(prescale.inputs[1]) == np.float32(1 / 4)
    assert [t.dtype for t in out[1]] == [tf.float32, tf.float32]
    # The result is not scaled again.
    assert not [o for o in graph.get_operations() if o.name.endswith("_total/scale_1_over_k")]
    with pytest.raises(ValueError, match="compression must be None, 'fp16' or 'bf16', got 'x'"):
        allreduce_grads_multiworker(grads, GPUS[:2], cluster=cluster, compression="x")


def test_local_collective_keeps_every_local_op_needed(graph):
    # Only one device's local sum feeds the cross hop; the other devices'
    # collective ops must still be reached, or a v1 Session hangs.
    cluster = Cluster(SPEC, "worker", 0)
    grads = grads_on(GPUS[:2], [(3,)])
    allreduce_grads_multiworker(grads, GPUS[:2], cluster=cluster,
                                local_algorithm="collective")
    [op] = cross_ops(graph)
    local = [o for o in graph.get_operations() if o.type == "CollectiveReduceV2"
             and o not in (op,)]
    assert len(local) == 2
    reached = ancestors(op)
    assert all(o in reached for o in local)


def ancestors(op):
    """Every op that `op` depends on, through inputs and control inputs."""
    reached, frontier = set(), [op]
    while frontier:
        current = frontier.pop()
        for nxt in [t.op for t in current.inputs] + list(current.control_inputs):
            if nxt not in reached:
                reached.add(nxt)
                frontier.append(nxt)
    return reached


def test_structure_broadcast(graph):
    for rank, kind in ((0, "CollectiveBcastSendV2"), (1, "CollectiveBcastRecvV2")):
        cluster = Cluster(SPEC, "worker", rank)
        all_vars = []
        for d in GPUS[:2]:
            with tf.device(d):
                all_vars.append([tf.Variable(tf.zeros([2, 3])), tf.Variable(0, dtype=tf.int64),
                                 tf.Variable(tf.ones([4]))])
        ops = broadcast_variables_multiworker(all_vars, cluster)
        collectives = [op for op in ops if op.type == kind]
        assert [op.device for op in collectives] == [full(GPUS[0], rank)] * 2  # per dtype
        assigns = [op for op in ops if op.type == "AssignVariableOp"]
        assert len(assigns) == 6
        assert all(op.device == full(GPUS[int(op.name.split("/dev")[1][0])], rank)
                   for op in assigns)
        # The root's tower 0 too takes the sent values: inside a user's
        # tf.function, a send that feeds no assignment would be pruned.
        for op in assigns:
            assert any(o.type == kind for o in ancestors(op)), op.name


@pytest.mark.parametrize("local,scope", [("auto", "allreduce_nccl"),  # all GPUs
                                         ("ring", "allreduce_ring")])
def test_dispatcher_builds_the_local_stage(graph, local, scope):
    cluster = Cluster(SPEC, "worker", 0)
    grads = grads_on(GPUS[:2], [(3,)])
    allreduce_grads_multiworker(grads, GPUS[:2], cluster=cluster, local_algorithm=local)
    assert any(f"allreduce_multiworker/{scope}/" in op.name for op in graph.get_operations())


# ------------------------------------------------------------------ errors

@pytest.mark.parametrize("kwargs,error,message", [
    ({"cluster": None}, TypeError,
     "cluster must be a tfreduce.Cluster (e.g. Cluster.from_tf_config(), then "
     "cluster.start()), got NoneType None"),
    ({"local_algorithm": "butterfly"}, ValueError,
     f"unknown all-reduce algorithm 'butterfly'; choose one of {tfreduce.ALGORITHMS}"),
    ({"local_options": {"pack_bytes": 10}}, ValueError,
     "local_options ['pack_bytes'] are set by allreduce_grads_multiworker itself"),
    ({"local_options": {"groups": [[0]]}}, ValueError,
     "groups [[0]] leave device indices [1] out"),
    ({"communication": "carrier pigeon"}, ValueError,
     "communication must be one of ('auto', 'ring', 'nccl'), got 'carrier pigeon'"),
    ({"timeout": 0}, ValueError,
     "timeout must be a number of seconds > 0 or None (the cluster's 300s), got 0"),
    ({"keys": 5}, TypeError, "keys must be a tfreduce.CollectiveKeys or None"),
    ({"devices": ["/gpu:0", "/job:worker/task:0/device:GPU:1"]}, ValueError,
     "devices[1] '/job:worker/task:0/device:GPU:1' is not a device of this process, which "
     "is /job:worker/replica:0/task:1"),
    ({"devices": ["/gpu:0"]}, ValueError, "all_grads has 2 towers but 1 devices were given"),
])
def test_errors(graph, kwargs, error, message):
    options = {"devices": GPUS[:2], "cluster": Cluster(SPEC, "worker", 1),
               "local_algorithm": "hierarchical"}
    options.update(kwargs)
    grads = grads_on(GPUS[:2], [(3,)])
    with pytest.raises(error, match=re.escape(message)):
        allreduce_grads_multiworker(grads, **options)
    assert not cross_ops(graph)


def test_gradient_errors_name_the_tower(graph):
    grads = grads_on(GPUS[:2], [(3,)])
    grads[1].append(grads[1][0])
    with pytest.raises(ValueError, match=re.escape(
            "tower 1 has 2 gradients, tower 0 has 1")):
        allreduce_grads_multiworker(grads, GPUS[:2], cluster=Cluster(SPEC, "worker", 0))


def test_broadcast_errors(graph):
    cluster = Cluster(SPEC, "worker", 0)
    with tf.device("/gpu:0"):
        a = tf.Variable(tf.zeros([2]))
    with tf.device("/gpu:1"):
        b = tf.Variable(tf.zeros([3]))
    with pytest.raises(ValueError, match=re.escape(
            "variable 0 (Variable:0): tower 1 has float32 (3,), tower 0 has float32 (2,)")):
        broadcast_variables_multiworker([[a], [b]], cluster)
    with pytest.raises(TypeError, match="tower 0, variable 0: expected a tf.Variable, got"):
        broadcast_variables_multiworker([[tf.zeros([2])]], cluster)
    with pytest.raises(TypeError, match="all_vars must be a non-empty list of K lists"):
        broadcast_variables_multiworker([], cluster)
    with pytest.raises(TypeError, match="cluster must be a tfreduce.Cluster"):
        broadcast_variables_multiworker([[a]], "cluster")


# ------------------------------------------------------------------ two workers

LAUNCH_TIMEOUT = 150  # the launcher's own limit; the hard limit below is larger


def launch_workers(script, *args, pid_dir=None, workers=2, launcher=(), timeout=LAUNCH_TIMEOUT):
    """Runs ``python script args`` on 2 workers under the launcher, for at most `timeout` seconds.

    The launcher is forked from this pytest process's warm zygote and
    forks its workers (``--preload``), so no process imports TensorFlow.
    Returns (exit code, stdout, stderr, seconds). If the launcher itself
    overruns, it is stopped with SIGTERM (it then stops its workers) and
    SIGKILL, and the test fails.
    """
    command = [sys.executable, "-m", "tfreduce.launch", "--workers", str(workers),
               "--timeout", str(timeout), "--preload", "tensorflow", *launcher, "--",
               sys.executable, str(WORKERS / script)] + [str(a) for a in args]
    start = time.monotonic()
    try:
        done = zygote.run(command, timeout=timeout + 30, cwd=Path(__file__).parent.parent)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher did not finish in {timeout + 30}s: {command}")
    return done.returncode, done.stdout, done.stderr, time.monotonic() - start


def expected(case, inputs, n):
    """NumPy's sum (or mean) over the 4 towers of both workers, in float64."""
    dtype, _, average, _ = reduce_worker.CASES[case]
    total = 0
    for a in inputs:
        if isinstance(a, tuple):
            dense = np.zeros((5, 3), np.float64)
            np.add.at(dense, a[1], a[0])
            a = dense
        total = total + np.asarray(a, np.float64)
    return (total / 4 if average else total).astype(dtype)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["function", "session"])
def test_two_workers_reduce_like_numpy(tmp_path, mode):
    code, out, err, _ = launch_workers(
        "reduce_worker.py", "--mode", mode, "--devices", 2, "--timeout", 60,
        "--out", tmp_path / "rank{}.npz")
    assert code == 0, err[-3000:]
    results = [np.load(tmp_path / f"rank{r}.npz") for r in range(2)]
    assert [int(r["rank"]) for r in results] == [0, 1]
    checked = 0
    for case, (dtype, shapes, _, _) in reduce_worker.CASES.items():
        for n, shape in enumerate(shapes):
            inputs = [reduce_worker.tower_inputs(case, r, k) for r in range(2) for k in range(2)]
            for r, res in enumerate(results):
                devices = json.loads(str(res[f"{case}/devices"]))
                for k in range(2):
                    key = f"{case}/out/{k}/{n}"
                    if shape is None:
                        assert key not in res.files
                        assert devices[k][n] is None
                        continue
                    want = expected(case, [row[n] for row in inputs], n)
                    got = res[key]
                    assert got.dtype == want.dtype, (case, n)
                    np.testing.assert_array_equal(got, want, err_msg=f"{case} rank {r} tower {k}")
                    assert devices[k][n] == f"/job:worker/replica:0/task:{r}/device:CPU:{k}"
                    # IndexedSlices are gathered across workers, not densified.
                    assert bool(res[f"{case}/sparse/{k}/{n}"]) == (shape == "slices")
                    checked += 1
    assert checked == 4 * 15
    for r, res in enumerate(results):  # rank 0 tower 0 made 1.0 and 1
        for k in range(2):
            np.testing.assert_array_equal(res[f"broadcast/{k}/0"], np.ones((2, 3), np.float32))
            assert res[f"broadcast/{k}/1"] == 1


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    code, _, err, _ = launch_workers("train_worker.py", "--steps", 5, "--out", out)
    assert code == 0, err[-3000:]
    return [np.load(out / f"rank{r}.npz") for r in range(2)]


@pytest.mark.slow
def test_training_matches_one_process_with_four_devices(trained):
    # One process, 4 towers, the same global batch of 10 (shards 3, 3, 2, 2)
    # and the same pairing of towers as 2 workers x 2 devices.
    want = train_worker.reference(CPU_DEVICES[:4], 5, groups=[[0, 1], [2, 3]])
    start = [train_worker.initial_weights(seed) for seed in (0, 1)]
    for r, got in enumerate(trained):
        for k in range(2):
            for n in range(4):
                w = got[f"{k}/{n}"]
                # Same weights up to float32 rounding of the sum order.
                np.testing.assert_allclose(w, want[n], rtol=1e-6, atol=1e-7,
                                           err_msg=f"rank {r} tower {k} variable {n}")
                np.testing.assert_array_equal(w, trained[0][f"0/{n}"])  # replicas agree
    # Training moved the weights, from rank 0's initial values, not rank 1's.
    assert all(np.abs(want[n] - start[0][n]).max() > 0.05 for n in range(4))
    assert np.abs(want[0] - start[1][0]).max() > 0.5


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    pids = tmp_path_factory.mktemp("pids")
    result = launch_workers(
        "train_worker.py", "--steps", 40, "--die-at", 3, "--die-rank", 1,
        "--step-seconds", 0.3, "--ckpt", ckpt, "--timeout", 30, "--pid-dir", pids)
    left = [int(p.name) for p in pids.iterdir() if alive(int(p.name))]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return result, ckpt, len(list(pids.iterdir())), left


@pytest.mark.slow
def test_killed_worker_fails_the_run_fast_and_cleanly(killed):
    (code, out, err, _), _, started, left = killed
    assert started == 2 and left == [], f"processes left running: {left}"
    assert code == 128 + signal.SIGKILL, err[-3000:]
    assert "[worker 1] rank 1: killing myself at step 3" in out
    assert re.search(r"\[launch\] worker 1 was killed by SIGKILL", err)
    # The survivor names the lost worker and exits by itself, well before
    # its 30 s collective timeout and the launcher's grace period.
    assert re.search(r"\[worker 0\] tfreduce\.workers\.failures\.WorkerLostError: worker 0 "
                     r"\(127\.0\.0\.1:\d+\): lost worker 1 \(127\.0\.0\.1:\d+\): it does not "
                     r"answer", err), err[-3000:]
    assert "stopping worker" not in err  # it ended by itself, within the launcher's grace


@pytest.mark.slow
def test_resume_continues_from_the_last_checkpoint(killed, trained, tmp_path):
    _, ckpt, _, _ = killed
    code, out, err, _ = launch_workers("train_worker.py", "--steps", 5, "--ckpt", ckpt,
                                       "--resume", "--out", tmp_path)
    assert code == 0, err[-3000:]
    assert re.search(r"\[worker 0\] rank 0: restored .*ckpt-3 at step 3", out), out
    assert "[worker 1] rank 1: step 4 done" in out and "step 1 done" not in out
    for r in range(2):
        got = np.load(tmp_path / f"rank{r}.npz")
        for key in got.files:
            np.testing.assert_array_equal(got[key], trained[r][key], err_msg=key)


# ------------------------------------------------------------------ ReplicatedTrainer


NAN_OPTIONS = ["--on-nonfinite", "skip", "--compression", "fp16", "--powersgd-rank", 1,
               "--mixed", "--no-shuffle"]
# name -> arguments of trainer_worker.py; the runs of each fixture below
# share one launch (one process per worker, one cluster), in this order: the
# second of a pair resumes from the first's checkpoint.
FITS = {
    "first": ["--logdir", "{logs}", "--profile-steps", "2,3"],
    "resumed": ["--logdir", "{logs}", "--epochs", 2, "--resume"],
    "accumulated": ["--accumulate-steps", 2, "--powersgd-rank", 1],
    "zero2": ["--accumulate-steps", 2, "--zero-stage", 2],
    "zero1": ["--logdir", "{zero_logs}", "--zero-stage", 1],
    "zero1_resumed": ["--logdir", "{zero_logs}", "--zero-stage", 1, "--epochs", 2, "--resume"],
    # 53 rows in batches of 10, not shuffled: row 28 is in batch 2.
    "nan": NAN_OPTIONS + ["--nan-row", 28],
    "without": NAN_OPTIONS + ["--drop-rows", "20:30"],
    # The model takes {"features": x}: each worker's part of every leaf.
    "dict": ["--dict-inputs"],
}


def launch_fits(root, names):
    """FITS[name] for each name on 2 workers x 2 devices, in one launch.

    Returns (name -> [rank 0's, rank 1's results], stdout, root): root/logs
    and root/zero_logs hold the runs' logdirs (rank r's in rank<r>).
    """
    runs = {}
    for name in names:
        (root / name).mkdir()
        runs[name] = ["--out", str(root / name)] + [
            str(a).format(logs=root / "logs", zero_logs=root / "zero_logs") for a in FITS[name]]
    (root / "runs.json").write_text(json.dumps(runs))
    code, out, err, _ = launch_workers("trainer_worker.py", "--runs", root / "runs.json",
                                       timeout=300)
    assert code == 0, err[-3000:]
    results = {name: [np.load(root / name / f"rank{r}.npz") for r in range(2)] for name in names}
    return results, out, root


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """Four of the FITS in one launch (all nine in one took about a minute)."""
    return launch_fits(tmp_path_factory.mktemp("fits"),
                       ["first", "resumed", "accumulated", "zero2"])


@pytest.fixture(scope="module")
def more_fits(tmp_path_factory):
    """The other five FITS, in a launch of their own."""
    return launch_fits(tmp_path_factory.mktemp("more_fits"),
                       ["zero1", "zero1_resumed", "nan", "without", "dict"])


@pytest.mark.slow
def test_a_fit_holds_no_thread_per_collective(fits, more_fits):
    # Each fit runs 5-10 steps of several cross-worker collectives; TF's
    # per-op timeout would hold a sleeping thread per op execution for 300 s.
    out = fits[1] + more_fits[1]
    counts = re.findall(r"\[worker (\d)\] rank \d: (\w+): threads (\d+) -> (\d+)", out)
    assert sorted((name, int(r)) for r, name, _, _ in counts) == sorted(
        (name, r) for name in FITS for r in range(2)), out
    for r, name, before, after in counts:
        assert int(after) - int(before) <= 10, f"{name}, rank {r}: {before} threads, then {after}"


@pytest.mark.slow
def test_a_model_of_a_dict_of_inputs_trains_across_workers_as_in_one_process(more_fits):
    want = one_process()
    for r, got in enumerate(more_fits[0]["dict"]):
        assert_matches(got, want, r)


@pytest.fixture(scope="module")
def trainer_runs(fits):
    """One epoch on 2 workers x 2 devices, then a resumed second epoch."""
    results, out, root = fits
    return results["first"], results["resumed"], out, root / "logs"


def assert_matches(got, want, rank):
    """A worker's results equal one process's with 4 towers, up to sum order."""
    assert int(got["step"]) == int(want["step"])
    for key in got.files:
        if key == "step":
            continue
        expected = want[key]
        if key in ("loss", "accuracy"):  # the history of the epochs this run trained
            expected = expected[len(expected) - len(got[key]):]
        np.testing.assert_allclose(got[key], expected, rtol=1e-5, atol=2e-5,
                                   err_msg=f"rank {rank} {key}")


@pytest.mark.slow
def test_each_worker_writes_the_timeline_of_its_towers(trainer_runs):
    # The first run profiled steps 2 and 3 on both workers, each into its
    # own logdir here (trainer_worker gives rank r logdir/rank<r>).
    logdir = trainer_runs[3]
    for rank, name in [(0, "timeline.json.gz"), (1, "timeline-worker1.json.gz")]:
        doc = json.loads(gzip.decompress((logdir / f"rank{rank}" / name).read_bytes()))
        meta = {(e["name"], e["tid"]): e["args"] for e in doc["traceEvents"] if e["ph"] == "M"}
        assert meta[("process_name", 0)]["name"] == f"worker {rank}"
        tracks = {args["name"] for (kind, _), args in meta.items() if kind == "thread_name"}
        assert {"tower 0", "tower 1"} <= tracks
        steps = [e["name"] for e in doc["traceEvents"] if e.get("args", {}).get("type") == "step"]
        assert steps == ["step 2", "step 3"]
        stages = {e["cat"] for e in doc["traceEvents"] if e["ph"] == "X"}
        assert {"forward", "backward", "apply"} <= stages
    assert list((logdir / "rank1" / "worker1").glob("plugins/profile/*/*.xplane.pb"))


@functools.lru_cache(maxsize=None)
def one_process(epochs=1):
    """fit_reference's weights on 4 towers of this process, fitted once per process (read only)."""
    return trainer_worker.fit_reference(CPU_DEVICES[:4], epochs)


@pytest.mark.slow
def test_trainer_on_two_workers_matches_one_process_with_four_devices(trainer_runs):
    first, _, _, _ = trainer_runs
    # 53 examples in batches of 10 over 4 towers: 5 steps (shards 3, 3, 2, 2;
    # rank 0 trains on 6 examples, rank 1 on 4), the last 3 skipped.
    want = one_process()
    assert want["step"] == 5
    start = trainer_worker.make_model(1).variables
    for r, got in enumerate(first):
        assert_matches(got, want, r)
        for key in got.files:  # every tower of both workers holds one replica
            np.testing.assert_array_equal(got[key], first[0][key], err_msg=f"rank {r} {key}")
    # Rank 1 started from other weights; the broadcast from rank 0 replaced them.
    assert np.abs(first[1]["0/0"] - start[0].numpy()).max() > 0.1


@pytest.mark.slow
def test_trainer_resume_reads_rank_0_checkpoint_and_only_rank_0_writes(trainer_runs):
    _, second, out, logdir = trainer_runs
    assert re.search(r"\[worker 0\] rank 0: resumed: restored .*ckpt-1 at step 5", out), out
    assert "[worker 1] rank 1: resumed: restored None at step 5" in out
    want = one_process(epochs=2)
    for r, got in enumerate(second):
        assert_matches(got, want, r)
    # Rank 1 wrote only what profile_steps asked of it (the first run):
    # its timeline and profile.
    assert sorted(os.listdir(logdir)) == ["rank0", "rank1"]
    assert sorted(os.listdir(logdir / "rank1")) == [
        "timeline-worker1.json.gz", "timeline-worker1.png", "worker1"]
    assert tf.train.latest_checkpoint(logdir / "rank0" / "ckpt").endswith("ckpt-2")
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(logdir / "rank0"))


@pytest.mark.slow
def test_accumulation_and_powersgd_on_two_workers_match_one_process(fits):
    results = fits[0]["accumulated"]
    want = trainer_worker.fit_reference(
        CPU_DEVICES[:4], **trainer_worker.update_options(accumulate_steps=2, powersgd_rank=1))
    for r in range(2):
        got = results[r]
        assert_matches(got, want, r)
        for key in got.files:
            np.testing.assert_array_equal(got[key], results[0][key])


@pytest.mark.slow
def test_zero_stage_2_on_two_workers_matches_one_unsharded_process(fits, tmp_path):
    # Each of the 4 towers of both workers holds a quarter of the momentum
    # and of the accumulated shards: every micro-batch is reduce-scattered
    # across the workers, every update all-gathered.
    results = fits[0]["zero2"]
    want = trainer_worker.fit_reference(
        CPU_DEVICES[:4], **trainer_worker.update_options(accumulate_steps=2))
    for r in range(2):
        got = results[r]
        # 227 weights over 4 towers: 57, 57, 57, 56, in a packed buffer's
        # order (backward, 64-byte multiples first: kernel 1, beta, gamma,
        # bias 0, kernel 0, bias 1); tower 1 of rank 0 holds the first
        # kernel's elements 0..17, tower 1 of rank 1 its elements 75..127.
        assert got["1/optimizer/2"].shape == ((18,), (53,))[r]
        assert_models_match(got, want, r, tmp_path)


def assert_models_match(got, want, rank, tmp_path):
    """assert_matches on the model's results only (ZeRO's optimizers hold shards)."""
    path = tmp_path / f"model{rank}.npz"
    np.savez(path, **{k: got[k] for k in got.files if "/optimizer/" not in k})
    assert_matches(np.load(path), want, rank)


@pytest.mark.slow
def test_zero_stage_1_checkpoints_on_two_workers_are_whole_and_resume(more_fits, tmp_path):
    # Rank 0 writes every worker's shards, gathered; the resumed run gets
    # its ranges back from rank 0's read, on each tower of each worker.
    results, stdout, root = more_fits
    logdir = root / "zero_logs"
    assert "[worker 1] rank 1: zero1_resumed: restored None at step 5" in stdout
    want = one_process(epochs=2)
    for r in range(2):
        assert_models_match(results["zero1_resumed"][r], want, r, tmp_path)
    # The first epoch's checkpoint holds whole slots: an unsharded trainer
    # of 4 towers in this process reads the reference's momentum from it.
    first = one_process()
    reader = trainer_worker.make_trainer(CPU_DEVICES[:4], 0, None, algorithm="flat")
    reader.restore(str(logdir / "rank0" / "ckpt" / "ckpt-1"))
    for n, v in enumerate(reader.optimizers[0].variables):
        np.testing.assert_allclose(v.numpy(), first[f"0/optimizer/{n}"], rtol=1e-5, atol=2e-5,
                                   err_msg=v.path)


@pytest.mark.slow
def test_a_nan_on_one_worker_is_skipped_by_both_like_the_run_without_its_batch(more_fits):
    # 53 rows in batches of 10, not shuffled: row 28 is in batch 2, on a
    # tower of rank 1 only (shards 3, 3 | 2, 2). Rank 0's losses are
    # finite, so only a cluster-wide check keeps its LossScaleOptimizer
    # from lowering its scale, and its BatchNorm statistics, PowerSGD state
    # and weights from moving.
    runs = more_fits[0]
    for r in range(2):
        got, want = runs["nan"][r], runs["without"][r]
        assert int(got["step"]) == 5 and int(want["step"]) == 4
        assert int(got["skipped_steps"]) == int(want["skipped_steps"]) + 1
        for key in got.files:
            if key not in ("step", "skipped_steps"):
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"rank {r} {key}")


@pytest.mark.parametrize("mistake, message", [
    (["--rank1-devices", "3"],
     r"the workers do not run the same training: their numbers of towers \(devices\) differ: "
     r"worker 0 \(127\.0\.0\.1:\d+\) has 2, worker 1 \(127\.0\.0\.1:\d+\) has 3"),
    (["--rank1-hidden", "17"],
     r"the workers do not run the same training: variable 0 differs: worker 0 "
     r"\(127\.0\.0\.1:\d+\) has \S+ \(8, 16\) float32; worker 1 \(127\.0\.0\.1:\d+\) has "
     r"\S+ \(8, 17\) float32"),
])
@pytest.mark.slow
def test_workers_that_differ_fail_fast_on_every_worker(tmp_path, mistake, message):
    # Once: workers with other device counts trained to different weights
    # with rc 0, and a different model made rank 0 wait out its timeout.
    code, out, err, _ = launch_workers("trainer_worker.py", "--out", tmp_path, *mistake)
    assert code != 0
    for rank in range(2):
        assert re.search(rf"\[worker {rank}\] ValueError: worker {rank} \(127\.0\.0\.1:\d+\): "
                         + message, err), err[-3000:]
    assert "WorkerLostError" not in err  # not a collective's timeout


@pytest.mark.slow
def test_a_worker_that_dies_once_is_restarted_and_ends_like_an_undisturbed_run(trained, tmp_path):
    # The launcher restarts both workers (--restarts 1); the restarted ones
    # resume from rank 0's checkpoint and finish the same 5 steps.
    code, out, err, _ = launch_workers(
        "train_worker.py", "--steps", 5, "--ckpt", tmp_path / "ckpt", "--die-at", 3,
        "--die-once", "--out", tmp_path, launcher=["--restarts", "1", "--grace", "2"])
    assert code == 0, err[-3000:]
    assert "[worker 1] rank 1: killing myself at step 3" in out
    assert re.search(r"\[launch\] restart 1 of 1: worker 1 was killed by SIGKILL", err), err
    assert re.search(r"\[worker 0\] rank 0: restored .*ckpt-3 at step 3", out), out
    for r in range(2):
        got = np.load(tmp_path / f"rank{r}.npz")
        for key in got.files:
            np.testing.assert_array_equal(got[key], trained[r][key], err_msg=key)
