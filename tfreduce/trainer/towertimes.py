"""Which tower of this process the others wait for: each tower's time to its gradients.

Every training step stamps, on the host, the time at which its batch was
split and the time at which each tower's loss and gradients were ready
(``tf.timestamp`` behind a control dependency on them: no copy, no extra
sync). The reduction waits for the last tower, so a tower whose forward
and backward passes take consistently longer than the others' (a GPU that
throttles, a device that shares its host or its link with other work)
costs every step its lag. `TowerTimes` keeps each tower's time over the
last STRAGGLER_STEPS steps and names a tower whose median lags by the
watchdog's rule for workers (``tfreduce.stragglers.lagging``: more than STRAGGLER_MS
ms and more than half the other towers' median). The report goes to
stderr, at most once every REPORT_EVERY steps; ``fit(logdir=)`` writes
each tower's median as the TensorBoard scalar
``towers/ms_to_gradients/tower_<k>``.
"""

import sys

import numpy as np

from tfreduce.stragglers import REPORT_EVERY, STRAGGLER_STEPS, lagging

__all__ = ["TowerTimes"]

# Steps between two looks at the window (each costs tens of µs): a tower
# slow from step s on fills most of the window by s + 11 and is named by
# s + 20.
_CHECK_EVERY = 10


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
        # The last STRAGGLER_STEPS steps' seconds, a ring of rows [steps, K].
        self._window = np.zeros([STRAGGLER_STEPS, len(self.devices)])
        self._steps = 0
        self._next_report = 0

    def add(self, step, seconds):
        """Records step `step`'s float [K] seconds from the split to each tower's gradients.

        Looks for a tower that lags every _CHECK_EVERY steps once the window
        is full, and reports it (stderr), at most once every REPORT_EVERY
        steps.

        Raises:
          ValueError: `seconds` does not hold one value per tower.
        """
        seconds = np.asarray(seconds, dtype=np.float64).reshape(-1)
        if len(seconds) != len(self.devices):
            raise ValueError(f"TowerTimes.add: {len(seconds)} times for "
                             f"{len(self.devices)} towers")
        self._window[self._steps % STRAGGLER_STEPS] = seconds
        self._steps += 1
        if (len(self.devices) < 2 or self._steps < STRAGGLER_STEPS
                or self._steps % _CHECK_EVERY or step < self._next_report):
            return
        medians = self.medians()
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
        if self._steps < STRAGGLER_STEPS:
            return None
        medians = 1000.0 * np.median(self._window, axis=0)
        return {k: float(ms) for k, ms in enumerate(medians)}
