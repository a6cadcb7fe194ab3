"""Processes that ``mpirun`` started find each other over MPI (mpi4py); the MPI transport.

``hvd.init()`` and ``ReplicatedTrainer(cluster="auto")`` form the TF
cluster of ``mpirun -np N``'s processes, ranked as MPI ranks them, on
loopback when all share one host; without mpi4py they refuse, naming it,
rather than each train alone. Their eager Horovod calls go over the MPI
transport (``tfreduce.workers.mpi_transport``): each collective's values,
fusion, a mismatch raised on both ranks, a frozen rank named. The runs
under mpirun skip, saying why, where Open MPI or mpi4py is not installed
(.ci/run installs both).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tfreduce.basis.tf_config import mpirun_size, mpirun_tf_config, parse_tf_config
from tfreduce.tensorflow import mpi_calls
from tfreduce.workers import environment, mpi_transport
from tfreduce.workers.cluster import Cluster

WORKER = Path(__file__).parent / "workers" / "mpirun_worker.py"
TRANSPORT_WORKER = Path(__file__).parent / "workers" / "mpi_transport_worker.py"


def have_mpi():
    if shutil.which("mpirun") is None:
        return "mpirun is not installed (Debian's openmpi-bin)"
    if subprocess.run([sys.executable, "-c", "import mpi4py"]).returncode != 0:
        return "mpi4py is not installed (pip install mpi4py)"
    return None


def mpirun(np, *command):
    """``mpirun -np np`` of a Python command on this host (skips where MPI is missing)."""
    why = have_mpi()
    if why:
        pytest.skip(why)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("TF_CONFIG", None)
    return subprocess.run(["mpirun", "-np", str(np), "--oversubscribe", "--bind-to", "none",
                           "--tag-output", sys.executable, *map(str, command)],
                          capture_output=True, text=True, env=env, timeout=240)


def run_mpirun(tmp_path, np, *args, worker=WORKER):
    """The worker under ``mpirun -np np``, which must succeed: each rank's JSON, in rank order."""
    done = mpirun(np, worker, "--out", tmp_path, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(np)]


@pytest.mark.slow
def test_hvd_init_under_mpirun_forms_one_cluster_on_loopback(tmp_path):
    rows = run_mpirun(tmp_path, 2, "--door", "hvd")
    assert [(r["rank"], r["size"]) for r in rows] == [(0, 2), (1, 2)]
    assert rows[0]["addresses"] == rows[1]["addresses"]
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in rows[0]["addresses"])
    for row in rows:
        assert row["eager"] == row["traced"] == [3.0, 3.0, 3.0]  # 1 + 2


@pytest.mark.slow
def test_the_trainers_auto_cluster_under_mpirun_spans_every_process(tmp_path):
    rows = run_mpirun(tmp_path, 2, "--door", "trainer")
    assert [(r["rank"], r["size"]) for r in rows] == [(0, 2), (1, 2)]
    assert rows[0]["weights"] == rows[1]["weights"] and rows[0]["drift"] == 0.0


@pytest.mark.slow
def test_the_examples_trainer_under_mpirun_trains_across_its_processes(tmp_path):
    example = Path(__file__).parent.parent / "examples" / "image_classification.py"
    done = mpirun(2, example, "--trainer", "replicated", "--devices", "1", "--epochs", "1",
                  "--limit", "400", "--logdir", tmp_path, "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):  # one cluster: neither trains alone
        assert f"[1,{rank}]<stdout>:worker {rank} of 2 (2 towers in all)" in done.stdout
    losses = re.findall(r"\[1,(\d)\]<stdout>:test accuracy: [0-9.]+  test loss: ([0-9.]+)",
                        done.stdout)
    assert sorted(rank for rank, _ in losses) == ["0", "1"] and len(set(dict(losses).values())) == 1


class ThreadComm:
    """mpi4py's allgather for N threads, each a rank (for mpirun_tf_config in one process)."""

    def __init__(self, size):
        self.size, self.barrier, self.slots = size, threading.Barrier(size), {}

    def of_rank(self, rank):
        comm = self

        class Rank:
            def Get_rank(self):
                return rank

            def allgather(self, value):
                comm.barrier.wait()
                comm.slots[rank] = value
                comm.barrier.wait()
                out = [comm.slots[r] for r in range(comm.size)]
                comm.barrier.wait()
                return out

        return Rank()


def test_mpiruns_processes_on_one_host_get_distinct_loopback_ports():
    comm, configs = ThreadComm(3), {}

    def run(rank):
        configs[rank] = mpirun_tf_config(comm.of_rank(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    workers = configs[0]["cluster"]["worker"]
    assert len(set(workers)) == 3 and all(w.startswith("127.0.0.1:") for w in workers)
    for rank, config in configs.items():
        assert config["cluster"]["worker"] == workers
        spec, task_type, index = parse_tf_config(config)
        assert (task_type, index) == ("worker", rank)


@pytest.mark.parametrize("environ, want", [
    ({}, None), ({"OMPI_COMM_WORLD_SIZE": "4"}, 4), ({"PMI_SIZE": "2"}, 2)])
def test_mpirun_size_reads_open_mpi_and_mpich(environ, want):
    assert mpirun_size(environ) == want


def test_without_mpi4py_mpiruns_processes_refuse_to_train_alone(monkeypatch):
    for name in ("TF_CONFIG", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails
    with pytest.raises(ValueError, match=r"mpirun started 2 processes, but mpi4py does not "
                                         r"import \(.*\): without it they cannot find each "
                                         r"other, and each would train alone"):
        environment.cluster_from_environment()


def test_the_environments_cluster_is_tf_config_then_a_slurm_step_then_none(monkeypatch):
    for name in ("TF_CONFIG", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert environment.cluster_from_environment() is None
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[01-02]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1(x2)")
    found = environment.cluster_from_environment()
    assert (found.rank, found.num_workers) == (1, 2)
    assert [found.address(r) for r in range(2)] == ["node01:8888", "node02:8888"]
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:2222", '
                                    '"127.0.0.1:2223"]}, "task": {"type": "worker", "index": 0}}')
    found = environment.cluster_from_environment()  # TF_CONFIG first
    assert found.rank == 0 and found.address(1) == "127.0.0.1:2223"


def _value(rank, dtype):
    """The transport worker's input of rank r (tests/workers/mpi_transport_worker.py)."""
    x = np.arange(6).reshape(2, 3) + 3 * rank
    return x % 2 == 0 if dtype == "bool" else x.astype(np.float64)


@pytest.mark.slow
def test_eager_collectives_over_the_mpi_transport_equal_numpy(tmp_path):
    rows = run_mpirun(tmp_path, 2, "--case", "collectives", worker=TRANSPORT_WORKER)
    a, b = _value(0, "float64"), _value(1, "float64")
    for rank, row in enumerate(rows):
        assert row["mpi_enabled"] is True
        for dtype, (got, got_dtype) in row["allreduce"].items():
            want = (_value(0, "bool") | _value(1, "bool")) if dtype == "bool" else a + b
            assert (got, got_dtype) == (want.tolist(), dtype), dtype
        for dtype, got in row["average"].items():
            mean = (a + b) / 2
            assert got == (np.trunc(mean) if "int" in dtype else mean).tolist(), dtype
            assert row["min"][dtype] == a.tolist() and row["max"][dtype] == b.tolist()
        assert row["fused"] == row["unfused"]  # fused in buffers per dtype, in order
        mean = (a + b) / 2
        assert [v for v, _ in row["fused"]] == [
            (np.trunc(mean) if d == "int32" else mean).tolist() for d in (
                "float32", "int32", "float32", "float64", "float32")]
        assert [d for _, d in row["fused"]] == ["float32", "int32", "float32", "float64",
                                               "float32"]
        assert row["allgather"] == [[0, 0], [1, 1], [1, 1]]
        assert row["broadcast"] == row["broadcast_variables"] == b.tolist()
        scattered = (a + b).reshape(3, 2)
        assert row["reducescatter"] == scattered[[0, 1] if rank == 0 else [2]].tolist()
        want_rows = [[0], [10]] if rank == 0 else [[1], [2], [3], [11], [12], [13]]
        assert row["alltoall"] == [want_rows, [1, 1] if rank == 0 else [3, 3]]
        kind, message = row["mismatch"]
        assert kind == "CallMismatchError" and re.search(
            rf"^worker {rank} \(127\.0\.0\.1:\d+\): the processes made different collective "
            r"calls.*worker 0 .*: allreduce 'loss' \(average, none, 1.0, 1.0\) of float32 "
            r"\[3\]; worker 1 .*: allgather 'loss' of float32 \[None\]", message)
        assert row["after"] == [2.0, 4.0]  # the transport goes on after the mismatch
        kept = row["prepared"]  # the prepared path: the general one's values and description
        assert kept["taken"] == [True, rank == 1]  # kept for the calls the tape did not watch
        assert kept["fast"][0] == kept["fast"][1] == kept["general"]  # bit for bit
        assert kept["general"][1] == ((a / 7 + b / 7) * 0.5).tolist()  # the sum times 1 / size
        for got, rel in zip(kept["general"], (1e-6, 1e-15, 1e-3, 1e-6)):
            assert np.allclose(got, (a + b) / 14, rtol=rel, atol=0)
        assert kept["descriptions"] == ["allreduce (average, none, 1.0, 1.0) of float32 [2, 3], "
                                        "float64 [2, 3], float16 [2, 3], float32 [2, 3]"] * 3
        assert kept["mixed"] == [(a + b).tolist(),
                                 "allreduce 'steps' (sum, none, 1, 1.0) of int64 [2, 3]"]
        kind, message = kept["mismatch"]
        assert kind == "CallMismatchError" and re.search(
            r"worker 0 .*: allreduce 'grad' \(average, none, 1.0, 1.0\) of float32 \[3\]; "
            r"worker 1 .*: allreduce 'grad' \(average, none, 1.0, 1.0\) of float32 \[4\]",
            message), message


@pytest.mark.slow
def test_a_frozen_rank_is_named_by_the_survivors_call_on_the_mpi_transport(tmp_path):
    done = mpirun(2, TRANSPORT_WORKER, "--out", tmp_path, "--case", "frozen")
    # The survivor's exit ends the job (MPI_Abort: mpirun stops the frozen
    # rank too) instead of waiting in MPI's finalize for it, or crashing there.
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Segmentation fault" not in done.stderr
    row = json.loads((tmp_path / "rank-0.json").read_text())
    kind, message = row["raised"]
    assert kind == "WorkerLostError"
    assert re.search(r"worker 1 \(127\.0\.0\.1:\d+\) has sent no heartbeat for 3 s: frozen, "
                     r"stopped or cut off; this worker waits in allreduce", message), message


def test_the_mpi_transport_outside_mpirun_is_refused_and_auto_falls_back(monkeypatch):
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    describe = "worker {}".format
    assert mpi_transport.open_transport("auto", 0, 2, describe) is None
    assert mpi_transport.open_transport("grpc", 0, 2, describe) is None
    with pytest.raises(ValueError, match=r"^worker 0: transport='mpi' needs the cluster's 2 "
                                         r"processes started by mpirun \(mpirun -np 2 \.\.\.\); "
                                         r"this process was not started by mpirun"):
        mpi_transport.open_transport("mpi", 0, 2, describe)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(ValueError, match=r"^worker 0: transport='mpi' needs mpi4py, which does "
                                         r"not import"):
        mpi_transport.open_transport("mpi", 0, 2, describe)
    with pytest.raises(ValueError, match=r"transport must be one of 'auto', 'grpc', 'mpi', "
                                         r"got 'gloo'"):
        Cluster({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "worker", 0, transport="gloo")


def test_the_mpi_transport_needs_mpiruns_processes(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"^worker 1: transport='mpi' needs the cluster's 2 "
                                         r"processes started by mpirun \(mpirun -np 2 \.\.\.\); "
                                         r"this process is one of 3"):
        mpi_transport.open_transport("mpi", 1, 2, "worker {}".format)


@pytest.mark.parametrize("sizes, threshold, runs", [
    ([4, 4, 4], 8, [[0, 1], [2]]), ([4, 4, 4], 0, [[0], [1], [2]]),
    ([16, 4], 8, [[0], [1]]), ([1, 2, 3], 64 << 20, [[0, 1, 2]])])
def test_fusion_fills_buffers_in_order_up_to_the_threshold(sizes, threshold, runs):
    assert mpi_calls._fused(sizes, threshold) == runs


def test_a_bad_fusion_threshold_is_named(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "64MB")
    with pytest.raises(ValueError, match=r"HOROVOD_FUSION_THRESHOLD='64MB': give a number of "
                                         r"bytes >= 0 \(0: no fusion\)"):
        mpi_calls.fusion_threshold()


def test_a_fused_buffer_holds_each_tensor_at_an_aligned_offset_in_order():
    tensors = [tf.zeros(s, d) for d, s in (("float32", [2, 3]), ("int32", [5]), ("float32", []),
                                           ("float64", [3]), ("float32", [4, 4]))]
    signature = mpi_calls.signature(tensors)
    assert signature == ((tf.float32.as_datatype_enum, (2, 3)), (tf.int32.as_datatype_enum, (5,)),
                         (tf.float32.as_datatype_enum, ()), (tf.float64.as_datatype_enum, (3,)),
                         (tf.float32.as_datatype_enum, (4, 4)))
    runs = mpi_calls.fused_layout(signature, 64 << 20)
    # float32: 6 elements, padded to 16 (64 bytes); the scalar at 16, padded to 32; then 16.
    dtype, total, members, fills = runs[0]
    assert (dtype, total, members) == (tf.float32, 48, [(0, 0, 6, (2, 3)), (2, 16, 17, ()),
                                                        (4, 32, 48, (4, 4))])
    assert [f if type(f) is int else (f.dtype, f.shape, f.any()) for f in fills] == [
        0, (np.float32, (10,), False), 2, (np.float32, (15,), False), 4]
    assert runs[1] == (tf.int32, None, [(1, 0, 5, None)], [])  # alone: its own memory
    assert runs[2] == (tf.float64, None, [(3, 0, 3, None)], [])
    assert mpi_calls.fused_layout(signature, 64 << 20) is runs  # computed once per signature
    assert [r[1] for r in mpi_calls.fused_layout(signature, 0)] == [None] * 5
