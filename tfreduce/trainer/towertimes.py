"""Which tower of this process the others wait for: each tower's time to its gradients.

Every training step stamps, on the host, the time at which its batch was
split and the time at which each tower's loss and gradients were ready
(``tf.timestamp`` behind a control dependency on them: no copy, no extra
sync). The reduction waits for the last tower, so a tower whose forward
and backward passes take consistently longer than the others' (a GPU that
throttles, a device that shares its host or its link with other work)
costs every step its lag. `TowerTimes` keeps each tower's time over the
last STRAGGLER_STEPS steps and names a tower whose median lags by the
watchdog's rule for workers (``tfreduce.watchdog.lagging``: more than STRAGGLER_MS
ms and more than half the other towers' median). The report goes to
stderr, at most once every REPORT_EVERY steps; ``fit(logdir=)`` writes
each tower's median as the TensorBoard scalar
``towers/ms_to_gradients/tower_<k>``.
"""

import collections
import sys

from tfreduce.watchdog import REPORT_EVERY, STRAGGLER_STEPS, lagging, median_ms

__all__ = ["TowerTimes"]


class TowerTimes:
    """The last STRAGGLER_STEPS steps' time to gradients of each of K towers, and its report.

    Args:
      devices: list of K str, the towers' devices (they name a tower).
      prefix: str before each report line ("worker 1: " in a cluster, or "").

    Attributes:
      reported: list of str, the report lines so far.
    """

    def __init__(self, devices, prefix=""):
        self.devices = list(devices)
        self.prefix = prefix
        self.reported = []
        self._window = collections.deque(maxlen=STRAGGLER_STEPS)
        self._next_report = 0

    def add(self, step, seconds):
        """Records step `step`'s float [K] seconds from the split to each tower's gradients.

        Reports a tower that lags (stderr) once the window is full, at most
        once every REPORT_EVERY steps.

        Raises:
          ValueError: `seconds` does not hold one value per tower.
        """
        seconds = [float(s) for s in seconds]
        if len(seconds) != len(self.devices):
            raise ValueError(f"TowerTimes.add: {len(seconds)} times for "
                             f"{len(self.devices)} towers")
        self._window.append(seconds)
        medians = self.medians()
        if medians is None or len(medians) < 2 or step < self._next_report:
            return
        found = lagging(medians, "higher")
        if found:
            self._next_report = step + REPORT_EVERY
        for k, mine, theirs, lag in found:
            line = (f"{self.prefix}tower {k} ({self.devices[k]}) lags: the other towers wait "
                    f"about {lag:.0f} ms per step for its gradients (its forward and backward "
                    f"take {mine:.0f} ms, theirs {theirs:.0f} ms, over the last "
                    f"{STRAGGLER_STEPS} steps)")
            self.reported.append(line)
            print(f"tfreduce: at step {step}: {line}", file=sys.stderr, flush=True)

    def medians(self):
        """dict tower -> median ms over the last STRAGGLER_STEPS steps; None until that many ran."""
        if len(self._window) < STRAGGLER_STEPS:
            return None
        return {k: median_ms([step[k] for step in self._window]) for k in range(len(self.devices))}
