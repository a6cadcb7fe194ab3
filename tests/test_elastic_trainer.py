"""``ReplicatedTrainer.fit`` in an elastic job: commits, the resume, re-forming, and the bits.

The jobs run tests/workers/elastic_trainer_worker.py (``deterministic=True``,
one CPU device per worker) on loopback under ``tfreduce-launch --workers
2:4 --worker-counts 1,2,4``: 4 workers of which one is killed with SIGKILL
after step 23, and 2 workers (a third slot a spare) joined by two more at
a host update after step 20. Each ends on the sha256 of the uninterrupted
4-worker run. The
in-process tests drive one trainer through the same environment the
launcher gives its workers.
"""

import json
import re
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import test_elastic
import tfreduce
import zygote
from tfreduce import launch
from tfreduce.workers import generations
from tfreduce.workers.elastic_launch import _Job

WORKER = Path(__file__).parent / "workers" / "elastic_trainer_worker.py"
ELASTIC = ["--workers", "2:4", "--worker-counts", "1,2,4"]


def run_job(launcher, worker_args=()):
    """The worker under the launcher with `launcher`'s options: (code, stdout, stderr)."""
    return test_elastic.run_job(launcher, worker_args, worker=WORKER)


def result(out):
    return json.loads(re.search(r'\[worker 0\] (\{"sha256".*)', out).group(1))


def rank0_steps(out):
    """[(generation, workers, steps taken)] of rank 0's step lines."""
    return [(int(g), int(w), int(s))
            for g, w, s in re.findall(r"\[worker \d\] step (\d+) 0 (\d+) (\d+)", out)]


@pytest.fixture(scope="module")
def uninterrupted():
    code, out, err = run_job(["--workers", "4"])
    assert code == 0, err[-3000:]
    return result(out)


@pytest.mark.slow
def test_a_deterministic_fit_that_loses_a_worker_ends_on_the_bits_of_the_uninterrupted_run(
        uninterrupted):
    code, out, err = run_job(ELASTIC, ["--kill-id", "0", "--kill-step", "23"])
    assert code == 0, err[-3000:]
    assert "[launch] worker 0 (rank 0) was killed by SIGKILL" in err
    # 3 survivors; the deterministic step runs on 2 of them, the third waits.
    assert re.search(r"\[launch\] generation 1: 2 workers, ids 1 \(\S+\), 2 \(\S+\)", err)
    assert "[launch] slot 127.0.0.1:3 waits as a spare" in err
    # Back to the last commit (every 5 steps): steps 21-23 are run again.
    assert "generation 1 resumes at step 20" in err
    steps = rank0_steps(out)
    assert [s for g, w, s in steps if g == 0] == list(range(1, 24))
    assert [(w, s) for g, w, s in steps if g == 1] == [(2, s) for s in range(21, 41)]
    assert result(out) == uninterrupted


@pytest.mark.slow
def test_a_deterministic_fit_that_gains_workers_ends_on_the_same_bits(tmp_path, uninterrupted):
    hosts, script = test_elastic.discovery(tmp_path, "127.0.0.1:3\n")
    code, out, err = run_job(
        ELASTIC + ["--host-discovery-script", str(script), "--discovery-interval", "0.5"],
        ["--grow-file", hosts, "--grow-step", "20", "--hosts-text", "127.0.0.1:4",
         "--sleep", "0.1"])
    assert code == 0, err[-3000:]
    assert "[launch] generation 0: 2 workers" in err
    assert "[launch] generation 1: 4 workers" in err
    committed = int(re.search(r"every worker committed step (\d+)", err).group(1))
    assert f"generation 1 resumes at step {committed}" in err
    steps = rank0_steps(out)
    # A host update loses nothing: generation 1 goes on from the step after.
    assert [s for g, w, s in steps if g == 0] == list(range(1, committed))
    assert [(w, s) for g, w, s in steps if g == 1] == [(4, s) for s in range(committed + 1, 41)]
    assert result(out) == uninterrupted


@pytest.mark.slow
def test_sizes_a_deterministic_fit_cannot_run_at_end_the_job_with_the_fix():
    code, out, err = run_job(["--workers", "2:3"])
    assert code == 1
    assert ("deterministic=True with micro_batches=4 runs on 1, 2 or 4 towers, and this elastic "
            "job may form 3 worker(s) of 1 tower(s): start it with tfreduce-launch "
            "--worker-counts 1,2: the job cannot go on at any size; it ends") in err
    assert "generation 1" not in err
    assert "kept in" not in err  # no commit was made: the job's directory is removed


def test_a_job_whose_every_worker_fails_ends_at_once():
    done = zygote.run(
        [sys.executable, "-m", "tfreduce.launch", "--workers", "2:3", "--timeout", "60", "--",
         sys.executable, "-c", "import sys; sys.exit(3)"], timeout=90)
    assert done.returncode == 3
    assert "[launch] every worker failed (exit codes 3, 3, 3): the job ends" in done.stderr
    assert "generation 1" not in done.stderr and "kept in" not in done.stderr


def job(argv):
    args = launch.parse_args([*argv, "--", "python", "t.py"])
    return _Job(args, [].append)


@pytest.mark.parametrize("counts, slots, members, spares, ready", [
    ("1,2,4", 4, 4, 0, True), ("1,2,4", 3, 2, 1, True), ("2,4", 7, 4, 3, True),
    ("4", 3, 0, 3, False)])  # below every size: the job waits
def test_worker_counts_limit_the_sizes_and_the_rest_are_spares(counts, slots, members, spares,
                                                               ready):
    j = job(["--workers", "2:4", "--worker-counts", counts])
    j.fill([f"127.0.0.1:{n}" for n in range(slots)])
    assert (len(j.members), len(j.spares), j.ready()) == (members, spares, ready)


def test_survivors_beyond_the_size_wait_as_spares_the_youngest_first():
    j = job(["--workers", "2:4", "--worker-counts", "2,4"])
    j.fill([f"127.0.0.1:{n}" for n in range(4)])
    j.lose(0, "was killed")
    j.fill([f"127.0.0.1:{n}" for n in range(4)])  # slot 0 rests: 3 usable
    assert [m[0] for m in j.members] == [1, 2] and j.spares == ["127.0.0.1:3"]


@pytest.mark.parametrize("argv, message", [
    (["--workers", "2", "--worker-counts", "2"], "--worker-counts is for an elastic job"),
    (["--workers", "3:4", "--worker-counts", "1,2"],
     "--worker-counts 1,2 has no size between MIN=3 and MAX=4"),
    (["--workers", "1:4", "--worker-counts", "0,2"],
     "argument --worker-counts: invalid size_list value: '0,2'"),
])
def test_bad_worker_counts_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        launch.parse_args(argv + ["--", "python", "train.py"])
    assert message in capsys.readouterr().err


# ------------------------------------------------------- one process, the launcher's environment

def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(48, 3)).astype(np.float32)
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], np.float32))


def trainer():
    keras.utils.set_random_seed(0)
    return tfreduce.ReplicatedTrainer(
        lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]), "mse",
        lambda: keras.optimizers.SGD(0.05, momentum=0.5), devices=["/cpu:0"], cluster=None)


def assert_same_weights(a, b):
    for got, want in zip(a.models[0].get_weights(), b.models[0].get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def as_worker(monkeypatch, directory, worker_id, generation):
    monkeypatch.setenv(generations.DIR_ENV, str(directory))
    monkeypatch.setenv(generations.ID_ENV, str(worker_id))
    monkeypatch.setenv(generations.GENERATION_ENV, str(generation))


def uninterrupted_and_committed(tmp_path, monkeypatch):
    """A trainer after 3 epochs uninterrupted; worker 0 of generation 0 commits 2 epochs."""
    x, y = data()
    alone = trainer()
    alone.fit(x, y, epochs=3, batch_size=8, verbose=0)
    as_worker(monkeypatch, tmp_path, 0, 0)
    trainer().fit(x, y, epochs=2, batch_size=8, verbose=0, commit_every=4)
    return alone


def test_a_re_formed_generation_resumes_from_the_newest_commit_of_any_worker(
        tmp_path, monkeypatch, capsys):
    x, y = data()
    alone = uninterrupted_and_committed(tmp_path, monkeypatch)
    # Commits after steps 4, 6 (an epoch), 8 and 12 (an epoch too, one commit): 3 kept.
    assert sorted(p.name for p in (tmp_path / "trainer-0").glob("*.index")) == [
        "ckpt-2.index", "ckpt-3.index", "ckpt-4.index"]
    # Worker 1 of generation 1 (worker 0 lost) resumes from worker 0's last commit.
    as_worker(monkeypatch, tmp_path, 1, 1)
    second = trainer()
    second.fit(x, y, epochs=3, batch_size=8, verbose=0, commit_every=4)
    assert "generation 1 resumes at step 12 from " in capsys.readouterr().err
    assert second.step == 18
    assert_same_weights(second, alone)


def test_a_host_update_commits_the_step_and_leaves_to_re_form(tmp_path, monkeypatch, capsys):
    x, y = data()
    as_worker(monkeypatch, tmp_path, 0, 0)
    t = trainer()
    t.fit(x, y, epochs=1, batch_size=8, verbose=0)
    generations.write_hosts_updates(str(tmp_path), 1)
    with pytest.raises(SystemExit) as leaving:
        t.fit(x, y, epochs=2, batch_size=8, verbose=0, commit_every=100)
    assert leaving.value.code == generations.RESHAPE_CODE
    assert t.step == 7  # the first step of the fit saw the update
    assert ("the job's hosts changed: every worker committed step 7 and it re-forms (worker 0, "
            "generation 0)") in capsys.readouterr().err
    assert (tmp_path / "trainer-0" / "ckpt-2.index").exists()  # epoch 1's, then step 7's


def test_without_the_elastic_launcher_commit_every_is_checked_and_unused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x, y = data()
    t = trainer()
    with pytest.raises(ValueError, match=r"commit_every must be >= 1 steps, got 0"):
        t.fit(x, y, epochs=1, batch_size=8, verbose=0, commit_every=0)
    with pytest.raises(TypeError, match=r"commit_every must be None or an int, got float 2.0"):
        t.fit(x, y, epochs=1, batch_size=8, verbose=0, commit_every=2.0)
    t.fit(x, y, epochs=1, batch_size=8, verbose=0, commit_every=2)
    assert t.step == 6 and list(tmp_path.iterdir()) == []


def test_a_commit_cut_short_by_a_kill_is_passed_over_for_the_one_before(
        tmp_path, monkeypatch, capsys):
    x, y = data()
    alone = uninterrupted_and_committed(tmp_path, monkeypatch)
    # Worker 0 was killed while it wrote its commit of step 12: a truncated file.
    data_file = next((tmp_path / "trainer-0").glob("ckpt-4.data-*"))
    data_file.write_bytes(data_file.read_bytes()[:10])
    as_worker(monkeypatch, tmp_path, 1, 1)
    second = trainer()
    second.fit(x, y, epochs=3, batch_size=8, verbose=0, commit_every=4)
    err = capsys.readouterr().err
    assert re.search(r"trainer-0/ckpt-4 is damaged \(.+\); using \S+trainer-0/ckpt-3", err)
    assert "generation 1 resumes at step 8 from " in err
    assert_same_weights(second, alone)


def test_a_workers_commits_are_a_checkpoint_a_fixed_size_run_restores(tmp_path, monkeypatch):
    x, y = data()
    alone = uninterrupted_and_committed(tmp_path, monkeypatch)
    for name in (generations.DIR_ENV, generations.ID_ENV, generations.GENERATION_ENV):
        monkeypatch.delenv(name)
    later = trainer()
    assert later.restore(str(tmp_path / "trainer-0")).endswith("trainer-0/ckpt-4")
    later.fit(x, y, epochs=3, batch_size=8, verbose=0)
    assert later.step == 18
    assert_same_weights(later, alone)
