"""Which tower of this process the others wait for: each tower's time to its gradients.

Every training step stamps, on the host, the time at which its batch was
split and the time at which each tower's loss and gradients were computed
(``tf.timestamp`` after a copy of one scalar per tower, `stamp_towers`;
nothing else is copied and nothing waits for the stamps). The reduction
waits for the last tower, so a tower whose forward and backward passes
take consistently longer than the others' (a GPU that throttles, a device
that shares its host or its link with other work) costs every step its
lag. `TowerTimes` keeps each tower's time over the last STRAGGLER_STEPS
steps and names a tower whose median lags by the rule the watchdog
applies to workers (``tfreduce.workers.stragglers.lagging``: more than
STRAGGLER_MS ms and more than half the other towers' median). The report
goes to stderr, at most once every REPORT_EVERY steps; ``fit(logdir=)``
writes each of rank 0's towers' medians as the TensorBoard scalar
``towers/ms_to_gradients/tower_<k>``.
"""

import sys

import numpy as np
import tensorflow as tf

from tfreduce.workers.stragglers import REPORT_EVERY, STRAGGLER_STEPS, lagging

__all__ = ["TowerTimes", "split_stamp", "stamp_towers"]

# Steps between two looks at the window (each costs tens of µs): a tower
# slow from step s on holds the window's median from about s + 10, and is
# named by s + 20.
_CHECK_EVERY = 10


class TowerTimes:
    """The last STRAGGLER_STEPS steps' time to gradients of each of K towers, and its report.

    Args:
      devices: list of K str, the towers' devices (they name a tower).
      where: str, the process the towers belong to, as reports name it
        ("this process", or "worker 1 (host:port)": Cluster.describe).

    Attributes:
      reported: list of str, the report lines so far.
    """

    def __init__(self, devices, where="this process"):
        self.devices = list(devices)
        self.where = where
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
            line = (f"tower {k} ({self.devices[k]}) of {self.where} lags: the other towers wait "
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


def _timestamp():
    """tf.timestamp(), left out of tf.function's automatic control dependencies.

    They chain every stateful op that uses no resource in program order, so
    each tower's stamp would wait for the stamps (and py_functions) of the
    towers before it; the graph's ACD manager runs this one independently."""
    stamp = tf.timestamp()
    manager = getattr(tf.compat.v1.get_default_graph(), "experimental_acd_manager", None)
    if manager is not None:
        manager.run_independently(stamp.op)
    return stamp


def split_stamp(x_shards, host):
    """float64 scalar: the time at which the global batch is split, stamped on `host`."""
    with tf.device(host), tf.control_dependencies(tf.nest.flatten(x_shards)):
        return _timestamp()


def stamp_towers(start, devices, all_grads, loss_sums, host):
    """float64 [K]: seconds from `start` until each tower's loss and gradients are computed.

    On each tower's device, its loss passes through an identity after all
    its gradients; the stamp on `host` follows the copy of that scalar. On
    a GPU the copy to the host waits for the device's compute stream, so
    the stamp follows the kernels' completion, not their launch (which is
    all a control edge would wait for); it costs one scalar copy per tower.
    """
    ready = []
    for device, grads, loss in zip(devices, all_grads, loss_sums):
        with tf.device(device), tf.control_dependencies([g.op for g in grads if g is not None]):
            done = tf.identity(loss)
        with tf.device(host), tf.control_dependencies([tf.identity(done)]):
            ready.append(_timestamp())
    with tf.device(host):
        return tf.stack(ready) - start
