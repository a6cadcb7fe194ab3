"""Runs N workers of a multi-worker program on this machine, for trying it out.

    python -m tfreduce.launch --workers 2 -- python examples/image_classification.py

starts the command N times, each with the TF_CONFIG of one worker of an
N-worker cluster on 127.0.0.1 (free ports picked here), and prefixes every
line each worker prints with ``[worker i]``. When a worker fails (exits
non-zero or is killed), the others get ``--grace`` seconds to notice the lost
peer and fail with their own message, then they are stopped (SIGTERM, then
SIGKILL, to each worker's whole process group) and the launcher exits with
the first failure's code (128 + signal number for a signal). Ctrl-C stops
every worker. ``--timeout`` bounds the whole run.

Security: TF's gRPC server has no authentication. The cluster addresses are
on loopback, but TensorFlow's server listens on every interface of the
machine, so run this only on a machine whose ports are not reachable from an
untrusted network (a firewall, or a container without published ports).
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tfreduce.tf_config import worker_tf_config as tf_config

__all__ = ["main", "free_ports", "tf_config"]

_POLL_SECONDS = 0.1
# After SIGTERM, how long a worker may take to exit before SIGKILL.
_TERM_SECONDS = 5.0


def free_ports(count, host="127.0.0.1"):
    """``count`` distinct TCP ports that are free on ``host`` right now.

    All sockets are held open until every port is chosen, so the ports
    differ; they are closed before returning, so another process could take
    one before a worker binds it (the worker then fails with a clear error).

    Args:
      count: int >= 1.
      host: str, the address to probe.

    Returns:
      list of int ports.
    """
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                              socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class _Prefixer(threading.Thread):
    """Copies a child's output to ours, each line prefixed with its worker."""

    def __init__(self, stream, out, prefix, lock):
        super().__init__(daemon=True)
        self._stream, self._out, self._prefix, self._lock = stream, out, prefix, lock

    def run(self):
        pending = b""
        while True:
            chunk = self._stream.read1(65536) if hasattr(self._stream, "read1") else (
                self._stream.read(65536))
            if not chunk:
                break
            pending += chunk
            # A carriage return ends a segment too: progress bars redraw
            # their line with it, and each redraw keeps its prefix.
            cut = max(pending.rfind(b"\n"), pending.rfind(b"\r"))
            if cut >= 0:
                self._write(pending[:cut + 1])
                pending = pending[cut + 1:]
        if pending:
            self._write(pending + b"\n")

    def _write(self, data):
        parts, start = [], 0
        for i, byte in enumerate(data):
            if byte in (0x0A, 0x0D):
                parts.append(self._prefix + data[start:i + 1])
                start = i + 1
        with self._lock:
            self._out.write(b"".join(parts))
            self._out.flush()


class _Workers:
    """The N child processes, each the leader of its own process group."""

    def __init__(self, command, addresses, log):
        self._log = log
        self.procs = []
        self.threads = []
        lock = threading.Lock()
        for i in range(len(addresses)):
            env = dict(os.environ, TF_CONFIG=tf_config(addresses, i), PYTHONUNBUFFERED="1")
            try:
                proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True)
            except OSError:
                self.stop(0.0)
                raise
            self.procs.append(proc)
            prefix = f"[worker {i}] ".encode()
            for stream, out in ((proc.stdout, sys.stdout.buffer),
                                (proc.stderr, sys.stderr.buffer)):
                thread = _Prefixer(stream, out, prefix, lock)
                thread.start()
                self.threads.append(thread)

    def running(self):
        return [i for i, p in enumerate(self.procs) if p.poll() is None]

    def signal_all(self, signum):
        for p in self.procs:
            try:
                os.killpg(p.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, grace):
        """Lets running workers finish for ``grace`` s, then terminates them."""
        deadline = time.monotonic() + grace
        while self.running() and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
        left = self.running()
        if left:
            self._log(f"stopping worker{'s' if len(left) > 1 else ''} "
                      f"{', '.join(map(str, left))}")
            self.signal_all(signal.SIGTERM)
            deadline = time.monotonic() + _TERM_SECONDS
            while self.running() and time.monotonic() < deadline:
                time.sleep(_POLL_SECONDS)
        # Whatever the leaders did, nothing of any group may outlive us.
        self.signal_all(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        for t in self.threads:
            t.join(timeout=1.0)


def _exit_code(returncode):
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode):
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def parse_args(argv):
    """Splits ``argv`` at "--" into the launcher's options and the command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m tfreduce.launch",
        description="Run N workers of a TF_CONFIG multi-worker program on this "
                    "machine: python -m tfreduce.launch --workers 2 -- python train.py",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workers", type=int, required=True, metavar="N",
                        help="number of worker processes")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the workers reach each other at (TF's server "
                             "itself listens on all interfaces)")
    parser.add_argument("--grace", type=float, default=10.0, metavar="S",
                        help="seconds the other workers get to fail on their own "
                             "after one fails, before they are stopped")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="stop every worker and exit 124 after S seconds")
    if "--" in argv:
        cut = argv.index("--")
        options, command = argv[:cut], argv[cut + 1:]
    else:
        options, command = argv, []
    args = parser.parse_args(options)
    if not command:
        parser.error("give the command to run after '--', e.g. "
                     "'--workers 2 -- python train.py'")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.grace < 0:
        parser.error(f"--grace must be >= 0 seconds, got {args.grace}")
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    args.command = command
    return args


def _supervise(workers, args, interrupted, start, log):
    """Waits for the workers; stops them all on a failure, a signal or --timeout.

    Returns:
      int, the exit code so far (0 while nothing went wrong).
    """
    code = 0
    while workers.running():
        failed = [(i, p.returncode) for i, p in enumerate(workers.procs)
                  if p.returncode not in (None, 0)]
        if failed:
            i, returncode = failed[0]
            log(f"worker {i} {_describe(returncode)} after "
                f"{time.monotonic() - start:.1f}s; the others get {args.grace:g}s "
                f"to finish")
            code = _exit_code(returncode)
            workers.stop(args.grace)
            break
        if interrupted:
            log(f"{signal.Signals(interrupted[0]).name}: stopping every worker")
            code = 130 if interrupted[0] == signal.SIGINT else 143
            workers.signal_all(interrupted[0])
            workers.stop(0.0)
            break
        if args.timeout is not None and time.monotonic() - start > args.timeout:
            log(f"--timeout {args.timeout:g}s reached: stopping every worker")
            code = 124
            workers.stop(0.0)
            break
        time.sleep(_POLL_SECONDS)
    workers.stop(0.0)
    return code


def main(argv=None):
    """Runs the workers; returns the launcher's exit code.

    Args:
      argv: list of str, the arguments after the program name (None:
        ``sys.argv[1:]``).

    Returns:
      int: 0 when every worker exits with 0; the first failure's code
      (128 + signal for a killed worker); 124 after ``--timeout``; 130 after
      Ctrl-C.
    """
    args = parse_args(argv)

    def log(message):
        sys.stderr.write(f"[launch] {message}\n")
        sys.stderr.flush()

    addresses = [f"{args.host}:{p}" if ":" not in args.host else f"[{args.host}]:{p}"
                 for p in free_ports(args.workers, args.host)]
    log(f"{args.workers} worker{'s' if args.workers > 1 else ''} at "
        f"{', '.join(addresses)}: {' '.join(args.command)}")
    start = time.monotonic()
    interrupted = []
    previous = {}

    def on_signal(signum, frame):
        interrupted.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, on_signal)
    try:
        workers = _Workers(args.command, addresses, log)
    except OSError as e:
        log(f"cannot start {args.command[0]!r}: {e.strerror}")
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        return 127
    try:
        code = _supervise(workers, args, interrupted, start, log)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if code == 0:
        failed = [(i, p.returncode) for i, p in enumerate(workers.procs) if p.returncode]
        if failed:
            i, returncode = failed[0]
            log(f"worker {i} {_describe(returncode)}")
            code = _exit_code(returncode)
    log(f"{'all workers finished' if code == 0 else f'exit code {code}'} after "
        f"{time.monotonic() - start:.1f}s")
    return code


if __name__ == "__main__":
    sys.exit(main())
