"""Elastic training: ``tfreduce-launch --workers MIN:MAX`` and ``hvd.elastic``.

The jobs run tests/workers/elastic_worker.py (a Horovod elastic custom
loop committing after every step) on loopback: a worker killed with
SIGKILL leaves and the survivors go on from the last commit; a slot added
to the discovery file joins at the next commit; below MIN the job waits,
then ends naming the directory of the commits. The final weights equal
NumPy's SGD with momentum on the same global batches, whatever the sizes
the job ran at.
"""

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import zygote
from tfreduce import launch
from tfreduce.workers import generations
from tfreduce.workers.elastic_launch import _Slots

WORKER = Path(__file__).parent / "workers" / "elastic_worker.py"


def run_job(launcher, worker_args=(), timeout=200, worker=WORKER):
    """`worker` under the launcher with `launcher`'s options: (code, stdout, stderr)."""
    command = [sys.executable, "-m", "tfreduce.launch", *launcher, "--timeout", str(timeout),
               "--preload", "tensorflow", "--", sys.executable, str(worker),
               *[str(a) for a in worker_args]]
    done = zygote.run(command, timeout=timeout + 30, cwd=Path(__file__).parent.parent)
    return done.returncode, done.stdout, done.stderr


def expected_weights(steps):
    """SGD(0.1, momentum 0.5) on the worker's global batches, in float64 (NumPy)."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        import elastic_worker
    finally:
        sys.path.pop(0)
    w, b = np.zeros((3, 1)), 0.0
    vw, vb = np.zeros((3, 1)), 0.0
    for step in range(steps):
        x, y = (a.astype(np.float64) for a in elastic_worker.batch(step))
        error = x @ w + b - y
        gw, gb = 2 * x.T @ error / len(x), 2 * error.sum() / len(x)
        vw, vb = 0.5 * vw - 0.1 * gw, 0.5 * vb - 0.1 * gb
        w, b = w + vw, b + vb
    return w, b


def steps_of(out):
    """[(generation, rank, size, step)] of rank 0's lines."""
    return [tuple(map(int, m)) for m in re.findall(r"\[worker \d\] step (\d+) (0) (\d+) (\d+)",
                                                    out)]


def final_weights(out):
    line = re.search(r'\[worker 0\] (\{"weights".*)', out).group(1)
    kernel, bias = json.loads(line)["weights"]
    return np.array(kernel), bias[0]


def discovery(tmp_path, text):
    hosts = tmp_path / "hosts"
    hosts.write_text(text)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return hosts, script


@pytest.mark.slow
def test_a_killed_worker_leaves_and_the_survivors_go_on_from_the_last_commit():
    code, out, err = run_job(("--workers", "2:3", "--slot-cooldown", "600"),
                             ("--kill-id", 2, "--kill-step", 5))
    assert code == 0, err[-3000:]
    assert re.search(r"\[launch\] generation 0: 3 workers, ids 0 \(127\.0\.0\.1:0\), 1 "
                     r"\(127\.0\.0\.1:1\), 2 \(127\.0\.0\.1:2\)", err)
    assert ("[launch] worker 2 (rank 2) was killed by SIGKILL: the job re-forms from the last "
            "commit") in err
    assert re.search(r"\[launch\] generation 1: 2 workers, ids 0 \(127\.0\.0\.1:0\), 1 "
                     r"\(127\.0\.0\.1:1\)", err)
    assert "[launch] all workers finished after" in err and "(1 re-forming)" in err
    # Steps 1-5 at 3 workers, committed; 6-12 at 2, from the commit: none done twice.
    assert steps_of(out) == [(0, 0, 3, s) for s in range(1, 6)] + [
        (1, 0, 2, s) for s in range(6, 13)]
    kernel, bias = final_weights(out)
    want_kernel, want_bias = expected_weights(12)
    np.testing.assert_allclose(kernel, want_kernel, atol=1e-5)
    assert abs(bias - want_bias) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("when", [("--grow-step", 4), ("--grow-at-start",)],
                         ids=["mid-training", "while-starting"])
def test_a_slot_added_to_the_discovery_joins_at_the_next_commit(tmp_path, when):
    # Also when the slot is announced before the generation's state exists:
    # the update counts from the generation's start, not from the state's.
    hosts, script = discovery(tmp_path, "127.0.0.1:2\n")
    code, out, err = run_job(("--workers", "2:3", "--host-discovery-script", str(script)),
                             ("--steps", 60, "--grow-file", hosts, *when, "--sleep", 0.1))
    assert code == 0, err[-3000:]
    assert "[launch] slot 127.0.0.1:2 added: the workers re-form at their next commit" in err
    assert "tfreduce elastic: the job's hosts changed at a commit: it re-forms" in err
    seen = steps_of(out)
    # Every step once: the update is seen at one commit by every worker, nothing rolls back.
    assert [s for _, _, _, s in seen] == list(range(1, 61))
    assert {(g, n) for g, _, n, _ in seen} == {(0, 2), (1, 3)}
    kernel, bias = final_weights(out)
    want_kernel, want_bias = expected_weights(60)
    np.testing.assert_allclose(kernel, want_kernel, atol=1e-5)
    assert abs(bias - want_bias) < 1e-5


@pytest.mark.slow
def test_below_the_minimum_the_job_waits_then_ends_naming_its_commits():
    code, out, err = run_job(("--workers", "2:2", "--slot-cooldown", "600", "--elastic-timeout",
                              "2"), ("--kill-id", 1, "--kill-step", 3))
    assert code == 1, err[-3000:]
    assert ("[launch] 1 worker available, fewer than the minimum 2: waiting up to 2s for "
            "slots") in err
    assert "[launch] still 1 worker after 2s, fewer than the minimum 2: the job ends" in err
    kept = re.search(r"\[launch\] the last commits are kept in (\S+)", err).group(1)
    assert sorted(os.listdir(kept)) == ["worker-0.commit", "worker-1.commit"]


@pytest.mark.parametrize("argv, message", [
    (["--workers", "3:2"], "the workers must satisfy 1 <= MIN <= MAX, got MIN=3, MAX=2"),
    (["--workers", "1:2", "--restarts", "1"], "--restarts is for a fixed-size job"),
    (["--workers", "x:2"], "argument --workers: invalid worker_counts value: 'x:2'"),
])
def test_bad_elastic_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        launch.parse_args(argv + ["--", "python", "train.py"])
    assert message in capsys.readouterr().err


def test_horovods_spelling_of_the_bounds_and_the_discovery(tmp_path):
    args = launch.parse_args(["--workers", "2", "--min-workers", "1", "--max-workers", "4",
                              "--", "python", "t.py"])
    assert (args.elastic, args.min_workers, args.workers) == (True, 1, 4)
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho 127.0.0.1:2\necho node7:4\necho localhost:1\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    args.host_discovery_script = str(script)
    logged = []
    slots = _Slots(args, logged.append)
    assert slots.current() == ["127.0.0.1:0", "127.0.0.1:1", "localhost:0"]
    assert slots.current() == ["127.0.0.1:0", "127.0.0.1:1", "localhost:0"]
    assert logged == ["host discovery: 'node7:4' skipped: this launcher starts workers on this "
                      "machine only ('127.0.0.1:SLOTS')"]  # named once


def test_a_commit_replaces_the_last_one_whole(tmp_path):
    generations.write_commit(str(tmp_path), 3, b"first")
    # A writer killed mid-write leaves a partial file, never a broken commit.
    (tmp_path / "worker-3.commit.partial").write_bytes(b"half")
    assert generations.read_commit(str(tmp_path), 3) == b"first"
    generations.write_commit(str(tmp_path), 3, b"second")
    assert generations.read_commit(str(tmp_path), 3) == b"second"
    assert generations.read_commit(str(tmp_path), 4) is None
    worker = generations.elastic_worker({generations.DIR_ENV: str(tmp_path),
                                         generations.ID_ENV: "3",
                                         generations.GENERATION_ENV: "1",
                                         generations.UPDATES_ENV: "1"})
    assert (worker.worker_id, worker.generation, worker.read_commit()) == (3, 1, b"second")
    assert worker.updates_at_start == 1
    assert worker.hosts_updates() == 0
    generations.write_hosts_updates(str(tmp_path), 2)
    assert worker.hosts_updates() == 2
    with pytest.raises(ValueError, match="TFREDUCE_WORKER_ID='x' and TFREDUCE_GENERATION='1' "
                                         "must be ints"):
        generations.elastic_worker({generations.DIR_ENV: "d", generations.ID_ENV: "x",
                                    generations.GENERATION_ENV: "1"})


@pytest.mark.slow
def test_a_host_removed_from_the_discovery_leaves_at_the_next_commit(tmp_path):
    hosts, script = discovery(tmp_path, "localhost:1\n127.0.0.1:2\n")
    code, out, err = run_job(("--workers", "2:3", "--host-discovery-script", str(script),
                              "--discovery-interval", "0.5"),
                             ("--steps", 40, "--grow-file", hosts, "--grow-step", 4,
                              "--hosts-text", "127.0.0.1:2", "--sleep", 0.1))
    assert code == 0, err[-3000:]
    assert ("[launch] slot localhost:0 is gone from the discovery: worker 0 leaves at the next "
            "commit") in err
    assert re.search(r"\[launch\] generation 1: 2 workers, ids 1 \(127\.0\.0\.1:0\), 2 "
                     r"\(127\.0\.0\.1:1\)", err)
    seen = steps_of(out)
    assert [s for _, _, _, s in seen] == list(range(1, 41))  # nothing rolls back
    kernel, bias = final_weights(out)
    want_kernel, want_bias = expected_weights(40)
    np.testing.assert_allclose(kernel, want_kernel, atol=1e-5)


@pytest.mark.slow
def test_a_failed_workers_host_sits_out_and_a_reset_limit_ends_the_job(tmp_path):
    # Two hosts: the killed worker's whole host rests (Horovod's blacklist).
    _, script = discovery(tmp_path, "localhost:1\n127.0.0.1:2\n")
    code, out, err = run_job(("--workers", "1:3", "--host-discovery-script", str(script)),
                             ("--kill-id", 2, "--kill-step", 3))
    assert code == 0, err[-3000:]
    assert re.search(r"\[launch\] generation 1: 1 worker, ids 0 \(localhost:0\)", err), err
    # The same job with --reset-limit 0 ends at its first re-forming.
    code, out, err = run_job(("--workers", "1:3", "--host-discovery-script", str(script),
                              "--reset-limit", "0"), ("--kill-id", 2, "--kill-step", 3))
    assert code == 1
    assert re.search(r"\[launch\] --reset-limit 0 reached: the job would re-form once more; it "
                     r"ends, and the last commits are kept in \S+", err), err


@pytest.mark.slow
def test_a_second_failure_during_the_recovery_is_one_more_re_forming():
    # Worker 3 dies at step 5; in the generation that follows, worker 2 dies
    # at its first step, before any new commit: the job re-forms again from
    # the same commit and finishes on 2 workers, nothing lost.
    code, out, err = run_job(("--workers", "2:4", "--slot-cooldown", "600"),
                             ("--kill-id", 3, "--kill-step", 5, "--kill-again", "1:2:5"))
    assert code == 0, err[-3000:]
    assert "[launch] worker 3 (rank 3) was killed by SIGKILL" in err
    assert "[launch] worker 2 (rank 2) was killed by SIGKILL" in err
    assert re.search(r"\[launch\] generation 2: 2 workers, ids 0 \(127\.0\.0\.1:0\), 1 "
                     r"\(127\.0\.0\.1:1\)", err)
    assert "(2 re-formings)" in err
    assert [s for _, _, _, s in steps_of(out)] == list(range(1, 13))
    kernel, bias = final_weights(out)
    want_kernel, want_bias = expected_weights(12)
    np.testing.assert_allclose(kernel, want_kernel, atol=1e-5)


@pytest.mark.slow
def test_a_stopped_elastic_job_says_where_its_commits_are():
    commit_then_wait = ("import os, time; from tfreduce.workers import generations as g; "
                        "g.write_commit(os.environ[g.DIR_ENV], int(os.environ[g.ID_ENV]), b'x'); "
                        "time.sleep(60)")
    done = subprocess.run([sys.executable, "-m", "tfreduce.launch", "--workers", "1:2",
                           "--timeout", "3", "--", sys.executable, "-c", commit_then_wait],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 124, done.stderr
    assert "[launch] --timeout 3s reached: stopping every worker" in done.stderr
    kept = re.search(r"\[launch\] the last commits are kept in (\S+tfreduce-elastic-\S+)",
                     done.stderr)
    assert kept, done.stderr
    assert sorted(os.listdir(kept.group(1))) == ["worker-0.commit", "worker-1.commit"]
    # Stopped before any commit: nothing is kept, and the directory is gone.
    done = subprocess.run([sys.executable, "-m", "tfreduce.launch", "--workers", "1:2",
                           "--timeout", "1", "--", sys.executable, "-c",
                           "import time; time.sleep(60)"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 124 and "kept in" not in done.stderr, done.stderr
