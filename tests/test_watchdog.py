"""The watchdog: a frozen worker is named and the others end, instead of a silent hang.

In one process, two Watchdogs of a 2-worker cluster (real UDP sockets on
127.0.0.1, ``on_stall`` instead of the abort) check the rules: a peer that
stops sending is named with its last heartbeat's state; a peer that says
goodbye, one never heard, or another run's datagrams are not. Under the
launcher, a worker that freezes itself (SIGSTOP) in each door ends the run
with the named line on the survivor; a worker that sleeps 50 ms before
each step is named a straggler, after a clean run of 1,000 steps that reports nothing.
"""

import json
import os
import re
import socket
import time
from pathlib import Path

import pytest

from tfreduce.workers import watchdog
from tfreduce.workers.cluster import Cluster
from tfreduce.launch import free_ports, parse_args
from tfreduce.workers.progress import IdleClock, measure, observe
from tfreduce.bench import faults_worker
from tfreduce.workers.stragglers import STRAGGLER_MS, stragglers, worker_medians
from tfreduce.workers.watchdog import Watchdog, progress, stall_seconds_from

from helpers import scalars
from test_multiworker import launch_workers


def pair(stall=1.0, timeout=300.0, workers=2):
    """Watchdogs of ranks 0, 1, ... of one cluster (not started), and the stalls each reported."""
    for attempt in range(5):
        # free_ports finds free TCP ports; a parallel test may hold the UDP
        # port of the same number (its watchdog): then other ports.
        spec = {"worker": [f"127.0.0.1:{p}" for p in free_ports(workers)]}
        fired = {r: [] for r in range(workers)}
        dogs = []
        try:
            for r in range(workers):
                dogs.append(Watchdog(Cluster(spec, "worker", r, timeout=timeout), stall,
                                     on_stall=fired[r].append))
            return dogs, fired
        except OSError:
            for dog in dogs:
                dog.beats.close()
            if attempt == 4:
                raise


def wait_for(condition, seconds=30.0):
    """Polls until condition() holds (a bound on the test, not an assertion on time)."""
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.05)
    return condition()


def test_a_peer_that_stops_sending_is_named_with_its_last_state():
    dogs, fired = pair()
    for dog in dogs:
        dog.start()
    try:
        with progress.within("training step 8"):
            progress.advance(7)
            assert wait_for(lambda: 1 in dogs[0].beats.heard and 0 in dogs[1].beats.heard)
            time.sleep(0.5)  # heartbeats with this state go out
            dogs[1]._stop.set()  # rank 1 freezes: it sends nothing more, and no goodbye
            assert wait_for(lambda: fired[0])
        assert re.fullmatch(
            r"worker 0 \(127\.0\.0\.1:\d+\): worker 1 \(127\.0\.0\.1:\d+\) has sent no heartbeat "
            r"for \d+ s: frozen, stopped or cut off \(its last heartbeat: training step 8 \(7 "
            r"steps done\)\); this worker waits in training step 8 \(7 steps done\)\. Stopping "
            r"them \(stall_seconds=1\)\.", fired[0][0]), fired[0][0]
        assert len(fired[0]) == 1 and dogs[0].fired == fired[0][0]
        assert fired[1] == []  # rank 0 kept sending
    finally:
        progress.advance(0)
        for dog in dogs:
            dog.goodbye()


@pytest.mark.slow
def test_a_peer_that_says_goodbye_or_was_never_heard_is_not_named():
    dogs, fired = pair()
    dogs[0].start()  # rank 1 never sends: it may still be starting
    time.sleep(2.5)
    assert fired[0] == []
    dogs[1].start()
    assert wait_for(lambda: 1 in dogs[0].beats.heard)
    dogs[1].goodbye()  # a clean exit
    time.sleep(2.5)
    assert fired[0] == [] and 1 in dogs[0].beats.gone
    dogs[0].goodbye()


@pytest.mark.slow  # the goodbye of a failure lingers 1.3 s
def test_a_peer_that_an_error_ended_stops_the_others_at_once(monkeypatch):
    monkeypatch.setattr(watchdog, "_FAILED_GRACE", 0.0)  # goodbye lingers 1.3 s, not 3.3
    monkeypatch.setattr(progress, "step", 0)  # whatever trained before in this process
    dogs, fired = pair(stall=600.0)  # no silence could fire within the test
    for dog in dogs:
        dog.start()
    try:
        with progress.within("training step 4"):
            assert wait_for(lambda: 1 in dogs[0].beats.heard and 0 in dogs[1].beats.heard)
            # What the interpreter sets for an uncaught exception, before atexit.
            monkeypatch.setattr("sys.last_value", ValueError("Shape mismatch: [3] vs [4]\n"
                                                              "more lines"), raising=False)
            dogs[1].goodbye()
            assert wait_for(lambda: fired[0])
        assert re.fullmatch(
            r"worker 0 \(127\.0\.0\.1:\d+\): worker 1 \(127\.0\.0\.1:\d+\) ended with ValueError: "
            r"Shape mismatch: \[3\] vs \[4\] \(training step 4\); this worker cannot go on "
            r"without it \(it was in training step 4\)\. Stopping them\.", fired[0][0]), fired[0]
        assert fired[1] == []
    finally:
        dogs[0].goodbye()


@pytest.mark.slow
def test_a_live_peer_behind_this_workers_step_is_warned_of_once():
    dogs, fired = pair(stall=1.0)
    dogs[0].start()  # rank 1's heartbeats are sent by hand: 2 steps done, outside its steps
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    beat = json.dumps({"run": dogs[0].beats.run, "rank": 1, "kind": "beat", "step": 2,
                       "doing": ""}).encode()
    try:
        with progress.within("training step 4"):
            progress.advance(3)
            end, more = time.monotonic() + 30, None
            while time.monotonic() < (more or end):
                sender.sendto(beat, ("127.0.0.1", dogs[0].beats.port))
                time.sleep(0.1)
                if dogs[0].reported and more is None:
                    more = time.monotonic() + 1.5  # the same step: no second warning
        assert len(dogs[0].reported) == 1 and fired[0] == []
        assert re.fullmatch(
            r"worker 0 \(127\.0\.0\.1:\d+\): worker 1 \(127\.0\.0\.1:\d+\) is alive but has not "
            r"come to training step 4 \(3 steps done\) for \d+ s \(its heartbeat: 2 steps done\); "
            r"it may be loading data, saving a checkpoint or stuck in its own code\. This worker "
            r"waits for it until the collectives' timeout \(\d+ s idle\)\.", dogs[0].reported[0])
    finally:
        progress.advance(0)
        dogs[0].goodbye()


LONG_WAIT = (r"worker 0 \(127\.0\.0\.1:\d+\): waited \d+ s, idle, in {mine}: the "
             r"collectives' timeout \(2 s\); {who}\. Stopping them\.")
BEHIND = r"worker 1 \(127\.0\.0\.1:\d+\) has not come to it \(alive, but stuck or much slower\)"


@pytest.mark.parametrize("steps_done, busy, peer, who", [
    (3, False, (2, ""), BEHIND),
    (3, False, (3, "training step 4"), r"every peer that still sends is in it too: the workers "
                                       r"may run different programs \(other models, shapes, or "
                                       r"collectives in another order\)"),
    (0, False, (0, ""), BEHIND),
    (0, True, (0, ""), None),
], ids=["peer-behind", "peer-in-it", "first-step", "busy"])
@pytest.mark.slow
def test_a_wait_as_long_as_the_timeout_is_ended(monkeypatch, steps_done, busy, peer, who):
    # The ops carry no timeout while the watchdog runs (Cluster.op_timeout):
    # it ends a wait it sees after the cluster's timeout of idle seconds. A
    # process that works (a first step tracing for minutes) is not waiting.
    monkeypatch.setattr(progress, "step", steps_done)
    dogs, fired = pair(stall=600.0, timeout=2.0)  # no silence could fire within the test
    dogs[0].start()  # rank 1's heartbeats are sent by hand
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    beat = json.dumps({"run": dogs[0].beats.run, "rank": 1, "kind": "beat", "step": peer[0],
                       "doing": peer[1]}).encode()
    doing = f"training step {steps_done + 1}"
    try:
        with progress.within(doing):
            end = time.monotonic() + (30 if who else 5)  # 5: over twice the timeout
            while not fired[0] and time.monotonic() < end:
                sender.sendto(beat, ("127.0.0.1", dogs[0].beats.port))
                pause = time.monotonic() + 0.1
                while busy and time.monotonic() < pause:
                    sum(range(1000))  # a core's work, as tracing does
                time.sleep(0 if busy else 0.1)
        if who is None:
            assert fired[0] == []
            return
        mine = re.escape(f"{doing} (3 steps done)" if steps_done else doing)
        assert len(fired[0]) == 1, fired[0]
        assert re.fullmatch(LONG_WAIT.format(mine=mine, who=who), fired[0][0]), fired[0][0]
    finally:
        dogs[0].goodbye()


@pytest.mark.slow
def test_a_custom_loops_idle_tensorflow_call_is_a_wait_too(monkeypatch):
    # A Horovod-style loop tells nothing (progress.doing is None): the wait is
    # the main thread's TensorFlow call, here a graph idle in a py_function.
    import tensorflow as tf
    monkeypatch.setattr(progress, "step", 0)
    dogs, fired = pair(stall=600.0, timeout=2.0)
    dogs[0].start()
    # 10 s: the 2 s of idleness fit in it however slowly a loaded host starts the call.
    idle = tf.function(lambda: tf.py_function(lambda: time.sleep(10) or 1.0, [], tf.float32))
    try:
        idle()
        assert len(fired[0]) == 1, fired[0]
        assert re.fullmatch(LONG_WAIT.format(
            mine=r"a TensorFlow call of the main thread \(quick_execute\)",
            who=r"worker 1 \(127\.0\.0\.1:\d+\) has sent no heartbeat \(not started, or UDP "
                r"between the hosts is blocked\)"), fired[0][0]), fired[0][0]
    finally:
        dogs[0].goodbye()


def test_the_idle_clock_counts_unbroken_idle_seconds_in_one_wait():
    clock, a, b = IdleClock(share=0.1), (object(), "a"), (object(), "b")
    assert clock.tick(0.0, 5.0, a) == 0.0  # the wait begins
    assert clock.tick(1.0, 5.05, a) == 1.0  # 0.05 s of CPU in 1 s: idle
    assert clock.tick(3.0, 5.2, a) == 3.0
    assert clock.tick(4.0, 5.7, a) == 0.0  # half a core: work, the count starts again
    assert clock.tick(5.0, 5.7, a) == 1.0
    assert clock.tick(6.0, 5.7, b) == 0.0 and clock.wait is b  # another wait
    assert clock.tick(7.0, 5.7, None) == 0.0 and clock.wait is None  # outside any wait
    assert clock.tick(8.0, 5.7, b) == 0.0  # the same wait again is a new one
    assert clock.tick(9.5, 5.7, b) == 1.5
    clock.forget()
    assert (clock.wait, clock.idle) == (None, 0.0)


def test_the_long_wait_names_peers_unheard_or_ended_and_spares_a_worker_left_alone(
        monkeypatch):
    # No clock and no socket: _end_long_wait is judged at given times, CPU still.
    dogs, fired = pair(stall=600.0, timeout=2.0, workers=3)
    for dog in dogs[1:]:
        dog.goodbye()
    wait = (object(), "a TensorFlow call of the main thread (quick_execute)")
    monkeypatch.setattr(watchdog, "_current_wait", lambda: wait)
    monkeypatch.setattr(watchdog.time, "process_time", lambda: 7.0)
    monkeypatch.setattr(progress, "doing", None)
    dog = dogs[0]
    try:
        dog.beats.gone = {1, 2}  # every peer said goodbye: what is left is this worker's own
        for now in range(6):
            dog._end_long_wait(float(now))
        assert fired[0] == []
        with progress.within("training step 4"):  # ... but a step told can no longer finish
            told = (object(), "training step 4")
            monkeypatch.setattr(watchdog, "_current_wait", lambda: told)
            for now in range(6, 10):
                dog._end_long_wait(float(now))
        assert len(fired[0]) == 1
        assert re.fullmatch(LONG_WAIT.format(
            mine="training step 4", who=r"worker 1 \(127\.0\.0\.1:\d+\), worker 2 "
                                    r"\(127\.0\.0\.1:\d+\) have ended"), fired[0][0]), fired[0][0]
        fired[0].clear()
        monkeypatch.setattr(watchdog, "_current_wait", lambda: wait)
        dog.beats.gone = {1}  # one ended, one never heard
        dog.beats.heard = {1: (0.0, {"step": 3, "doing": ""})}
        for now in range(10, 14):  # the abort let the last wait go: this one counts anew
            dog._end_long_wait(float(now))
        assert len(fired[0]) == 1
        assert re.fullmatch(LONG_WAIT.format(
            mine=re.escape(wait[1]),
            who=r"worker 2 \(127\.0\.0\.1:\d+\) has sent no heartbeat \(not started, or UDP "
                r"between the hosts is blocked\); worker 1 \(127\.0\.0\.1:\d+\) has ended"),
            fired[0][0]), fired[0][0]
        assert dog._clock.wait is None  # the wait's frame is let go
    finally:
        dog.goodbye()


@pytest.mark.slow
def test_datagrams_of_another_run_are_ignored():
    dogs, fired = pair()
    dogs[0].start()
    try:
        stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        beat = json.dumps({"run": "another", "rank": 1, "kind": "beat", "step": 3,
                           "doing": ""}).encode()
        stranger.sendto(beat, ("127.0.0.1", dogs[0].beats.port))
        time.sleep(2.5)
        assert dogs[0].beats.heard == {} and fired[0] == []
    finally:
        dogs[0].goodbye()


def test_the_worker_the_others_wait_for_is_the_straggler():
    def name(rank):
        return f"worker {rank}"
    # Rank 2 sleeps outside its steps: inside them it waits for nobody.
    assert stragglers({0: 55.0, 1: 54.0, 2: 4.0, 3: 56.0}, name) == [
        "worker 2 lags: the other workers wait about 51 ms per step for it (its steps take 4 ms "
        "inside, theirs 55 ms, over the last 20 steps)"]
    # Jitter is not lag: under 20 ms, or under half the others' time.
    assert stragglers({0: 15.0, 1: 1.0}, name) == []
    assert stragglers({0: 300.0, 1: 200.0}, name) == []
    assert stragglers({0: 80.0}, name) == []


def test_steps_are_timed_counted_and_told():
    before = progress.step
    with progress.timed():
        assert progress.doing == f"training step {before + 1}"
    assert progress.step == before + 1 and progress.doing is None
    assert len(progress.durations) >= 1


def test_the_bound_comes_from_the_argument_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv(watchdog.STALL_ENV, raising=False)
    assert stall_seconds_from() == watchdog.DEFAULT_STALL_SECONDS == 20.0
    monkeypatch.setenv(watchdog.STALL_ENV, "7.5")
    assert stall_seconds_from() == 7.5 and stall_seconds_from(0) == 0.0
    spec = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    assert Cluster(spec, "worker", 0).stall_seconds == 7.5
    assert Cluster(spec, "worker", 0, stall_seconds=3).stall_seconds == 3.0
    for bad in (-1, "soon"):
        with pytest.raises(ValueError, match=re.escape(
                "stall_seconds must be")):
            stall_seconds_from(bad)
    assert parse_args(["--workers", "2", "--stall-seconds", "5", "--", "x"]).stall_seconds == 5
    with pytest.raises(SystemExit):
        parse_args(["--workers", "2", "--stall-seconds", "-2", "--", "x"])


@pytest.mark.slow
@pytest.mark.parametrize("door", ["tape", "fit", "trainer"])
def test_a_frozen_worker_is_named_and_the_run_ends(door):
    # The tape loop sets its bounds in hvd.init() rather than through the launcher.
    settings = (("--init-stall", "5", "--init-timeout", "120") if door == "tape" else ())
    code, out, err, seconds = launch_workers(
        "stall_worker.py", door, *settings, timeout=240,
        launcher=() if door == "tape" else ("--stall-seconds", "5"))
    assert "[worker 1] rank 1: freezing at step 20" in out, (out, err[-3000:])
    if door == "tape":
        assert re.search(r"\[worker 0\] rank 0: Cluster\(worker 0 \(127\.0\.0\.1:\d+\) of 2, "
                         r"timeout=120s\)", out), out
    # The watchdog's code, not 124: the launcher's timeout was not needed.
    assert code == 75, (code, err[-3000:])
    line = re.search(r"\[worker 0\] tfreduce watchdog: (worker 0 \(127\.0\.0\.1:\d+\): worker 1 "
                     r"\(127\.0\.0\.1:\d+\) has sent no heartbeat for \d+ s: frozen, stopped or "
                     r"cut off.*)", err)
    assert line, err[-3000:]
    assert "Stopping them (stall_seconds=5)." in line.group(1)
    # The survivor's error carries the line; the launcher stops the frozen worker.
    assert f"Collective ops is aborted by: {line.group(1)}" in err
    if door == "trainer":  # its error names the collective it waited in too
        assert re.search(r"WorkerLostError: worker 0 \(127\.0\.0\.1:\d+\): lost worker 1 "
                         r"\(127\.0\.0\.1:\d+\): it does not answer, and the collective this "
                         r"worker waits in \(\S*allreduce\S*\) cannot go on without it", err), \
            err[-3000:]
    # The launcher, told by the watchdog, kills the frozen worker at once;
    # the survivor ends by itself within the grace.
    assert re.search(r"\[launch\] worker 1 was named frozen by worker 0's watchdog after "
                     r"[\d.]+s: stopping it; the others get 10s to finish", err), err[-3000:]
    assert "[launch] stopping worker" not in err
    print(f"{door}: ended {seconds:.0f} s after the start")


@pytest.mark.slow
def test_a_worker_that_an_error_ends_stops_the_others_at_once():
    # Rank 0 waits in step 20's collective; the launcher would stop it after
    # its grace period, but rank 1's last heartbeat names the error first.
    code, out, err, _ = launch_workers("stall_worker.py", "tape", "--fail",
                                       launcher=("--stall-seconds", "600"), timeout=240)
    assert code == 1, (code, err[-3000:])
    line = re.search(r"\[worker 0\] tfreduce watchdog: (worker 0 \(127\.0\.0\.1:\d+\): worker 1 "
                     r"\(127\.0\.0\.1:\d+\) ended with RuntimeError: rank 1: failing at step 20 "
                     r"on purpose \(20 steps done\); this worker cannot go on without it \(it was in training step "
                     r"21 \(20 steps done\)\)\. Stopping them\.)", err)
    assert line, err[-3000:]
    assert f"Collective ops is aborted by: {line.group(1)}" in err
    assert "[launch] stopping worker 0" not in err  # it ended by itself, within the grace


@pytest.mark.slow
def test_a_live_worker_that_never_comes_ends_the_wait_at_the_timeout():
    # Rank 1 sleeps 60 s before step 21, its heartbeats going on; rank 0's
    # ops carry no timeout (the watchdog runs), and its watchdog ends the
    # wait after 10 idle seconds, the collectives' timeout of hvd.init.
    code, out, err, _ = launch_workers("stall_worker.py", "tape", "--pause", "60", "--steps", "30",
                                       "--init-stall", "5", "--init-timeout", "10",
                                       launcher=("--grace", "2"), timeout=240)
    assert "[worker 1] rank 1: pausing 60 s at step 20" in out, (out, err[-3000:])
    assert code == 1, (code, err[-3000:])  # not 124: the launcher's timeout was not needed
    line = re.search(r"\[worker 0\] tfreduce watchdog: (worker 0 \(127\.0\.0\.1:\d+\): waited "
                     r"1\d s, idle, in training step 21 \(20 steps done\): the collectives' timeout "
                     r"\(10 s\); worker 1 \(127\.0\.0\.1:\d+\) has not come to it \(alive, but "
                     r"stuck or much slower\)\. Stopping them\.)", err)
    assert line, err[-3000:]
    assert "[worker 0] tensorflow.python.framework.errors_impl.DeadlineExceededError" in err
    assert f"Collective ops is aborted by: {line.group(1)}" in err
    assert "[worker 1] finished" not in out


@pytest.mark.slow
def test_a_long_first_trace_is_not_a_hang_and_a_live_worker_waited_for_is_warned_of_once():
    # One launch, two scenarios. Rank 1's first step traces 8 s longer than
    # rank 0's, twice (the first call creates the optimizer's variables, so
    # tf.function traces it again): rank 0 waits in its first collective
    # about 16 s, 3 times the bound, and nothing is reported. Then rank 1
    # sleeps 12 s before step 21 (its heartbeats go on): rank 0, inside step
    # 21 for 5 s, warns once; then both finish.
    code, out, err, _ = launch_workers("stall_worker.py", "tape", "--slow-trace", "8",
                                       "--pause", "12", "--steps", "30",
                                       launcher=("--stall-seconds", "5"), timeout=240)
    assert code == 0, err[-3000:]
    assert "[worker 1] rank 1: pausing 12 s at step 20" in out and out.count("finished") == 2
    # One warning, of step 21 (the straggler report may name rank 1 too: its
    # pause sits in rank 0's window of step times), and nothing stopped.
    warnings = re.findall(r"\[worker 0\] tfreduce watchdog: (.* is alive but .*)", err)
    assert len(warnings) == 1 and "Stopping them" not in err, err[-3000:]
    # The long first step is in no report: none before the pause.
    lags = [int(n) for n in re.findall(r"tfreduce watchdog: at step (\d+): .* lags", err)]
    assert all(n > 20 for n in lags), err[-3000:]
    assert re.fullmatch(
        r"worker 0 \(127\.0\.0\.1:\d+\): worker 1 \(127\.0\.0\.1:\d+\) is alive but has not come "
        r"to training step 21 \(20 steps done\) for \d+ s \(its heartbeat: 20 steps done\); it may "
        r"be loading data, saving a checkpoint or stuck in its own code\. This worker waits for "
        r"it until the collectives' timeout \(\d+ s idle\)\.", warnings[0]), warnings[0]
    assert "[worker 1] tfreduce watchdog" not in err


@pytest.mark.slow
def test_a_clean_run_reports_nothing_until_a_worker_lags_by_50_ms_a_step():
    # 1,000 clean steps report nothing; from step 1,000 on, rank 1 sleeps
    # 50 ms before each step and is named once the 20-step window is full.
    code, out, err, _ = launch_workers("stall_worker.py", "tape", "--freeze-at", "-1",
                                       "--steps", "1200", "--lag-ms", "50", "--lag-from", "1000",
                                       launcher=("--stall-seconds", "5"), timeout=240)
    assert code == 0, err[-3000:]
    assert out.count("finished") == 2
    lines = re.findall(r"tfreduce watchdog: .*", err)
    report = re.search(r"\[worker 0\] tfreduce watchdog: at step (\d+): worker 1 "
                       r"\(127\.0\.0\.1:\d+\) lags: the other workers wait about (\d+) ms per "
                       r"step for it \(its steps take \d+ ms inside, theirs \d+ ms, over the last "
                       r"20 steps\)", err)
    assert report and len(lines) == 1, err[-3000:]
    # Named once the window holds enough lagging steps for the rule (later on
    # a loaded host, whose heartbeats and steps come late); the wait named is
    # the rule's, over its 20 ms (how much over depends on the host's load).
    assert 1000 < int(report.group(1)) <= 1200
    assert int(report.group(2)) > STRAGGLER_MS


@pytest.mark.slow
def test_the_chief_logs_each_workers_time_inside_its_steps(tmp_path):
    # Steps enough for a heartbeat (one a second) after each window fills.
    code, out, err, _ = launch_workers("stall_worker.py", "trainer", "--freeze-at", "-1",
                                       "--steps", "300", "--logdir", tmp_path,
                                       launcher=("--stall-seconds", "5"), timeout=240)
    assert code == 0, err[-3000:]
    # A busy host (the other test process) may make one worker a straggler,
    # which may be reported: only a stall would be wrong here.
    assert "has sent no heartbeat" not in err, err[-3000:]
    values = scalars(tmp_path / "rank0", prefix=("workers/", "towers/"))
    # Once each worker's 20-step window is full: a positive time for each;
    # and each of rank 0's towers' time to its gradients.
    assert set(values) == {"workers/ms_inside_step/worker_0", "workers/ms_inside_step/worker_1",
                           "towers/ms_to_gradients/tower_0", "towers/ms_to_gradients/tower_1"}
    assert all(v > 0 for series in values.values() for v in series)
    assert not (tmp_path / "rank1").exists() or not os.listdir(tmp_path / "rank1")


@pytest.mark.slow
def test_fit_names_a_straggler_and_draws_each_workers_time(tmp_path):
    # Keras fit with DistributedOptimizer; rank 1 sleeps 50 ms before each
    # batch; WorkerTimesCallback writes on rank 0 every 20 batches.
    code, out, err, _ = launch_workers("stall_worker.py", "fit", "--freeze-at", "-1",
                                       "--lag-ms", "50", "--logdir", tmp_path,
                                       launcher=("--stall-seconds", "5"), timeout=240)
    assert code == 0, err[-3000:]
    assert re.search(r"\[worker 0\] tfreduce watchdog: at step \d+: worker 1 \(127\.0\.0\.1:"
                     r"\d+\) lags: the other workers wait about \d+ ms per step for it", err), \
        err[-3000:]
    values = scalars(tmp_path / "rank0" / "train")
    assert set(values) == {"workers/ms_inside_step/worker_0", "workers/ms_inside_step/worker_1"}
    # The last point: rank 0 waits inside its batches for rank 1's 50 ms.
    assert values["workers/ms_inside_step/worker_0"][-1] > \
        values["workers/ms_inside_step/worker_1"][-1] + 25
    assert not (tmp_path / "rank1").exists() or not os.listdir(tmp_path / "rank1")


def test_a_first_heartbeat_is_answered_where_it_came_from():
    # A peer whose UDP port number was taken listens elsewhere: its
    # heartbeats are answered at their source, at once on the first.
    dogs, fired = pair(stall=600.0)
    dogs[0].start()
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer.bind(("127.0.0.1", 0))  # not rank 1's port
    peer.settimeout(30.0)  # a bound on the test
    try:
        peer.sendto(json.dumps({"run": dogs[0].beats.run, "rank": 1, "kind": "beat", "step": 0,
                                "doing": ""}).encode(), ("127.0.0.1", dogs[0].beats.port))
        answer = json.loads(peer.recv(4096).decode())
        assert (answer["run"], answer["rank"], answer["kind"]) == (dogs[0].beats.run, 0, "beat")
        assert dogs[0].wait_for_peers(30.0) == [] and fired[0] == []
    finally:
        peer.close()
        dogs[0].goodbye()


@pytest.mark.slow
def test_start_waits_for_every_peer_and_a_taken_udp_port_is_passed_over():
    # Rank 1's UDP port number is held by another program: it listens on
    # another port and is heard all the same. Until it starts, rank 0's
    # wait names it as unheard.
    spec = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    squatter = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    squatter.bind(("", int(spec["worker"][1].rsplit(":", 1)[1])))
    fired = {0: [], 1: []}
    dogs = [Watchdog(Cluster(spec, "worker", r), 600.0, on_stall=fired[r].append)
            for r in range(2)]
    try:
        assert dogs[1].beats.port != squatter.getsockname()[1]
        dogs[0].start()
        assert dogs[0].wait_for_peers(0.5) == [1]  # rank 1 has not started
        dogs[1].start()
        assert dogs[0].wait_for_peers(30.0) == [] and dogs[1].wait_for_peers(30.0) == []
        assert fired == {0: [], 1: []}
    finally:
        squatter.close()
        for dog in dogs:
            dog.goodbye()


@pytest.mark.slow
def test_a_peer_that_ended_while_this_worker_waits_is_named(monkeypatch):
    monkeypatch.setattr(progress, "step", 0)  # whatever trained before in this process
    dogs, fired = pair(stall=1.0)
    for dog in dogs:
        dog.start()
    try:
        assert wait_for(lambda: 1 in dogs[0].beats.heard)
        dogs[1].goodbye()  # a clean exit, while rank 0 waits in an eager all-reduce
        with progress.within("allreduce of float32 [3]"):
            assert wait_for(lambda: fired[0])
        # Both watchdogs share this process's progress: a heartbeat of rank 1's
        # thread that left after its goodbye may say what rank 0 does.
        assert re.fullmatch(
            r"worker 0 \(127\.0\.0\.1:\d+\): worker 1 \(127\.0\.0\.1:\d+\) has ended \(a clean "
            r"exit, \d+ s ago(, after allreduce of float32 \[3\])?\) while this worker waits in "
            r"allreduce of float32 \[3\], which cannot finish without it\. Stopping them\.",
            fired[0][0]), fired[0][0]
    finally:
        dogs[0].goodbye()


def test_a_loop_that_tells_nothing_is_seen_through_its_rounds(monkeypatch):
    # A custom loop tells no steps: its rounds stand for them; a round it
    # waits in is what it is doing, since it was first seen.
    monkeypatch.setattr(progress, "told", False)
    monkeypatch.setattr(progress, "doing", None)
    view, memo = observe(None, None)
    assert view is progress and memo is None
    view, memo = observe((31, 30, [0.05] * 20), None)
    assert (view.step, view.doing, view.durations) == (30, "cross-worker round 31", [0.05] * 20)
    again, memo_again = observe((31, 30, [0.05] * 20), memo)
    assert again.since == view.since and memo_again == memo  # the same wait
    between, _ = observe((31, 31, [0.05] * 20), memo)
    assert between.doing is None and measure(between) == "rounds"
    with progress.within("allreduce of float32 [3]"):  # an eager call told: what it waits in
        told, _ = observe((32, 31, []), memo)
        assert told.doing == "allreduce of float32 [3]"
    assert measure(progress) == "steps"


def test_only_medians_of_one_measure_are_compared():
    heard = {1: (0.0, {"ms": 52.0, "of": "rounds"}), 2: (0.0, {"ms": 3.0, "of": "steps"})}
    assert worker_medians(3, 0, 2.0, "rounds", heard, set()) == {0: 2.0, 1: 52.0, 2: None}
    assert worker_medians(3, 0, 2.0, "rounds", heard, {1}) == {0: 2.0, 1: None, 2: None}
    assert stragglers({0: 52.0, 1: 2.0}, lambda r: f"worker {r}", "rounds") == [
        "worker 1 lags: the other workers wait about 50 ms per step for it (it waits 2 ms in its "
        "cross-worker collectives, they 52 ms, over the last 20 steps)"]


def test_rounds_are_counted_in_a_traced_step_without_holding_it_back():
    import tensorflow as tf
    from tfreduce.workers.rounds import CollectiveRounds

    rounds = CollectiveRounds("/device:CPU:0")

    @tf.function
    def step(x):
        y = x * 2.0  # stands for a round's collectives
        rounds.mark([x], [y])
        return y

    for _ in range(3):
        step(tf.ones([4]))
    entered, left, waited = rounds.read()
    assert (entered, left) == (3, 3) and waited >= 0.0
    assert rounds.latest() is None  # the reader starts; its first read finds 3 rounds
    assert wait_for(lambda: rounds.latest() is not None)
    assert rounds.latest() == (3, 3, [])
    step(tf.ones([4]))
    step(tf.ones([4]))
    # The reader keeps a wait for each round left since its last read.
    assert wait_for(lambda: rounds.latest()[1] == 5)
    assert len(rounds.latest()[2]) == 2 and min(rounds.latest()[2]) >= 0.0
    # The round's work (the Mul standing for its collectives) waits for none
    # of the counting ops: they follow it, they never hold it back.
    graph = step.get_concrete_function(tf.ones([4])).graph
    counting = {op.name for op in graph.get_operations() if op.name.startswith("rounds/")}
    work = [op for op in graph.get_operations() if op.type == "Mul"]
    assert counting and len(work) == 1
    ahead, before = list(work), set()
    while ahead:
        op = ahead.pop()
        before.add(op.name)
        ahead += [t.op for t in op.inputs] + list(op.control_inputs)
    assert not before & counting, before & counting


def test_rounds_made_inside_a_v1_graph_count_the_eager_steps():
    # hvd.init() inside `with tf.Graph().as_default()` (Horovod's graph-mode
    # tests do so), then a tf.function run eagerly: its rounds count, and a
    # tf.function traced inside a v1 graph is not counted.
    import tensorflow as tf
    from tfreduce.workers.rounds import CollectiveRounds

    with tf.Graph().as_default():
        rounds = CollectiveRounds("/device:CPU:0")

    @tf.function
    def step(x):
        y = x + 1.0
        rounds.mark([x], [y])
        return y

    assert rounds.read() == (0, 0, 0.0)
    with tf.Graph().as_default():
        step(tf.ones([2]))
    assert rounds.read() == (0, 0, 0.0)
    step(tf.ones([2]))
    step(tf.ones([2]))
    assert rounds.read()[:2] == (2, 2)


FAULTS = Path(faults_worker.__file__)


@pytest.mark.slow
def test_a_loop_that_tells_nothing_has_its_frozen_worker_named_and_killed():
    # Horovod's custom loop, no tfreduce call but the collectives: rank 1
    # freezes at step 30, rank 0 names it by the round it waits in, the
    # launcher kills it at once.
    code, out, err, _ = launch_workers(FAULTS, "--case", "freeze", "--steps", "300",
                                       launcher=("--stall-seconds", "5"), timeout=240)
    assert code == 75, (code, err[-3000:])
    assert re.search(r"\[worker 0\] tfreduce watchdog: worker 0 \(127\.0\.0\.1:\d+\): worker 1 "
                     r"\(127\.0\.0\.1:\d+\) has sent no heartbeat for \d+ s: frozen, stopped or "
                     r"cut off.*; this worker waits in cross-worker round 3\d \(3\d steps "
                     r"done\)\. Stopping them \(stall_seconds=5\)\.", err), err[-3000:]
    assert "[launch] worker 1 was named frozen by worker 0's watchdog after" in err
    assert "[launch] stopping worker" not in err


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["tape", "fit"])
def test_a_loop_that_tells_nothing_has_its_straggler_named(loop):
    # 150 clean steps name nobody; then rank 1 sleeps 50 ms before each step
    # and the chief names it by the rounds it waits least in (within 20
    # steps on an idle host: the bench's faults mode counts them).
    code, out, err, _ = launch_workers(FAULTS, "--case", "lag", "--loop", loop, "--at", "150",
                                       "--steps", "260", launcher=("--stall-seconds", "5"),
                                       timeout=240)
    assert code == 0, err[-3000:]
    reports = re.findall(r"tfreduce watchdog: .*", err)
    named = re.search(r"\[worker 0\] tfreduce watchdog: at step (\d+): worker 1 \(127\.0\.0\.1:"
                      r"\d+\) lags: the other workers wait about \d+ ms per step for it \(it "
                      r"waits \d+ ms in its cross-worker collectives, they \d+ ms, over the last "
                      r"20 steps\)", err)
    assert named and len(reports) == 1, err[-3000:]
    assert 150 < int(named.group(1)) <= 260


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["tape", "eager"])
def test_a_worker_that_exits_while_another_waits_for_it_is_named(loop):
    # Rank 1 exits with 0 right after init(); rank 0's first step waits for
    # it, in a tf.function (a round) or eagerly (a told call).
    code, out, err, _ = launch_workers(FAULTS, "--case", "vanish", "--loop", loop,
                                       launcher=("--stall-seconds", "5"), timeout=240)
    assert code == 1, (code, err[-3000:])
    assert re.search(r"\[worker 0\] tfreduce watchdog: worker 0 \(127\.0\.0\.1:\d+\): worker 1 "
                     r"\(127\.0\.0\.1:\d+\) has ended \(a clean exit, \d+ s ago\) while this "
                     r"worker waits in (cross-worker round 1|allreduce \(average, .*\) of "
                     r"float32 .*), which cannot finish without it\. Stopping them\.", err), \
        err[-3000:]
