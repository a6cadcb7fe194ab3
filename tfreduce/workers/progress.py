"""What this process is doing, as its watchdog's heartbeats tell the peers.

The trainer's steps, ``fit``'s batches, Horovod's eager collectives and a
custom loop's ``progress.timed`` steps set ``progress.doing`` while they run
and count the steps done; ``tfreduce.workers.watchdog`` sends both to the peers and
judges this worker's waits by them. Standard library only (the launcher
imports the watchdog without TensorFlow).
"""

import collections
import contextlib
import sys
import threading
import time

from tfreduce.workers.stragglers import STRAGGLER_STEPS

__all__ = ["IN_JOIN", "IDLE_SHARE", "IdleClock", "current_wait", "describe_state", "measure",
           "observe", "progress"]

#: What a process waiting in Horovod's join() is doing (it makes the others' calls).
IN_JOIN = "join() (its data ended)"
#: A process using less than this share of one core is waiting, not working.
IDLE_SHARE = 0.1
# The innermost Python functions of TensorFlow's calls into its runtime: a
# function or eager op (tensorflow/python/eager/execute.py) and a v1 session.
_TF_CALLS = ("quick_execute", "execute_with_cancellation", "_call_tf_sessionrun")


class _Progress:
    """What this process is doing, as its heartbeats tell the peers.

    Attributes:
      step: int, training steps done (ReplicatedTrainer's; fit's with
        BroadcastGlobalVariablesCallback; a custom loop's with ``timed``);
        0 where nothing counts them.
      told: bool, a loop counts its steps here (``advance`` was called);
        until then the watchdog counts the cross-worker collective rounds
        of the traced steps instead (``tfreduce.workers.rounds``).
      doing: str or None, e.g. "training step 31" or "allreduce of float32 [3]".
      since: float, the monotonic time at which `doing` was last set.
      durations: deque of the last STRAGGLER_STEPS steps' seconds inside
        the step (``timed``), which the straggler report compares.
    """

    def __init__(self):
        self.step = 0
        self.told = False
        self._doing = None
        self.since = time.monotonic()
        self.durations = collections.deque(maxlen=STRAGGLER_STEPS)

    @property
    def doing(self):
        return self._doing

    @doing.setter
    def doing(self, value):
        self._doing = value
        self.since = time.monotonic()

    @contextlib.contextmanager
    def within(self, doing):
        """Sets `doing` for the duration of the block (restored after)."""
        before, self.doing = self.doing, doing
        try:
            yield
        finally:
            self.doing = before

    def advance(self, step=None):
        """One more step done (or the step counter set to `step`)."""
        self.told = True
        self.step = self.step + 1 if step is None else int(step)

    @contextlib.contextmanager
    def timed(self, doing=None, step=None):
        """A training step: `doing` while it runs, its duration kept, then ``advance(step)``.

        Wrap only the call of the step itself (not the input pipeline), e.g.
        in a custom loop ``with progress.timed(f"step {i}"): loss = step(x, y)``:
        a worker slowed outside its steps is then the one whose steps take
        least, because the others wait for it inside theirs.
        """
        start = time.monotonic()
        with self.within(doing or f"training step {self.step + 1}"):
            yield
        self.durations.append(time.monotonic() - start)
        self.advance(step)


#: This process's progress (one per process: a process is one worker).
progress = _Progress()


#: What a process is doing, from its cross-worker rounds (``observe``): like ``progress``.
RoundsView = collections.namedtuple("RoundsView", "step doing since durations")


def observe(reading, memo):
    """What this process is doing, as its heartbeats tell it: ``progress``, or its rounds.

    Args:
      reading: None, or (entered, left, waits) of its cross-worker rounds
        (``tfreduce.workers.rounds``), when no loop tells its steps.
      memo: None, or (round, monotonic time) of the round first seen waited in.

    Returns:
      (view, memo): ``progress`` itself without a reading; else a
      RoundsView whose step is the rounds left, whose doing is the eager
      call told or the round waited in (since it was first seen), whose
      durations are the rounds' waits; and the memo to pass next time.
    """
    if reading is None:
        return progress, memo
    entered, left, waits = reading
    doing, since = progress.doing, progress.since
    if not doing and entered > left:
        if memo is None or memo[0] != entered:
            memo = (entered, time.monotonic())
        doing, since = f"cross-worker round {entered}", memo[1]
    return RoundsView(left, doing, since, waits), memo


def measure(view):
    """What a view's durations measure: "steps" (told) or "rounds" (the waits in them)."""
    return "steps" if view is progress else "rounds"


def current_wait():
    """What this process waits in: (an object the same for the whole wait, its name) or None.

    What ``progress`` tells (a step, a fit batch, an eager collective), or
    else a TensorFlow graph or op the main thread runs now (a custom loop's
    ``tf.function`` step: its frame stays the same for the whole call);
    None outside both, and in ``join()`` (the others may train long after
    this process's data ended)."""
    if progress.doing == IN_JOIN:
        return None
    if progress.doing:
        return progress.since, describe_state(progress.step, progress.doing)
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is not None and frame.f_code.co_name in _TF_CALLS:
        return frame, f"a TensorFlow call of the main thread ({frame.f_code.co_name})"
    return None


def describe_state(step, doing):
    """E.g. "training step 32 (31 steps done)"; "" when nothing is told (a custom loop)."""
    if doing and step:
        return f"{doing} ({step} steps done)"
    return doing or (f"{step} steps done" if step else "")


class IdleClock:
    """The unbroken idle seconds this process has spent in its current wait.

    The watchdog's long-wait rule: TF's per-op timeout counts from the op's
    start, but one thread cannot see ops start, so it counts the seconds in
    which the process waits (uses under `share` of a core) inside one wait.
    A new wait, or an interval of work (tracing, a step's compute), starts
    the count again, as a new op would start TF's timer.

    Args:
      share: float, the share of one core under which a process is idle.

    Attributes:
      wait: (key, name) of the current wait, or None; the key is the same
        object for the whole wait.
      idle: float seconds, idle without a break since the wait began.
    """

    def __init__(self, share=IDLE_SHARE):
        self.share = share
        self.wait, self.idle = None, 0.0
        self._last = None  # (time, CPU seconds) at the last tick

    def tick(self, now, cpu, wait):
        """Counts the interval since the last tick; returns `idle`.

        Args:
          now: float, monotonic seconds.
          cpu: float, the process's CPU seconds (``time.process_time``).
          wait: (key, name) of the wait the process is in now, or None.
        """
        last, self._last = self._last, (now, cpu)
        if last is None or wait is None or self.wait is None or wait[0] is not self.wait[0]:
            self.wait, self.idle = wait, 0.0
        else:
            span = now - last[0]
            self.idle = self.idle + span if cpu - last[1] < self.share * span else 0.0
        return self.idle

    def forget(self):
        """Drops the current wait (and so the frame its key may be)."""
        self.wait, self.idle = None, 0.0
