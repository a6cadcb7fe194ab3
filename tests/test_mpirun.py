"""Processes that ``mpirun`` started find each other over MPI (mpi4py); the environment's cluster.

``hvd.init()`` and ``ReplicatedTrainer(cluster="auto")`` form the TF
cluster of ``mpirun -np N``'s processes, ranked as MPI ranks them, on
loopback when all share one host; without mpi4py they refuse, naming it,
rather than each train alone. The runs under mpirun skip, saying why,
where Open MPI or mpi4py is not installed (.ci/run installs both).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tfreduce.basis.tf_config import mpirun_size, mpirun_tf_config, parse_tf_config
from tfreduce.workers import environment

WORKER = Path(__file__).parent / "workers" / "mpirun_worker.py"


def have_mpi():
    if shutil.which("mpirun") is None:
        return "mpirun is not installed (Debian's openmpi-bin)"
    if subprocess.run([sys.executable, "-c", "import mpi4py"]).returncode != 0:
        return "mpi4py is not installed (pip install mpi4py)"
    return None


def run_mpirun(tmp_path, np, *args):
    """The worker under ``mpirun -np np``: each rank's JSON, in rank order."""
    why = have_mpi()
    if why:
        pytest.skip(why)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("TF_CONFIG", None)
    done = subprocess.run(["mpirun", "-np", str(np), "--oversubscribe", "--bind-to", "none",
                           sys.executable, str(WORKER), "--out", str(tmp_path), *args],
                          capture_output=True, text=True, env=env, timeout=240)
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
