"""The local launcher: TF_CONFIG per worker, prefixed output, failures, clean-up.

The workers here are short plain-Python commands (no TensorFlow), so these
tests take seconds; test_multiworker.py runs TensorFlow workers through the
launcher. The launcher runs as ``python tfreduce/launch.py``, which imports
only the standard library; ``python -m tfreduce.launch`` is the same code
after the package import. Every worker writes its pid to a directory, and
the ``pids`` fixture checks afterwards that none is left running (and kills
any that is, so a failing test leaves nothing behind).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import alive

from tfreduce import launch
from tfreduce.workers.agent import AGENT_ENV, Agent, tell

LAUNCH = [sys.executable, str(Path(launch.__file__))]

PRELUDE = textwrap.dedent("""\
    import json, os, subprocess, sys, time
    pid_dir = sys.argv[1]
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    """)


@pytest.fixture
def pids(tmp_path):
    directory = tmp_path / "pids"
    directory.mkdir()
    yield directory
    left = [int(p.name) for p in directory.iterdir() if alive(int(p.name))]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"worker processes left running: {left}"


def recorded(directory):
    return sorted(int(p.name) for p in directory.iterdir())


def run(pids, body, *options, timeout=60):
    """Runs the launcher on a worker script; returns (code, stdout, stderr, seconds)."""
    script = PRELUDE + textwrap.dedent(body)
    start = time.monotonic()
    result = subprocess.run(
        LAUNCH + list(options) + ["--", sys.executable, "-c", script, str(pids)],
        capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout, result.stderr, time.monotonic() - start


def test_each_worker_gets_its_tf_config_and_a_prefix(pids):
    code, out, err, _ = run(pids, """\
        print(os.environ["TF_CONFIG"])
        sys.stderr.write(f"warning from {index}\\nno newline at the end")
        """, "--workers", "3")
    assert code == 0, err
    configs = {}
    for line in out.splitlines():
        match = re.fullmatch(r"\[worker (\d)\] (.*)", line)
        assert match, line
        configs[int(match.group(1))] = json.loads(match.group(2))
    assert sorted(configs) == [0, 1, 2]
    workers = configs[0]["cluster"]["worker"]
    assert len(set(workers)) == 3 and all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in workers)
    for i, c in configs.items():
        assert c == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
    for i in range(3):
        assert f"[worker {i}] warning from {i}\n" in err
        assert f"[worker {i}] no newline at the end\n" in err
    assert "[launch] all workers finished" in err
    assert len(recorded(pids)) == 3


def test_a_failed_worker_stops_the_others(pids):
    code, _, err, _ = run(pids, """\
        if index == 1:
            sys.exit(3)
        time.sleep(60)
        """, "--workers", "3", "--grace", "0.5")
    assert code == 3
    assert re.search(r"\[launch\] worker 1 exited with code 3 after [\d.]+s; the others "
                     r"get 0\.5s to finish", err), err
    # Stopped by the launcher, not left to sleep their 60 s (no timing assertion).
    assert "[launch] stopping workers 0, 2" in err
    assert len(recorded(pids)) == 3


def test_survivors_get_the_grace_period_to_report(pids):
    code, out, err, _ = run(pids, """\
        if index == 1:
            sys.exit(1)
        time.sleep(1.0)
        print("lost worker 1", flush=True)
        sys.exit(2)
        """, "--workers", "2", "--grace", "20")
    assert code == 1  # the first failure's code
    assert "[worker 0] lost worker 1" in out
    assert "stopping" not in err


def test_a_stopped_worker_gets_the_sigterm_at_once(pids):
    # Worker 0 is stopped (SIGSTOP, as a frozen worker in the tests, or
    # Ctrl-Z): the SIGTERM waits until it continues, so the launcher sends
    # SIGCONT after it, as systemd does. Without, SIGKILL ends it unwarned.
    code, out, err, _ = run(pids, """\
        import signal
        if index == 1:
            time.sleep(0.5)
            sys.exit(3)
        def terminated(signum, frame):
            print("worker 0 got SIGTERM", flush=True)
            sys.exit(143)
        signal.signal(signal.SIGTERM, terminated)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
        """, "--workers", "2", "--grace", "0")
    assert code == 3
    assert "[launch] stopping worker 0" in err
    assert "[worker 0] worker 0 got SIGTERM" in out, (out, err)


@pytest.mark.parametrize("preload", [[], ["--preload", "json"]], ids=["exec", "forked"])
def test_a_killed_worker_and_its_children_are_reported_and_cleaned_up(pids, preload):
    code, _, err, _ = run(pids, """\
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open(os.path.join(pid_dir, str(child.pid)), "w").close()
        time.sleep(0.5)
        if index == 1:
            os.kill(os.getpid(), 9)
        time.sleep(60)
        """, "--workers", "2", "--grace", "0", *preload)
    assert code == 128 + signal.SIGKILL
    assert "[launch] worker 1 was killed by SIGKILL" in err
    assert "[launch] stopping worker 0" in err  # not left to sleep its 60 s
    assert len(recorded(pids)) == 4  # two workers, two grandchildren: all gone


@pytest.mark.slow
def test_timeout_stops_every_worker(pids):
    code, _, err, _ = run(pids, "time.sleep(60)\n", "--workers", "2", "--timeout", "2")
    assert code == 124
    assert "[launch] --timeout 2s reached: stopping every worker" in err


def test_ctrl_c_stops_every_worker(pids):
    script = PRELUDE + "time.sleep(60)\n"
    proc = subprocess.Popen(LAUNCH + ["--workers", "2", "--", sys.executable, "-c", script,
                                      str(pids)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while len(recorded(pids)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "[launch] SIGINT: stopping every worker" in err


def test_unknown_command(pids):
    result = subprocess.run(LAUNCH + ["--workers", "2", "--", "no-such-command-tfreduce"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 127
    assert "[launch] cannot start 'no-such-command-tfreduce'" in result.stderr


@pytest.mark.parametrize("argv,message", [
    (["--workers", "2"], "give the command to run after '--'"),
    (["--workers", "2", "python", "x.py"], "unrecognized arguments: python x.py"),
    (["--workers", "0", "--", "true"], "--workers must be >= 1, got 0"),
    (["--workers", "2", "--grace", "-1", "--", "true"], "--grace must be >= 0 seconds"),
    (["--workers", "2", "--timeout", "0", "--", "true"], "--timeout must be > 0 seconds"),
    (["--", "true"], "the following arguments are required: --workers"),
])
def test_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        launch.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ --preload

SEEN = textwrap.dedent("""\
    import json, os, sys
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__,
                      "file": globals().get("__file__"), "cwd": os.getcwd(),
                      "stdin": sys.stdin.read(), "pgid_is_pid": os.getpgid(0) == os.getpid(),
                      "env": {k: os.environ.get(k) for k in
                              ("TF_CONFIG", "TFREDUCE_RESTART_COUNT", "PYTHONUNBUFFERED")}}))
    """)


def seen(out):
    """{worker index: what the SEEN program printed}."""
    return {int(m.group(1)): json.loads(m.group(2))
            for m in re.finditer(r"^\[worker (\d)\] (\{.*\})$", out, re.MULTILINE)}


@pytest.mark.parametrize("kind", ["script", "-m", "-c"])
def test_a_preloaded_worker_sees_what_a_started_one_sees(tmp_path, kind):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "seen.py").write_text(SEEN)
    program = {"script": [str(package / "seen.py")], "-m": ["-m", "pkg.seen"],
               "-c": ["-c", SEEN]}[kind]
    views = {}
    for mode, options in (("exec", []), ("fork", ["--preload", "json,textwrap"])):
        result = subprocess.run(
            LAUNCH + ["--workers", "2", *options, "--", sys.executable, *program, "a", "b c"],
            capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        views[mode] = seen(result.stdout)
        assert sorted(views[mode]) == [0, 1], result.stdout
    assert "[launch] preloaded json, textwrap in" in result.stderr
    for i in (0, 1):
        exec_view, fork_view = views["exec"][i], views["fork"][i]
        # Each start picks new ports; the rest of TF_CONFIG is the same.
        for view in (exec_view, fork_view):
            config = json.loads(view["env"].pop("TF_CONFIG"))
            assert config["task"] == {"type": "worker", "index": i}
        assert fork_view == exec_view
        assert exec_view["argv"][1:] == ["a", "b c"] and exec_view["name"] == "__main__"
        assert exec_view["stdin"] == "" and exec_view["pgid_is_pid"]


def test_a_preloaded_worker_reports_its_exit_like_a_started_one(pids):
    # Worker 0 raises, worker 1 exits with sys.exit's message (a SIGKILL is
    # test_a_killed_worker_and_its_children_are_reported_and_cleaned_up's).
    code, _, err, _ = run(pids, """\
        if index == 0:
            raise ValueError("broken worker 0")
        sys.exit("message of worker 1")
        """, "--workers", "2", "--grace", "5", "--preload", "json")
    assert code == 1
    assert re.search(r"\[worker 0\] ValueError: broken worker 0\n", err), err
    assert "[worker 1] message of worker 1\n" in err
    assert "preload.py" not in err  # the traceback is the program's, as Python prints it
    assert len(recorded(pids)) == 2


def test_a_preloaded_run_restarts_by_forking_again(pids):
    code, out, err, _ = run(pids, START + textwrap.dedent("""\
        first = int(os.environ["TFREDUCE_RESTART_COUNT"]) == 0
        marker = os.path.join(os.path.dirname(pid_dir), "worker0-started")
        if first and index == 0:
            open(marker, "w").close()  # its start is printed: --grace 0 may stop it now
        if first and index == 1:
            while not os.path.exists(marker):
                time.sleep(0.01)
            os.kill(os.getpid(), 9)
        time.sleep(0.2 if int(os.environ["TFREDUCE_RESTART_COUNT"]) else 60)
        """), "--workers", "2", "--restarts", "1", "--grace", "0", "--preload", "json")
    assert code == 0, err
    assert err.count("[launch] preloaded json in") == 1  # imported once, forked twice
    assert "restart 1 of 1: worker 1 was killed by SIGKILL" in err
    assert {count: sorted(c) for count, c in starts(out).items()} == {0: [0, 1], 1: [0, 1]}
    assert len(recorded(pids)) == 4


@pytest.mark.parametrize("command,message", [
    (["bash", "-c", "true"], "got 'bash', which is "),
    (["no-such-python-tfreduce", "x.py"], "got 'no-such-python-tfreduce', which is not found"),
    ([sys.executable, "-u", "x.py"], f"got '{sys.executable} -u x.py'"),
    ([sys.executable, "-m"], "-m needs its argument"),
    ([sys.executable], f"got '{sys.executable}'"),
])
def test_preload_refuses_a_command_it_cannot_fork(capsys, command, message):
    with pytest.raises(SystemExit) as info:
        launch.main(["--workers", "2", "--preload", "tensorflow", "--", *command])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--preload forks the workers from this Python" in err and message in err, err


def test_preload_of_a_missing_module_is_an_error_naming_it():
    result = subprocess.run(LAUNCH + ["--workers", "2", "--preload", "json,no_such_module_tf",
                                      "--", sys.executable, "-c", "pass"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 127
    assert ("[launch] cannot preload json, no_such_module_tf: No module named "
            "'no_such_module_tf'") in result.stderr


def test_free_ports_and_tf_config():
    ports = launch.free_ports(4)
    assert len(set(ports)) == 4 and all(0 < p < 65536 for p in ports)
    for port in ports:  # the watchdog's UDP port of the same number is free too
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("", port))
    assert json.loads(launch.tf_config(["h:1", "h:2"], 1)) == {
        "cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 1}}


# Each worker prints "start <TFREDUCE_RESTART_COUNT> <TF_CONFIG>" first.
START = ('print("start", os.environ["TFREDUCE_RESTART_COUNT"], os.environ["TF_CONFIG"], '
         'flush=True)\n')


def starts(out):
    """{restart count: {worker index: its TF_CONFIG}} from the workers' "start" lines."""
    configs = {}
    for line in out.splitlines():
        match = re.fullmatch(r"\[worker (\d)\] start (\d+) (.*)", line)
        if match:
            config = json.loads(match.group(3))
            configs.setdefault(int(match.group(2)), {})[int(match.group(1))] = config
    return configs


def test_a_failed_start_restarts_every_worker_on_new_ports(pids):
    # The marker stands for a checkpoint: the restarted worker resumes from it.
    code, out, err, _ = run(pids, START + textwrap.dedent("""\
        marker = os.path.join(os.path.dirname(pid_dir), "checkpoint")
        count = int(os.environ["TFREDUCE_RESTART_COUNT"])
        if count == 0:
            if index == 1:
                open(marker, "w").close()
                os.kill(os.getpid(), 9)
            time.sleep(60)
        assert count == 1 and os.path.exists(marker), (count, os.path.exists(marker))
        print("resumed", flush=True)
        """), "--workers", "2", "--restarts", "2", "--grace", "0.5")
    assert code == 0, err
    assert re.search(r"^\[launch\] restart 1 of 2: worker 1 was killed by SIGKILL after "
                     r"[\d.]+s$", err, re.MULTILINE), err
    assert "restart 2 of 2" not in err
    assert re.search(r"\[launch\] all workers finished after [\d.]+s \(1 restart\)", err)
    assert out.count("] resumed") == 2
    configs = starts(out)
    assert sorted(configs) == [0, 1] and all(sorted(c) == [0, 1] for c in configs.values())
    clusters = []
    for by_index in configs.values():
        workers = by_index[0]["cluster"]["worker"]
        assert len(set(workers)) == 2
        assert all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in workers), workers
        for i, c in by_index.items():
            assert c == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
        clusters.append(workers)
    assert clusters[0] != clusters[1]  # a new cluster, on newly picked ports
    assert len(recorded(pids)) == 4


def test_a_worker_that_always_fails_uses_up_every_restart(pids):
    # Worker 1 fails once worker 0 has printed its start line (else the
    # launcher may stop worker 0 before it prints: a loaded host did once).
    code, out, err, _ = run(pids, START + textwrap.dedent("""\
        mark = os.path.join(os.path.dirname(pid_dir),
                            "printed" + os.environ["TFREDUCE_RESTART_COUNT"])
        if index == 1:
            while not os.path.exists(mark):
                time.sleep(0.01)
            sys.exit(3)
        open(mark, "w").close()
        time.sleep(60)
        """), "--workers", "2", "--restarts", "2", "--grace", "0")
    assert code == 3
    assert re.findall(r"\[launch\] restart (\d) of 2: worker 1 exited with code 3", err) == [
        "1", "2"]
    assert re.search(r"\[launch\] exit code 3 after [\d.]+s \(2 restarts\)", err), err
    assert {count: sorted(c) for count, c in starts(out).items()} == {
        0: [0, 1], 1: [0, 1], 2: [0, 1]}
    assert len(recorded(pids)) == 6  # 3 starts of 2 workers, all gone


@pytest.mark.slow
def test_timeout_bounds_the_restarts_too(pids):
    code, _, err, _ = run(pids, """\
        time.sleep(0.5)
        sys.exit(index)
        """, "--workers", "2", "--restarts", "1000", "--grace", "0", "--timeout", "3")
    assert code == 124
    assert re.search(r"\[launch\] --timeout 3s reached: (stopping every worker|no restart)",
                     err), err
    assert "restart 1000 of 1000" not in err


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("failing", [False, True], ids=["running", "after-a-failure"])
def test_a_signal_to_the_launcher_never_restarts(pids, tmp_path, signum, failing):
    # Worker 1 either runs on or fails: then the signal comes in the grace period.
    failed = tmp_path / "failed"
    script = PRELUDE + textwrap.dedent(f"""\
        if {failing} and index == 1:
            with open({str(failed)!r}, "w") as f:
                f.write(str(os.getpid()))
            sys.exit(3)
        time.sleep(60)
        """)
    proc = subprocess.Popen(LAUNCH + ["--workers", "2", "--restarts", "3", "--grace", "2",
                                      "--", sys.executable, "-c", script, str(pids)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while len(recorded(pids)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        if failing:
            while not (failed.exists() and failed.read_text()) and time.monotonic() < deadline:
                time.sleep(0.05)
            while alive(int(failed.read_text())) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # the launcher notices the failure within its 0.1 s poll
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == (130 if signum == signal.SIGINT else 143), err
    assert not re.search(r"restart \d+ of", err), err
    assert f"[launch] {signum.name}: {'no restart' if failing else 'stopping every worker'}" in err
    assert len(recorded(pids)) == 2


@pytest.mark.parametrize("value,message", [
    ("-1", "--restarts must be >= 0, got -1"),
    ("x", "argument --restarts: invalid int value: 'x'"),
])
def test_restarts_usage_errors(capsys, value, message):
    with pytest.raises(SystemExit) as info:
        launch.main(["--workers", "2", "--restarts", value, "--", "true"])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_documents_restarts_and_the_restart_count(capsys):
    with pytest.raises(SystemExit) as info:
        launch.main(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--restarts N" in text and "TFREDUCE_RESTART_COUNT=0" in text
    assert "TFREDUCE_RESTART_COUNT" in launch.__doc__


def test_a_worker_named_frozen_is_killed_at_once(pids):
    # Worker 0 stands for a watchdog that names worker 1 (stopped with
    # SIGSTOP, as a frozen process is) to the launcher; the launcher kills
    # it at once, and worker 0 ends by itself within the grace.
    code, _, err, _ = run(pids, """\
        import signal
        from tfreduce.workers.agent import tell
        if index == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        workers = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]
        tell("127.0.0.1:1", workers[1], "frozen")  # another start's worker: not one of these
        tell(workers[0], workers[1], "frozen")
        time.sleep(1)
        """, "--workers", "2")
    assert code == 75, err
    assert re.search(r"\[launch\] worker 1 was named frozen by worker 0's watchdog after "
                     r"[\d.]+s: stopping it; the others get 10s to finish", err), err
    assert "[launch] stopping worker" not in err and "exit code 75 after" in err


def test_the_agent_takes_only_the_reports_of_its_workers(monkeypatch):
    agent = Agent("127.0.0.1")
    monkeypatch.setenv(AGENT_ENV, agent.address)
    try:
        tell("h:2", "h:1", "frozen")
        tell("elsewhere:1", "h:1", "frozen")  # not a worker of this start
        tell("h:1", "h:3", "frozen")
        deadline = time.monotonic() + 30  # a bound on the test
        named = {}
        while len(named) < 2 and time.monotonic() < deadline:
            named.update(agent.named(["h:1", "h:2", "h:3"]))
            time.sleep(0.05)
        assert named == {0: (1, "frozen"), 2: (0, "frozen")}
    finally:
        agent.close()
