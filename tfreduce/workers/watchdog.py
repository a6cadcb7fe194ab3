"""A frozen or vanished worker is named within seconds, instead of a silent hang.

TF's collectives wait for every member: when one worker stops (SIGSTOP, a
stuck driver, a swapped-out host, a deadlock in its input pipeline) the
others wait in their collective with nothing in the log, forever unless the
ops carry a timeout. TF's per-op timeout costs a sleeping thread per op
execution for the whole timeout (thousands of threads in a fast training
loop), so while this thread runs the ops carry none (``Cluster.op_timeout``)
and it enforces the bound instead.

Each started worker runs a ``Watchdog`` thread: it sends a small UDP
heartbeat to every peer once a second (to the peer's host, on the port
number of its gRPC server; UDP and TCP ports are separate spaces) and
listens for theirs. A heartbeat carries the sender's rank, its progress
counter (``progress.step``, training steps), its median time inside its
last steps (``tfreduce.workers.stragglers``: rank 0 names a straggler) and what
it is doing (``progress.doing``: a training step, a fit batch, an eager
collective). A peer silent for ``stall_seconds`` (default 20) is declared
stopped: the watchdog prints one line naming it,
the step it was at and what this worker waits in, then aborts this
process's collectives (``context.abort_collective_ops``, TF's way of
unblocking them, which MultiWorkerMirroredStrategy uses too) so that the
blocked call raises with that line; if the process is still alive
``exit_seconds`` later, it exits with code 75. A peer that still sends
but has not come to the step this worker has waited in for
``stall_seconds`` (fewer steps done, or outside its next one) is named in
a warning: it may be saving a checkpoint, or stuck in its own code. A wait
this worker has spent the cluster's ``timeout`` (300 s by default) in,
idle (the process below a tenth of a core: a step that traces or computes
for minutes is not waiting), is ended the same way, with
DeadlineExceededError and a line naming the peers not in it (or saying
every peer is: different programs, e.g. other models or collectives in
another order). A wait is what ``progress`` tells (training steps, fit
batches, eager collectives, a custom loop's steps in ``progress.timed``),
or else the main thread's current TensorFlow call (a custom loop's
``tf.function`` step, unless every peer has ended), but never ``join()``.

A process that exits cleanly says goodbye first, so a peer that finished
is never taken for a frozen one; a process that an uncaught exception ends
says so instead, with the error, and its peers stop at once the same way
(they could only wait for it).

A process busy for minutes in its first step (tracing, graph optimisation)
keeps sending: the thread needs only the GIL now and then, and TF releases
it while it optimises and runs graphs.

Compared with the field: Horovod's stall inspector warns after 60 s and
shuts down only when asked (``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``);
PyTorch's NCCL watchdog aborts after 10 minutes; TF's
MultiWorkerMirroredStrategy probes peers every 30 s, eagerly only.

Settings: ``Cluster(..., stall_seconds=)``,
``tfreduce.tensorflow.init(stall_seconds=)``, the environment variable
``TFREDUCE_STALL_SECONDS`` (which ``tfreduce-launch --stall-seconds`` sets
for its workers); 0 turns the watchdog off.
"""

import atexit
import hashlib
import json
import os
import socket
import sys
import threading
import time
import warnings

from tfreduce.workers.progress import IN_JOIN, IdleClock, progress
from tfreduce.workers.stragglers import REPORT_EVERY, median_ms, stragglers

__all__ = ["DEFAULT_STALL_SECONDS", "EXIT_CODE", "IN_JOIN", "STALL_ENV", "Watchdog", "progress",
           "stall_seconds_from", "start_watchdog"]

#: Seconds without a heartbeat after which a peer is declared stopped.
DEFAULT_STALL_SECONDS = 20.0
#: Exit code of a process the watchdog ends (EX_TEMPFAIL: try again).
EXIT_CODE = 75
#: The environment variable that sets the bound for every worker.
STALL_ENV = "TFREDUCE_STALL_SECONDS"
# Seconds between heartbeats (at most; 5 per stall bound when it is below 5 s):
# at 4 a second, 8 workers on this 2-core host spent 1% of it on them.
_INTERVAL = 1.0
# A peer that an error ended is acted on this long after its goodbye came:
# a collective it had already finished may still finish here (a check that
# fails on every worker then raises its own error on each).
_FAILED_GRACE = 2.0
# The failing process keeps its connections open for the grace, the
# heartbeat interval in which each peer judges once, and this margin, so that
# its peers name its error before its connections drop.
_FAILED_MARGIN = 0.3
_DOING_CHARS = 160
# The TF error codes aborted collectives raise: UnavailableError, DeadlineExceededError.
_UNAVAILABLE, _DEADLINE_EXCEEDED = 14, 4
# The innermost Python functions of TensorFlow's calls into its runtime: a
# function or eager op (tensorflow/python/eager/execute.py) and a v1 session.
_TF_CALLS = ("quick_execute", "execute_with_cancellation", "_call_tf_sessionrun")


def stall_seconds_from(value=None):
    """The stall bound: `value` if given, else $TFREDUCE_STALL_SECONDS, else the default.

    Raises:
      ValueError: a negative or non-numeric bound (0 turns the watchdog off).
    """
    if value is None:
        value = os.environ.get(STALL_ENV, DEFAULT_STALL_SECONDS)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"stall_seconds must be a number of seconds (0: off), got "
                         f"{value!r}") from None
    if not seconds >= 0:
        raise ValueError(f"stall_seconds must be >= 0 (0: off), got {value!r}")
    return seconds


class Watchdog(threading.Thread):
    """The heartbeat sender, receiver and judge of one worker (a daemon thread).

    Args:
      cluster: tfreduce.Cluster, this worker's (its rank, describe, address).
      stall_seconds: float > 0, a peer silent this long is declared stopped.
      exit_seconds: float, the process exits this long after the abort if it
        is still alive (None: never).
      on_stall: function(message) called instead of aborting (tests), or None.

    Raises:
      OSError: this worker's UDP port cannot be opened.
    """

    def __init__(self, cluster, stall_seconds, exit_seconds=30.0, on_stall=None):
        super().__init__(name="tfreduce-watchdog", daemon=True)
        self.cluster = cluster
        self.stall_seconds = float(stall_seconds)
        self.exit_seconds = exit_seconds
        self.on_stall = on_stall
        self.fired = None  # the message, once a peer was declared stopped
        self._peers = {r: _address(cluster.address(r)) for r in range(cluster.num_workers)
                       if r != cluster.rank}
        # Datagrams of another cluster that reuses a port are ignored.
        self._run = hashlib.sha256(json.dumps(cluster.cluster_spec, sort_keys=True)
                                   .encode()).hexdigest()[:16]
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("", _address(cluster.address())[1]))
        # Several heartbeats per stall bound, at most one a second.
        self._interval = min(_INTERVAL, self.stall_seconds / 5)
        self._socket.settimeout(self._interval)
        self._heard = {}  # rank -> (monotonic time, their heartbeat)
        self._gone = set()  # ranks that said goodbye
        self._failed = {}  # rank -> the error that ended it (a goodbye of a failure)
        self._sent = 0.0
        self.reported = []  # the straggler reports and warnings so far
        self._warned = set()  # (peer rank, this worker's step) warned of
        self._next_report = 0  # the step from which another report may come
        self._stop = threading.Event()
        self._clock = IdleClock()  # the idle seconds of the current wait
        atexit.register(self.goodbye)

    def run(self):
        while not self._stop.is_set():
            now = time.monotonic()
            if now - self._sent >= self._interval:
                self._send("beat")
                self._sent = now
                self._judge(now)  # once per heartbeat: every datagram would cost CPU
            self._receive()

    def _judge(self, now):
        """Fires for a silent or failed peer, warns of one behind, reports stragglers."""
        stopped = self._stopped(now)
        if stopped is not None and self.fired is None:
            self._fire(stopped)
        failed = [r for r in sorted(self._failed) if now - self._heard[r][0] >= _FAILED_GRACE]
        if failed and self.fired is None:
            self._fire(failed[0])
        if self.fired is None:
            self._warn_behind(now)
        if self.fired is None:
            self._end_long_wait(now)
        if self.cluster.rank == 0:  # the chief reports, once for all
            self._report_stragglers()

    def goodbye(self):
        """Tells the peers this process ends (with the error that ends it); stops the thread.

        Registered with atexit: an uncaught exception is ``sys.last_value`` then.
        After an error's goodbye the process lingers 2 s, one heartbeat
        interval and 0.3 s: a peer acts on the error 2 s after it came (a
        collective this process finished may finish there too), at its next
        judgement (once per interval), and names the error before this
        process's connections drop (its collectives would then fail on a
        closed socket first)."""
        if not self._stop.is_set():
            self._stop.set()
            error = getattr(sys, "last_value", None)
            for _ in range(3):  # datagrams may be lost between machines
                self._send("bye" if error is None else "failed", _error_line(error))
            if error is not None:
                time.sleep(_FAILED_GRACE + self._interval + _FAILED_MARGIN)

    def _send(self, kind, error=None):
        beat = json.dumps({"run": self._run, "rank": self.cluster.rank, "kind": kind,
                           "step": progress.step, "ms": median_ms(progress.durations),
                           "doing": (progress.doing or "")[:_DOING_CHARS],
                           "error": (error or "")[:_DOING_CHARS]}).encode()
        for address in self._peers.values():
            try:
                self._socket.sendto(beat, address)
            except OSError:
                pass  # a peer's host unreachable now: its silence will tell

    def _receive(self):
        try:
            data, _ = self._socket.recvfrom(4096)
            beat = json.loads(data.decode())
            rank = int(beat["rank"])
        except (socket.timeout, OSError, ValueError, KeyError, TypeError):
            return
        if rank not in self._peers or beat.get("run") != self._run:
            return
        if beat.get("kind") in ("bye", "failed"):
            self._gone.add(rank)
        if beat.get("kind") == "failed":
            self._failed[rank] = beat.get("error") or "an error"
        self._heard[rank] = (time.monotonic(), beat)

    def _stopped(self, now):
        """The rank of a peer heard before and silent for stall_seconds since, or None.

        A peer never heard is not judged: it may still be starting (TF's
        import and the server's start take seconds, more on a loaded host),
        or a firewall may drop UDP between hosts; ``_end_long_wait`` ends
        an idle wait for it."""
        for rank, (last, _) in sorted(self._heard.items()):
            if rank not in self._gone and now - last > self.stall_seconds:
                return rank
        return None

    def _behind(self):
        """The ranks of live peers that have not come to the step this worker is in."""
        ranks = []
        for rank, (_, beat) in sorted(self._heard.items()):
            step, doing = beat.get("step") or 0, beat.get("doing")
            if rank in self._gone or doing == IN_JOIN:
                continue  # a peer in join() makes the others' calls: it is not waited for
            if step < progress.step or (step == progress.step and not doing):
                ranks.append(rank)
        return ranks

    def _warn_behind(self, now):
        """Warns (once per peer and step) of a live peer that this worker has waited for too long.

        After its first step, this worker has been inside a step (or an
        eager collective) for stall_seconds, and a peer that still sends
        heartbeats has done fewer steps, or as many and is outside its next
        one: loading data, saving a checkpoint, or stuck in its own code. It
        may come yet, so this is a warning; ``_end_long_wait`` ends a wait
        that lasts the cluster's timeout."""
        if (not progress.doing or progress.step < 1
                or now - progress.since <= self.stall_seconds):
            return  # the first step's skew (imports, tracing) is no one's fault
        for rank in self._behind():
            key = (rank, progress.step)
            if key in self._warned:
                continue
            self._warned.add(key)
            _, beat = self._heard[rank]
            step, doing = beat.get("step") or 0, beat.get("doing")
            line = (f"{self.cluster.describe(self.cluster.rank)}: "
                    f"{self.cluster.describe(rank)} is alive but has not come to "
                    f"{_state(progress.step, progress.doing)} for {now - progress.since:.0f} s "
                    f"(its heartbeat: {_state(step, doing) or 'no step done'}); it "
                    f"may be loading data, saving a checkpoint or stuck in its own code. This "
                    f"worker waits for it until the collectives' timeout "
                    f"({self.cluster.timeout:g} s idle).")
            self.reported.append(line)
            print(f"tfreduce watchdog: {line}", file=sys.stderr, flush=True)

    def _end_long_wait(self, now):
        """Ends a wait this worker has spent the cluster's timeout in, idle (DeadlineExceededError).

        One thread bounds every wait, not a thread per op execution (``Cluster.op_timeout``).
        Only unbroken idle seconds count (``IdleClock``): a first step may trace for minutes.
        Once every peer has said goodbye, an untold TensorFlow call is this
        worker's own work; a told step or collective can no longer finish."""
        idle = self._clock.tick(now, time.process_time(), _current_wait())
        if idle <= self.cluster.timeout or not (progress.doing or set(self._peers) - self._gone):
            return
        self._abort(f"{self.cluster.describe(self.cluster.rank)}: waited {idle:.0f} s, "
                    f"idle, in {self._clock.wait[1]}: the collectives' timeout "
                    f"({self.cluster.timeout:g} s); {self._who()}. Stopping them.",
                    _DEADLINE_EXCEEDED)

    def _who(self):
        """Which peers the long wait is for, as far as their heartbeats tell."""
        def named(ranks, singular, plural):
            names = ", ".join(self.cluster.describe(rank) for rank in ranks)
            return f"{names} {singular if len(ranks) == 1 else plural}"
        parts = []
        behind = self._behind() if progress.doing else []
        if behind:
            parts.append(named(behind, "has", "have") + " not come to it (alive, but stuck "
                         "or much slower)")
        unheard = sorted(set(self._peers) - set(self._heard) - self._gone)
        if unheard:
            parts.append(named(unheard, "has", "have") + " sent no heartbeat (not started, "
                         "or UDP between the hosts is blocked)")
        gone = sorted(self._gone - set(self._failed))
        if gone:
            parts.append(named(gone, "has", "have") + " ended")
        if parts:
            return "; ".join(parts)
        if not progress.doing:
            return ("what the peers do is not told (a custom loop tells it with "
                    "tfreduce.workers.watchdog.progress.timed)")
        return ("every peer that still sends is in it too: the workers may run different "
                "programs (other models, shapes, or collectives in another order)")

    def step_medians(self):
        """dict rank -> median ms inside the last STRAGGLER_STEPS steps (None until known).

        This worker's own and each peer's from its latest heartbeat."""
        medians = {rank: None for rank in range(self.cluster.num_workers)}
        medians[self.cluster.rank] = median_ms(progress.durations)
        for rank, (_, beat) in list(self._heard.items()):
            if rank not in self._gone:
                medians[rank] = beat.get("ms")
        return medians

    def write_scalars(self):
        """Writes each known median as ``workers/ms_inside_step/worker_<r>``.

        Into the default tf.summary writer, at its step; the straggler is the
        lowest curve (``tfreduce.workers.stragglers``)."""
        import tensorflow as tf  # here: the launcher imports this module without TensorFlow
        for rank, ms in sorted(self.step_medians().items()):
            if ms is not None:
                tf.summary.scalar(f"workers/ms_inside_step/worker_{rank}", ms)

    def _report_stragglers(self):
        if progress.step < self._next_report:
            return
        medians = self.step_medians()
        if None in medians.values():
            return
        lines = stragglers(medians, self.cluster.describe)
        if lines:
            self._next_report = progress.step + REPORT_EVERY
            for line in lines:
                self.reported.append(line)
                print(f"tfreduce watchdog: at step {progress.step}: {line}", file=sys.stderr,
                      flush=True)

    def _fire(self, rank):
        when, beat = self._heard[rank]
        theirs = _state(beat.get("step"), beat.get("doing"))
        mine = _state(progress.step, progress.doing)
        if rank in self._failed:
            what = (f"{self.cluster.describe(rank)} ended with {self._failed[rank]}"
                    f"{f' ({theirs})' if theirs else ''}; this worker cannot go on without "
                    f"it (it was in {mine or 'its collectives'}). Stopping them.")
        else:
            what = (f"{self.cluster.describe(rank)} has sent no heartbeat for "
                    f"{time.monotonic() - when:.0f} s: frozen, stopped or cut off"
                    f"{f' (its last heartbeat: {theirs})' if theirs else ''}; this worker "
                    f"waits in {mine or 'its collectives'}. Stopping them "
                    f"(stall_seconds={self.stall_seconds:g}).")
        self._abort(f"{self.cluster.describe(self.cluster.rank)}: {what}", _UNAVAILABLE)

    def _abort(self, message, code):
        """Says `message`, then aborts this process's collectives with TF error `code`."""
        self.fired = message
        self._clock.forget()  # the wait's frame is let go
        print(f"tfreduce watchdog: {self.fired}", file=sys.stderr, flush=True)
        if self.on_stall is not None:
            self.on_stall(self.fired)
            return
        # Imported here: the launcher reads this module's settings without TensorFlow.
        from tensorflow.python.eager import context
        context.context().abort_collective_ops(code, self.fired)
        if self.exit_seconds is not None:
            # A daemon: a process that ends by itself is not held back by it.
            timer = threading.Timer(self.exit_seconds, _exit, [self.fired])
            timer.daemon = True
            timer.start()


def start_watchdog(cluster):
    """Starts the Watchdog of a started Cluster of several workers, unless stall_seconds is 0.

    Returns:
      the running Watchdog, or None (off, one worker, or its UDP port taken:
      then a warning says a frozen peer waits for the collectives' timeout).
    """
    if not cluster.stall_seconds or cluster.num_workers < 2:
        return None
    try:
        watchdog = Watchdog(cluster, cluster.stall_seconds)
    except OSError as e:
        warnings.warn(f"{cluster.describe(cluster.rank)}: no watchdog (UDP port "
                      f"{cluster.address()} cannot be opened: {e}); a frozen peer is "
                      f"noticed only by the collectives' timeout ({cluster.timeout:g} s)",
                      stacklevel=3)
        return None
    watchdog.start()
    return watchdog


def _current_wait():
    """What this process waits in: (an object the same for the whole wait, its name) or None.

    What ``progress`` tells (a step, a fit batch, an eager collective), or
    else a TensorFlow graph or op the main thread runs now (a custom loop's
    ``tf.function`` step: its frame stays the same for the whole call);
    None outside both, and in ``join()`` (the others may train long after
    this process's data ended)."""
    if progress.doing == IN_JOIN:
        return None
    if progress.doing:
        return progress.since, _state(progress.step, progress.doing)
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is not None and frame.f_code.co_name in _TF_CALLS:
        return frame, f"a TensorFlow call of the main thread ({frame.f_code.co_name})"
    return None


def _state(step, doing):
    """E.g. "training step 32 (31 steps done)"; "" when nothing is told (a custom loop)."""
    if doing and step:
        return f"{doing} ({step} steps done)"
    return doing or (f"{step} steps done" if step else "")


def _error_line(error):
    """"ValueError: <its first line>" of an exception; None for None."""
    if error is None:
        return None
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _exit(message):
    print(f"tfreduce watchdog: the process did not end after its collectives were aborted; "
          f"exiting with code {EXIT_CODE}. {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)


def _address(host_port):
    host, port = host_port.rsplit(":", 1)
    return host.strip("[]"), int(port)
