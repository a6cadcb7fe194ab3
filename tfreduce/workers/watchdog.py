"""A frozen or vanished worker is named within seconds, instead of a silent hang.

TF's collectives wait for every member: when one worker stops (SIGSTOP, a
stuck driver, a swapped-out host, a deadlock in its input pipeline) the
others wait with nothing in the log. TF's per-op timeout costs a sleeping
thread per op execution for the whole timeout, so while this thread runs
the ops carry none (``Cluster.op_timeout``) and it enforces the bound.

Each started worker runs a ``Watchdog`` thread that sends a UDP heartbeat
to every peer once a second (``tfreduce.workers.heartbeats``): its step
count, its median time inside its last steps, what it is doing
(``progress``; in a loop that tells nothing, the cross-worker rounds of its
traced steps, ``tfreduce.workers.rounds``). ``Cluster.start()`` returns
once every peer was heard, so no peer is unknown at the first collective.
The rules, judged once per heartbeat:

- silent for ``stall_seconds`` (default 20): frozen, stopped or cut off.
  The watchdog prints a line naming it, its last state and what this
  worker waits in, tells the launcher (``tfreduce.workers.agent``: it kills
  the frozen worker), and aborts this process's collectives
  (``context.abort_collective_ops``, as MultiWorkerMirroredStrategy does)
  so the blocked call raises with that line; a process still alive
  ``exit_seconds`` later exits with code 75;
- ended by an error (its goodbye carries it): named at once, the same way;
- ended cleanly while this worker waits, idle, in a collective (a told
  step or call, or a round) for ``stall_seconds``: it cannot come;
- alive but not come to the step this worker has waited in for
  ``stall_seconds``: a warning (it may be saving a checkpoint);
- a wait idle (under a tenth of a core) for the cluster's ``timeout``
  (300 s): ended with DeadlineExceededError, naming the peers not in it.
  A wait is what ``progress`` tells, a round, or else the main thread's
  TensorFlow call (unless every peer has ended), never ``join()``;
- the chief names a straggler (``tfreduce.workers.stragglers``).

A first step busy for minutes (tracing, graph optimisation) keeps sending:
the thread needs the GIL only now and then, and TF releases it meanwhile.
Compared with the field: Horovod's stall inspector warns after 60 s and
shuts down only when asked; PyTorch's NCCL watchdog aborts after 10
minutes; MultiWorkerMirroredStrategy probes peers every 30 s, eagerly only.

Settings: ``Cluster(..., stall_seconds=)``, ``tfreduce.tensorflow.init(
stall_seconds=)``, ``TFREDUCE_STALL_SECONDS`` (``tfreduce-launch
--stall-seconds`` sets it for its workers); 0 turns the watchdog off.
"""

import atexit
import os
import sys
import threading
import time
import warnings

from tfreduce.workers.agent import tell as tell_agent
from tfreduce.workers.heartbeats import Heartbeats
from tfreduce.workers.progress import IN_JOIN, IdleClock, measure, observe, progress
from tfreduce.workers.progress import current_wait as _current_wait
from tfreduce.workers.progress import describe_state as _state
from tfreduce.workers.stragglers import (REPORT_EVERY, STRAGGLER_MS, median_ms, stragglers,
                                        worker_medians)

__all__ = ["DEFAULT_STALL_SECONDS", "EXIT_CODE", "IN_JOIN", "STALL_ENV", "Watchdog",
           "progress", "stall_seconds_from", "start_watchdog"]

#: Seconds without a heartbeat after which a peer is declared stopped.
DEFAULT_STALL_SECONDS = 20.0
#: Exit code of a process the watchdog ends (EX_TEMPFAIL: try again).
EXIT_CODE = 75
#: The environment variable that sets the bound for every worker.
STALL_ENV = "TFREDUCE_STALL_SECONDS"
# Seconds between heartbeats (at most; 5 per stall bound when it is below 5 s):
# at 4 a second, 8 workers on this 2-core host spent 1% of it on them.
_INTERVAL = 1.0
# Seconds between the thread's looks at its own step times: a median that
# moved by half the straggler margin is sent at once (at most this often),
# so that the chief, which judges stragglers on every heartbeat it gets,
# names one within a few steps of the rule's window turning.
_LOOK = 0.1
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
        self.beats = Heartbeats(cluster)
        # Several heartbeats per stall bound, at most one a second.
        self._interval = min(_INTERVAL, self.stall_seconds / 5)
        self.beats.set_timeout(min(self._interval, _LOOK))
        self._sent = self._judged = 0.0
        self._sent_ms = None  # the median ms of the last heartbeat sent
        self.reported = []  # the straggler reports and warnings so far
        self._warned = set()  # (peer rank, this worker's step) warned of
        self._next_report = 0  # the step from which another report may come
        self._stop = threading.Event()
        self._clock = IdleClock()  # the idle seconds of the current wait
        # The cross-worker rounds of the traced steps (Cluster.rounds), read
        # where no loop tells its steps; the round waited in, since when.
        self._rounds = getattr(cluster, "rounds", None)
        self._round = None  # (round number, monotonic time first seen in it)
        atexit.register(self.goodbye)

    def run(self):
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception as error:  # noqa: BLE001 - a dead watchdog would leave hangs silent
                print(f"tfreduce watchdog: {self.cluster.describe(self.cluster.rank)}: "
                      f"{type(error).__name__}: {error} (the watchdog goes on)",
                      file=sys.stderr, flush=True)
                time.sleep(self._interval)

    def _turn(self):
        now = time.monotonic()
        if now - self._judged >= self._interval:
            self._send("beat")
            self._judged = now
            self._judge(now)  # once per heartbeat: every datagram would cost CPU
        elif now - self._sent >= 2 * _LOOK and self._median_moved():
            self._send("beat")  # a straggler's onset reaches the chief now
            self._report_stragglers()
        self._receive()

    def _median_moved(self):
        ms = median_ms(self.view.durations)
        if ms is None or self._sent_ms is None:
            return ms != self._sent_ms
        return abs(ms - self._sent_ms) > STRAGGLER_MS / 2

    def wait_for_peers(self, bound):
        """The ranks (list of int) not heard within `bound` s (``Heartbeats.wait_for_peers``).

        ``Cluster.start()`` waits so: a peer that freezes later, however
        soon, is then one that fell silent."""
        return self.beats.wait_for_peers(bound, self.stall_seconds)

    @property
    def view(self):
        """What this worker is doing, as its heartbeats tell it (``progress.observe``)."""
        reading = None if progress.told or self._rounds is None else self._rounds.latest()
        view, self._round = observe(reading, self._round)
        return view

    def _judge(self, now):
        """Fires for a silent, failed or ended peer, warns of one behind, reports stragglers."""
        failed = [r for r in sorted(self.beats.failed)
                  if now - self.beats.heard[r][0] >= _FAILED_GRACE]
        for peer in [self._stopped(now)] + failed[:1]:
            if peer is not None and self.fired is None:
                self._fire(peer)
        for rule in (self._warn_behind, self._end_long_wait, self._end_wait_for_ended):
            if self.fired is None:
                rule(now)
        self._report_stragglers()

    def goodbye(self):
        """Tells the peers this process ends (with the error that ends it); stops the thread.

        Registered with atexit (an uncaught exception is ``sys.last_value``
        then). After an error's goodbye the process lingers 2 s, one
        heartbeat interval and 0.3 s, so that each peer names the error (at
        its next judgement) before this process's connections drop."""
        if not self._stop.is_set():
            self._stop.set()
            error = getattr(sys, "last_value", None)
            for _ in range(3):  # datagrams may be lost between machines
                self._send("bye" if error is None else "failed", _error_line(error))
            if error is not None:
                time.sleep(_FAILED_GRACE + self._interval + _FAILED_MARGIN)

    def _send(self, kind, error=None, to=None):
        view = self.view
        ms = median_ms(view.durations)
        if to is None:
            self._sent, self._sent_ms = time.monotonic(), ms
        self.beats.send({"kind": kind, "step": view.step, "ms": ms, "of": measure(view),
                         "doing": (view.doing or "")[:_DOING_CHARS],
                         "error": (error or "")[:_DOING_CHARS]}, to)

    def _receive(self):
        got = self.beats.receive()
        if got is None:
            return
        rank, first = got
        if first and self.beats.heard[rank][1].get("kind") == "beat":
            # Answered at once: a peer whose heartbeat came before this one
            # listened hears of it now, not a heartbeat interval later.
            self._send("beat", to=rank)
        self._report_stragglers()  # on the newest news

    def _stopped(self, now):
        """The rank of a peer heard before and silent for stall_seconds since, or None.

        A started cluster has heard every peer (``wait_for_peers``); one
        never heard may still be starting, and is not judged."""
        for rank, (last, _) in sorted(self.beats.heard.items()):
            if rank not in self.beats.gone and now - last > self.stall_seconds:
                return rank
        return None

    def _behind(self):
        """The ranks of live peers that have not come to the step this worker is in."""
        view, ranks = self.view, []
        for rank, (_, beat) in sorted(self.beats.heard.items()):
            step, doing = beat.get("step") or 0, beat.get("doing")
            if rank in self.beats.gone or doing == IN_JOIN:
                continue  # a peer in join() makes the others' calls: it is not waited for
            if step < view.step or (step == view.step and not doing):
                ranks.append(rank)
        return ranks

    def _warn_behind(self, now):
        """Warns (once per peer and step) of a live peer that this worker has waited for too long.

        After its first step this worker has been inside a step (or an eager
        collective, or a round) for stall_seconds, and a peer that still
        sends has done fewer steps, or as many and is outside its next one
        (loading data, saving a checkpoint): it may come yet."""
        view = self.view
        if not view.doing or view.step < 1 or now - view.since <= self.stall_seconds:
            return  # the first step's skew (imports, tracing) is no one's fault
        for rank in self._behind():
            key = (rank, view.step)
            if key in self._warned:
                continue
            self._warned.add(key)
            _, beat = self.beats.heard[rank]
            step, doing = beat.get("step") or 0, beat.get("doing")
            line = (f"{self.cluster.describe(self.cluster.rank)}: "
                    f"{self.cluster.describe(rank)} is alive but has not come to "
                    f"{_state(view.step, view.doing)} for {now - view.since:.0f} s "
                    f"(its heartbeat: {_state(step, doing) or 'no step done'}); it "
                    f"may be loading data, saving a checkpoint or stuck in its own code. This "
                    f"worker waits for it until the collectives' timeout "
                    f"({self.cluster.timeout:g} s idle).")
            self.reported.append(line)
            print(f"tfreduce watchdog: {line}", file=sys.stderr, flush=True)

    def _end_long_wait(self, now):
        """Ends a wait this worker has spent the cluster's timeout in, idle (DeadlineExceededError).

        Only unbroken idle seconds count (``IdleClock``): a first step may
        trace for minutes. Once every peer has said goodbye, an untold
        TensorFlow call is this worker's own work."""
        idle = self._clock.tick(now, time.process_time(), self._current_wait())
        if idle <= self.cluster.timeout or not (self.view.doing
                                                or set(self.beats.peers) - self.beats.gone):
            return
        self._abort(f"{self.cluster.describe(self.cluster.rank)}: waited {idle:.0f} s, "
                    f"idle, in {self._clock.wait[1]}: the collectives' timeout "
                    f"({self.cluster.timeout:g} s); {self._who()}. Stopping them.",
                    _DEADLINE_EXCEEDED)

    def _end_wait_for_ended(self, now):
        """Fires for a peer that ended cleanly while this worker waits, idle, in a collective.

        A told wait or a round, idle for stall_seconds (``IdleClock``, ticked
        by ``_end_long_wait``): every collective spans every worker. One the
        peer finished before its goodbye finishes here within milliseconds."""
        del now
        ended, view = sorted(self.beats.gone - set(self.beats.failed)), self.view
        if (ended and view.doing and view.doing != IN_JOIN
                and self._clock.idle > self.stall_seconds):
            self._fire(ended[0])

    def _current_wait(self):
        """``_current_wait()``, or the cross-worker round the view says this worker waits in."""
        view = self.view
        if view is not progress and view.doing and not progress.doing:
            return view.since, _state(view.step, view.doing)
        return _current_wait()

    def _who(self):
        """Which peers the long wait is for, as far as their heartbeats tell."""
        def named(ranks, singular, plural):
            names = ", ".join(self.cluster.describe(rank) for rank in ranks)
            return f"{names} {singular if len(ranks) == 1 else plural}"

        parts = []
        doing = self.view.doing
        behind = self._behind() if doing else []
        if behind:
            parts.append(named(behind, "has", "have") + " not come to it (alive, but stuck "
                         "or much slower)")
        unheard = sorted(set(self.beats.unheard()) - self.beats.gone)
        if unheard:
            parts.append(named(unheard, "has", "have") + " sent no heartbeat (not started, "
                         "or UDP between the hosts is blocked)")
        gone = sorted(self.beats.gone - set(self.beats.failed))
        if gone:
            parts.append(named(gone, "has", "have") + " ended")
        if parts:
            return "; ".join(parts)
        if not doing:
            return ("what the peers do is not told (a custom loop tells it with "
                    "tfreduce.workers.watchdog.progress.timed)")
        return ("every peer that still sends is in it too: the workers may run different "
                "programs (other models, shapes, or collectives in another order)")

    def step_medians(self):
        """dict rank -> median ms inside (or, untold, waiting in) the last steps (None: unknown).

        This worker's own and each peer's latest heartbeat's (``worker_medians``)."""
        view = self.view
        return worker_medians(self.cluster.num_workers, self.cluster.rank,
                              median_ms(view.durations), measure(view), self.beats.heard,
                              self.beats.gone)

    def write_scalars(self):
        """Writes each known median as ``workers/ms_inside_step/worker_<r>`` (the default
        tf.summary writer, its step); the straggler is the lowest curve."""
        import tensorflow as tf  # here: the launcher imports this module without TensorFlow
        for rank, ms in sorted(self.step_medians().items()):
            if ms is not None:
                tf.summary.scalar(f"workers/ms_inside_step/worker_{rank}", ms)

    def _report_stragglers(self):
        """The chief (rank 0) names the stragglers, once for all workers."""
        if self.cluster.rank != 0 or self.fired is not None or self.view.step < self._next_report:
            return
        medians = self.step_medians()
        if None in medians.values():
            return
        view = self.view
        lines = stragglers(medians, self.cluster.describe, measure(view))
        if lines:
            self._next_report = view.step + REPORT_EVERY
            for line in lines:
                self.reported.append(line)
                print(f"tfreduce watchdog: at step {view.step}: {line}", file=sys.stderr,
                      flush=True)

    def _fire(self, rank):
        when, beat = self.beats.heard[rank]
        theirs = _state(beat.get("step"), beat.get("doing"))
        view = self.view
        mine = _state(view.step, view.doing)
        if rank in self.beats.failed:
            what = (f"{self.cluster.describe(rank)} ended with {self.beats.failed[rank]}"
                    f"{f' ({theirs})' if theirs else ''}; this worker cannot go on without "
                    f"it (it was in {mine or 'its collectives'}). Stopping them.")
        elif rank in self.beats.gone:
            what = (f"{self.cluster.describe(rank)} has ended (a clean exit, "
                    f"{time.monotonic() - when:.0f} s ago{f', after {theirs}' if theirs else ''}) "
                    f"while this worker waits in {mine}, which cannot finish without it. "
                    f"Stopping them.")
        else:
            # The launcher (if any) stops it: it cannot end by itself.
            tell_agent(self.cluster.address(), self.cluster.address(rank), "frozen")
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
        if getattr(self.cluster, "mpi", None) is not None:  # a call waiting in MPI raises too
            self.cluster.mpi.abort(self.fired)
        if self.exit_seconds is not None:
            # A daemon: a process that ends by itself is not held back by it.
            timer = threading.Timer(self.exit_seconds, _exit, [self.fired])
            timer.daemon = True
            timer.start()


def start_watchdog(cluster):
    """Starts the Watchdog of a started Cluster of several workers, unless stall_seconds is 0.

    Returns the running Watchdog, or None (off, one worker, or no UDP port
    at all: a warning says so); ``wait_for_peers`` is the caller's."""
    if not cluster.stall_seconds or cluster.num_workers < 2:
        return None
    try:
        watchdog = Watchdog(cluster, cluster.stall_seconds)
    except OSError as e:
        warnings.warn(f"{cluster.describe(cluster.rank)}: no watchdog (no UDP port can be "
                      f"opened: {e}); a frozen peer is noticed only by the collectives' "
                      f"timeout ({cluster.timeout:g} s)", stacklevel=3)
        return None
    watchdog.start()
    return watchdog


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
