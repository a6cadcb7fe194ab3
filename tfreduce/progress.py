"""What this process is doing, as its watchdog's heartbeats tell the peers.

The trainer's steps, ``fit``'s batches, Horovod's eager collectives and a
custom loop's ``progress.timed`` steps set ``progress.doing`` while they run
and count the steps done; ``tfreduce.watchdog`` sends both to the peers and
judges this worker's waits by them. Standard library only (the launcher
imports the watchdog without TensorFlow).
"""

import collections
import contextlib
import time

from tfreduce.stragglers import STRAGGLER_STEPS

__all__ = ["IN_JOIN", "progress"]

#: What a process waiting in Horovod's join() is doing (it makes the others' calls).
IN_JOIN = "join() (its data ended)"


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
