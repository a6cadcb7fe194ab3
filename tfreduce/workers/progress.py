"""What this process is doing, as its watchdog's heartbeats tell the peers.

The trainer's steps, ``fit``'s batches, Horovod's eager collectives and a
custom loop's ``progress.timed`` steps set ``progress.doing`` while they run
and count the steps done; ``tfreduce.workers.watchdog`` sends both to the peers and
judges this worker's waits by them. Standard library only (the launcher
imports the watchdog without TensorFlow).
"""

import collections
import contextlib
import time

from tfreduce.workers.stragglers import STRAGGLER_STEPS

__all__ = ["IN_JOIN", "IDLE_SHARE", "IdleClock", "progress"]

#: What a process waiting in Horovod's join() is doing (it makes the others' calls).
IN_JOIN = "join() (its data ended)"
#: A process using less than this share of one core is waiting, not working.
IDLE_SHARE = 0.1


class _Progress:
    """What this process is doing, as its heartbeats tell the peers.

    Attributes:
      step: int, training steps done (ReplicatedTrainer's; fit's with
        BroadcastGlobalVariablesCallback; a custom loop's with ``timed``);
        0 where nothing counts them.
      doing: str or None, e.g. "training step 31" or "allreduce of float32 [3]".
      since: float, the monotonic time at which `doing` was last set.
      durations: deque of the last STRAGGLER_STEPS steps' seconds inside
        the step (``timed``), which the straggler report compares.
    """

    def __init__(self):
        self.step = 0
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
