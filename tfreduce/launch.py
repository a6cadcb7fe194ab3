"""Runs N workers of a multi-worker program on this machine, for trying it out.

    python -m tfreduce.launch --workers 2 -- python examples/image_classification.py

starts the command N times, each with the TF_CONFIG of one worker of an
N-worker cluster on 127.0.0.1 (free ports picked here), and prefixes every
line each worker prints with ``[worker i]``. When a worker fails (exits
non-zero or is killed), the others get ``--grace`` seconds to notice the lost
peer and fail with their own message, then they are stopped (SIGTERM and
SIGCONT, so a stopped worker gets it too, then SIGKILL, to each worker's
whole process group) and the launcher exits with
the first failure's code (128 + signal number for a signal). A worker that
a watchdog names frozen (``tfreduce.workers.agent``) is killed at once, a
failure of code 75. Ctrl-C stops every worker. ``--timeout`` bounds the run.

With ``--restarts N`` a failure ends the run only when N restarts have
failed too: once every worker is stopped, all of them start again as a new
cluster (new free ports, a fresh TF_CONFIG), after a line such as
``[launch] restart 1 of 2: worker 1 was killed by SIGKILL after 12.3s``.
Each worker gets ``TFREDUCE_RESTART_COUNT`` in its environment: 0 at the
first start, 1 after the first restart, and so on (torchrun's
TORCHELASTIC_RESTART_COUNT), so a training script resumes from its latest
checkpoint when it is > 0. Ctrl-C, SIGTERM and ``--timeout`` (which counts
the restarts too) never restart.

With ``--workers MIN:MAX`` the job is elastic (``tfreduce.workers.elastic_launch``):
it goes on without a lost worker from the last ``hvd.elastic`` commit,
and takes in new slots at the next one (docs/elastic.md).

With ``--preload tensorflow`` the launcher imports TensorFlow once and forks
each worker from itself (``tfreduce.preload``): the workers, and every
restart, skip their own import (about 9 s of CPU each on a 2-core host).

Security: TF's gRPC server has no authentication. The cluster addresses are
on loopback, but TensorFlow's server listens on every interface of the
machine, so run this only on a machine whose ports are not reachable from an
untrusted network (a firewall, or a container without published ports).
"""

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from tfreduce import preload
from tfreduce.basis.ports import free_ports
from tfreduce.basis.startup import VERBOSE_ENV, ArgumentParser
from tfreduce.basis.tf_config import worker_tf_config as tf_config
from tfreduce.workers import elastic_launch
from tfreduce.workers.agent import AGENT_ENV, Agent
from tfreduce.workers.watchdog import DEFAULT_STALL_SECONDS, EXIT_CODE, STALL_ENV

__all__ = ["main", "free_ports", "tf_config"]

_POLL_SECONDS = 0.1
# After SIGTERM, how long a worker may take to exit before SIGKILL.
_TERM_SECONDS = 5.0
# Tells a restarted worker to resume from its checkpoint (torchrun's
# TORCHELASTIC_RESTART_COUNT).
_RESTART_COUNT = "TFREDUCE_RESTART_COUNT"


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
    """The N child processes of one start, each the leader of its own process group.

    ``restart`` (0 at the first start) reaches each worker as
    TFREDUCE_RESTART_COUNT, ``agent`` as TFREDUCE_AGENT. With ``prog`` (from
    ``preload.program``) each worker is forked from this process, else exec'd.
    """

    def __init__(self, command, addresses, restart, log, prog=None, agent=None,
                 environments=None):
        self._log = log
        self.addresses = addresses
        self.procs = []
        self.threads = []
        lock = threading.Lock()
        for i in range(len(addresses)):
            env = dict(os.environ, TF_CONFIG=tf_config(addresses, i), PYTHONUNBUFFERED="1")
            env[_RESTART_COUNT] = str(restart)
            env.update(environments[i] if environments else {})
            if agent is not None:
                env[AGENT_ENV] = agent
            try:
                if prog is not None:
                    proc = preload.ForkedWorker(prog, env, others=self.procs)
                else:
                    proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            start_new_session=True)
            except OSError:
                self.stop(0.0)
                raise
            self.procs.append(proc)
        # Every worker is started before this start's output threads run (an
        # earlier start's were joined when it stopped): a fork while another
        # thread holds a lock would leave the lock held in the child.
        for i, proc in enumerate(self.procs):
            prefix = f"[worker {i}] ".encode()
            for stream, out in ((proc.stdout, sys.stdout.buffer),
                                (proc.stderr, sys.stderr.buffer)):
                thread = _Prefixer(stream, out, prefix, lock)
                thread.start()
                self.threads.append(thread)

    def running(self):
        return [i for i, p in enumerate(self.procs) if p.poll() is None]

    def signal_all(self, signum):
        for i in range(len(self.procs)):
            self.signal(i, signum)

    def signal(self, i, signum):
        """Sends `signum` to worker i's whole process group."""
        try:
            os.killpg(self.procs[i].pid, signum)
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
            # A stopped worker (SIGSTOP, Ctrl-Z) acts on the SIGTERM only once
            # it runs again: continue it, as systemd does.
            self.signal_all(signal.SIGCONT)
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
    parser = ArgumentParser(
        prog="python -m tfreduce.launch",
        description="Run N workers of a TF_CONFIG multi-worker program on this "
                    "machine: python -m tfreduce.launch --workers 2 -- python train.py",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workers", type=elastic_launch.worker_counts, required=True,
                        metavar="N|MIN:MAX", help="number of worker processes; MIN:MAX "
                        "runs an elastic job (tfreduce.workers.elastic_launch)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the workers reach each other at (TF's server "
                             "itself listens on all interfaces)")
    parser.add_argument("--grace", type=float, default=10.0, metavar="S",
                        help="seconds the other workers get to fail on their own "
                             "after one fails, before they are stopped")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="stop every worker and exit 124 after S seconds "
                             "(restarts included)")
    parser.add_argument("--restarts", type=int, default=0, metavar="N",
                        help=f"after a worker fails, stop every worker and start "
                             f"them all again, up to N times, as a new cluster (new "
                             f"ports); each worker gets {_RESTART_COUNT}=0 at the "
                             f"first start, 1 after the first restart, ...: resume "
                             f"from the latest checkpoint when it is > 0. Ctrl-C, "
                             f"SIGTERM and --timeout never restart")
    parser.add_argument("--stall-seconds", type=float, default=None, metavar="S",
                        help=f"a worker silent for S seconds is named and the others "
                             f"stop (sets {STALL_ENV} for the workers; default "
                             f"{DEFAULT_STALL_SECONDS:g}, or the environment's; 0: off)")
    parser.add_argument("--preload", default=None, metavar="MODULES",
                        help="import these modules (comma-separated, e.g. tensorflow) "
                             "once here, then fork each worker from this process instead "
                             "of starting a new Python, so no worker or restart imports "
                             "them again; the command must then be 'python SCRIPT|-m "
                             "MODULE|-c CODE ...' of this Python")
    parser.add_argument("--verbose", action="store_true",
                        help=f"set {VERBOSE_ENV}=1 for the workers: tfreduce's commands "
                             f"then show TensorFlow's start-up and C++ log lines")
    elastic_launch.add_arguments(parser)
    if "--" in argv:
        cut = argv.index("--")
        options, command = argv[:cut], argv[cut + 1:]
    else:
        options, command = argv, []
    args = parser.parse_args(options)
    if not command:
        parser.error("give the command to run after '--', e.g. "
                     "'--workers 2 -- python train.py'")
    elastic_launch.check_arguments(parser, args)
    if args.grace < 0:
        parser.error(f"--grace must be >= 0 seconds, got {args.grace}")
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.restarts < 0:
        parser.error(f"--restarts must be >= 0, got {args.restarts}")
    if args.stall_seconds is not None and not args.stall_seconds >= 0:
        parser.error(f"--stall-seconds must be >= 0 (0: off), got {args.stall_seconds}")
    args.command = command
    args.program = None
    if args.preload is not None:
        args.preload = [m.strip() for m in args.preload.split(",") if m.strip()]
        if not args.preload:
            parser.error("--preload needs at least one module name, e.g. tensorflow")
        try:
            args.program = preload.program(command)
        except ValueError as e:
            parser.error(str(e))
    return args


def _stop_request(args, interrupted, run_start):
    """Whether a signal to the launcher or --timeout ends the run now.

    Returns:
      (int exit code, str reason) if the run must end, else None.
    """
    if interrupted:
        return (130 if interrupted[0] == signal.SIGINT else 143,
                signal.Signals(interrupted[0]).name)
    if args.timeout is not None and time.monotonic() - run_start > args.timeout:
        return 124, f"--timeout {args.timeout:g}s reached"
    return None


def _supervise(workers, args, interrupted, run_start, log, agent):
    """Waits for the workers; stops them all on a failure (one named frozen to `agent`
    is killed at once: code 75), a signal or --timeout.

    Returns:
      (code, failure): the int exit code (0 when every worker exited with 0),
      and, when a worker's failure ended the run, a str that says which and
      how, e.g. "worker 1 was killed by SIGKILL after 12.3s" (else None).
    """
    started = time.monotonic()
    try:
        while True:
            frozen = [(i, by) for i, (by, _) in sorted(agent.named(workers.addresses).items())
                      if workers.procs[i].poll() is None]
            if frozen:
                i, by = frozen[0]
                failure = (f"worker {i} was named frozen by worker {by}'s watchdog after "
                           f"{time.monotonic() - started:.1f}s")
                log(f"{failure}: stopping it; the others get {args.grace:g}s to finish")
                for j, _ in frozen:  # it can only wait: no grace
                    workers.signal(j, signal.SIGKILL)
                workers.stop(args.grace)
                return EXIT_CODE, failure
            running = workers.running()  # polls, so every returncode is current
            failed = [(i, p.returncode) for i, p in enumerate(workers.procs)
                      if p.returncode not in (None, 0)]
            if failed:
                i, returncode = failed[0]
                failure = (f"worker {i} {_describe(returncode)} after "
                           f"{time.monotonic() - started:.1f}s")
                log(f"{failure}; the others get {args.grace:g}s to finish" if running
                    else failure)
                workers.stop(args.grace)
                return _exit_code(returncode), failure
            if not running:
                return 0, None
            stop = _stop_request(args, interrupted, run_start)
            if stop:
                log(f"{stop[1]}: stopping every worker")
                if interrupted:
                    workers.signal_all(interrupted[0])
                workers.stop(0.0)
                return stop[0], None
            time.sleep(_POLL_SECONDS)
    finally:
        # Whatever happened, nothing of any worker may outlive this start.
        workers.stop(0.0)


def _run(args, interrupted, log):
    """Starts every worker, and again after each failure while restarts remain.

    Returns:
      int, the launcher's exit code (see ``main``).
    """
    run_start = time.monotonic()
    if args.preload:
        try:
            preload.preload(args.preload, args.verbose)
        except ImportError as e:
            log(f"cannot preload {', '.join(args.preload)}: {e}")
            return 127
        log(f"preloaded {', '.join(args.preload)} in {time.monotonic() - run_start:.1f}s")
    agent = Agent(args.host)
    try:
        if args.elastic:
            return elastic_launch.run(
                args, interrupted, log, run_start,
                lambda generation, addresses, environments: _Workers(
                    args.command, addresses, generation, log, args.program, agent.address,
                    environments),
                lambda: _stop_request(args, interrupted, run_start), agent)
        return _starts(args, interrupted, log, run_start, agent)
    finally:
        agent.close()


def _starts(args, interrupted, log, run_start, agent):
    """The starts of ``_run``, each a new cluster whose watchdogs report to `agent`."""
    for restart in range(args.restarts + 1):
        addresses = [f"{args.host}:{p}" if ":" not in args.host else f"[{args.host}]:{p}"
                     for p in free_ports(args.workers, args.host)]
        log(f"{args.workers} worker{'s' if args.workers > 1 else ''} at "
            f"{', '.join(addresses)}: {' '.join(args.command)}")
        try:
            workers = _Workers(args.command, addresses, restart, log, args.program,
                               agent.address)
        except OSError as e:
            log(f"cannot start {args.command[0]!r}: {e.strerror}")
            return 127
        code, failure = _supervise(workers, args, interrupted, run_start, log, agent)
        if failure is None or restart == args.restarts:
            break
        # A signal or --timeout that came during the grace period ends the run.
        stop = _stop_request(args, interrupted, run_start)
        if stop:
            log(f"{stop[1]}: no restart")
            code = stop[0]
            break
        log(f"restart {restart + 1} of {args.restarts}: {failure}")
    restarts = f" ({restart} restart{'s' if restart > 1 else ''})" if restart else ""
    log(f"{'all workers finished' if code == 0 else f'exit code {code}'} after "
        f"{time.monotonic() - run_start:.1f}s{restarts}")
    return code


def main(argv=None):
    """Runs the workers; returns the launcher's exit code.

    Args:
      argv: list of str, the arguments after the program name (None:
        ``sys.argv[1:]``).

    Returns:
      int: 0 when every worker exits with 0 (at the first start or after a
      restart); the code of the failure that used up the last restart (128 +
      signal for a killed worker); 124 after ``--timeout``; 130 after Ctrl-C,
      143 after SIGTERM (also when they come while workers are being stopped
      after a failure, which then is not restarted); 127 when the command
      cannot be started.
    """
    args = parse_args(argv)
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"  # the workers inherit the launcher's environment
    if args.stall_seconds is not None:
        os.environ[STALL_ENV] = f"{args.stall_seconds:g}"

    def log(message):
        sys.stderr.write(f"[launch] {message}\n")
        sys.stderr.flush()

    interrupted = []
    previous = {}

    def on_signal(signum, frame):
        interrupted.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, on_signal)
    try:
        return _run(args, interrupted, log)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
