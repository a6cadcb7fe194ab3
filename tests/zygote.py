"""A warm Python that starts the tests' Python subprocesses by forking (one per xdist process).

A test that runs ``python -m tfreduce.launch ... -- python worker.py`` or
``python examples/image_classification.py`` as a new process pays
TensorFlow's import in each (about 7 s of a core here) before its first
line runs; across the suite that is most of the multi-process tests' time.
TensorFlow's own distribute tests keep a pool of warm processes for the same
reason (``MultiProcessPoolRunner``). Here one server process per pytest
process imports TensorFlow and tfreduce's modules once, without starting
TensorFlow's runtime, and forks a child for each command, which runs the
command's Python program as ``python`` would (``tfreduce.preload``, the
same code as the launcher's ``--preload``). The launcher run this way
forks its workers in turn (the commands given here pass ``--preload``).

``run(command, timeout=...)`` is ``subprocess.run(command,
capture_output=True, text=True, timeout=...)`` for a command ``python
SCRIPT|-m MODULE|-c CODE ARGS`` of this Python: on a timeout the child's
process group gets SIGTERM, then SIGKILL, and ``subprocess.TimeoutExpired``
is raised; ``started=`` is called with the child's pid once it exists.
``run_together(commands, envs, timeout=...)`` runs several at once. Tests
whose subject is a command's own start-up (test_commands, test_launch) keep
starting new processes.

Run as a script, this file is the server: one JSON request per line on
stdin, ``{"pid"}`` then ``{"code", "stdout", "stderr"}`` per request on the
descriptor that was its stdout.
"""

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time

# Imported once by the server: what the forked programs import first. (Not a
# module the tests run with -m, such as tfreduce.launch: runpy warns when the
# module it runs as __main__ was imported already.)
PRELOAD = ["tensorflow", "tfreduce.trainer", "tfreduce.tensorflow", "tfreduce.doors.multiworker"]
_START_SECONDS = 180
_KILL_SECONDS = 20


class Zygote:
    """The client side: starts the server on first use and stops it at exit."""

    def __init__(self):
        self._proc = None
        self._pending = b""
        atexit.register(self.close)

    def _start(self):
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL)
        self._pending = b""
        ready = self._message(time.monotonic() + _START_SECONDS)
        if ready is None or "ready" not in ready:
            raise RuntimeError(f"the zygote server did not start: {ready}")

    def close(self, wait=10):
        """Stops the server: end of its input, then SIGKILL after ``wait`` seconds."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def _message(self, deadline):
        """The server's next message (dict), or None at the deadline."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._pending:
            with selectors.DefaultSelector() as selector:
                selector.register(fd, selectors.EVENT_READ)
                if not selector.select(max(0.0, deadline - time.monotonic())):
                    return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise RuntimeError(f"the zygote server ended (code {self._proc.wait()})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, command, timeout, cwd=None, env=None, started=None):
        """Runs ``command`` in a child forked from the server; see the module docstring.

        ``started``, if given, is called with the child's pid in a thread of
        its own as soon as the child exists (e.g. to signal it mid-run).

        Returns:
          subprocess.CompletedProcess with returncode (negative: a signal),
          stdout and stderr (str).
        """
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        request = {"command": [str(c) for c in command],
                   "cwd": str(cwd or os.getcwd()), "env": dict(os.environ if env is None else env)}
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()
        pid = self._message(time.monotonic() + 60)["pid"]
        if started is not None:
            threading.Thread(target=started, args=(pid,), daemon=True).start()
        done = self._message(time.monotonic() + timeout)
        if done is None:
            for signum in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(pid, signum)
                except ProcessLookupError:
                    pass
                done = self._message(time.monotonic() + _KILL_SECONDS)
                if done is not None:
                    break
            else:  # the server still waits on the child's output: the next run starts anew
                self.close(wait=0)
            raise subprocess.TimeoutExpired(command, timeout,
                                            output=done and done["stdout"],
                                            stderr=done and done["stderr"])
        return subprocess.CompletedProcess(command, done["code"], done["stdout"],
                                           done["stderr"])


_ZYGOTE = Zygote()


def run(command, timeout, cwd=None, env=None, started=None):
    """``Zygote.run`` on this pytest process's server."""
    return _ZYGOTE.run(command, timeout, cwd=cwd, env=env, started=started)


def run_together(commands, envs, timeout):
    """Runs the commands at once, each forked from the warm server with its environment.

    For programs that must meet each other (two processes of one cluster
    started as srun would start them): one child of the server forks them
    all (``tfreduce.preload``, as the launcher's ``--preload`` does) and
    reads their output to the end.

    Args:
      commands: list of commands ``python SCRIPT|-m MODULE|-c CODE ARGS``.
      envs: list of dicts, each command's whole environment.
      timeout: seconds for them all.

    Returns:
      list of subprocess.CompletedProcess, one per command, in order.

    Raises:
      subprocess.TimeoutExpired: they were not all done in ``timeout`` s.
      RuntimeError: the driver itself failed (its stderr is in the message).
    """
    spec = json.dumps({"commands": [[str(c) for c in command] for command in commands],
                       "envs": [dict(env) for env in envs]})
    here = os.path.dirname(os.path.abspath(__file__))
    driver = (f"import sys; sys.path.insert(0, {here!r}); import zygote; "
              f"zygote._together()")
    done = run([sys.executable, "-c", driver], timeout, env=dict(os.environ, ZYGOTE_SPEC=spec))
    if done.returncode != 0:
        raise RuntimeError(f"the driver failed (exit {done.returncode}): {done.stderr[-3000:]}")
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return [subprocess.CompletedProcess(command, code, out, err)
            for command, (code, out, err) in zip(commands, results)]


def _together():
    # The driver of run_together, in a child of the server: forks each
    # command, drains all of them side by side, prints one JSON line. Each
    # command runs in its own session: the SIGTERM of a timeout, sent to
    # this driver's, is passed on as SIGKILL.
    from tfreduce import preload
    spec = json.loads(os.environ.pop("ZYGOTE_SPEC"))
    workers = [preload.ForkedWorker(preload.program(command), env)
               for command, env in zip(spec["commands"], spec["envs"])]

    def stop(signum, frame):
        for worker in workers:
            try:
                os.killpg(worker.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    outputs = [None] * len(workers)

    def drain(i):
        outputs[i] = _drain(workers[i])

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(workers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results = []
    for worker, (out, err) in zip(workers, outputs):
        worker.stdout.close()
        worker.stderr.close()
        results.append([worker.wait(), out, err])
    print(json.dumps(results), flush=True)


def _drain(worker):
    """Reads the child's stdout and stderr to their ends; returns both as str."""
    chunks = {worker.stdout: [], worker.stderr: []}
    with selectors.DefaultSelector() as selector:
        for stream in chunks:
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map():
            for key, _ in selector.select():
                data = os.read(key.fileobj.fileno(), 1 << 16)
                if data:
                    chunks[key.fileobj].append(data)
                else:
                    selector.unregister(key.fileobj)
    return [b"".join(chunks[s]).decode("utf-8", "replace") for s in (worker.stdout,
                                                                     worker.stderr)]


def _serve():
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever else prints does not mix with the replies
    from tfreduce import preload
    preload.preload(PRELOAD)
    print(json.dumps({"ready": os.getpid()}), file=replies)
    keep = [replies.fileno(), sys.stdin.fileno()]
    for line in sys.stdin:
        request = json.loads(line)
        worker = preload.ForkedWorker(preload.program(request["command"]), request["env"],
                                      cwd=request["cwd"], close_fds=keep)
        print(json.dumps({"pid": worker.pid}), file=replies)
        out, err = _drain(worker)
        worker.stdout.close()
        worker.stderr.close()
        code = worker.wait()
        print(json.dumps({"code": code, "stdout": out, "stderr": err}), file=replies)


if __name__ == "__main__":
    _serve()
