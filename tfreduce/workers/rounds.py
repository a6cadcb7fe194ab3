"""The cross-worker rounds of traced steps, counted where the watchdog can read them.

A custom loop (Horovod's ``DistributedGradientTape`` in a ``tf.function``,
a Keras train step with ``DistributedOptimizer`` and no callback) tells the
watchdog nothing: its steps run inside TensorFlow. Yet every step makes the
same cross-worker collectives, and those are the natural step counter (as
Horovod's stall inspector counts the tensors each rank has submitted). A
round is one call of the cross-worker stage in a traced graph (one
all-reduce of a step's gradients, one broadcast, one all-gather);
``CollectiveRounds`` counts them in one float64 variable of 3 elements on
the worker's CPU:

- ``[0]`` rounds entered: the round's inputs (this worker's local sums)
  are all ready, so this worker waits in it from then on;
- ``[1]`` rounds left: its outputs are all ready;
- ``[2]`` the seconds between the two, summed over the rounds left: the
  time this worker waited for its peers (and the transfer's tail). The
  worker the others wait for waits least (``tfreduce.workers.stragglers``).
  Not kept under TF's op determinism, which refuses the ``Timestamp`` op.

Six small ops a round: a timestamp and an add when it is entered, a
timestamp, a difference, a stack and an add when it is left. They are
built after the round's collectives and nothing depends on them, so no
collective waits for them and the overlap of the backward pass with the
transfer stays. A thread reads the variable twenty times a second (an
eager read, tens of microseconds) and keeps, for each round left since its
last read, their mean wait: the last STRAGGLER_STEPS of those are the
waits the watchdog compares (each round's own in a loop whose steps take
longer than the reads' interval). The watchdog reads that thread's copy
(``latest``), so no TensorFlow call, however long it blocks, can hold back
the heartbeats.
"""

import collections
import threading

import tensorflow as tf
# Private but long-standing: TF has no public way to ask whether op
# determinism is on, whose Timestamp op then fails.
from tensorflow.python.framework import config as tf_framework_config

from tfreduce.workers.stragglers import STRAGGLER_STEPS

__all__ = ["CollectiveRounds"]

# Seconds between two reads of the counters for the watchdog.
_READ_EVERY = 0.05


class CollectiveRounds:
    """This worker's count of cross-worker rounds and their waits (see the module docstring).

    Args:
      device: str, this worker's CPU (full name), where the counters live.

    Attributes:
      device: str.
    """

    def __init__(self, device):
        self.device = device
        # An eager variable whatever the caller's context: hvd.init() may run
        # inside a tf.compat.v1 graph, where a variable would die with that
        # graph. A new thread starts in TF2's eager mode.
        made = []
        maker = threading.Thread(target=lambda: made.append(self._make_counts()),
                                 name="tfreduce-rounds-variable")
        maker.start()
        maker.join()
        self._counts = made[0]
        self._timed = True  # False once a round was built under op determinism
        self._latest = None
        self._waits = collections.deque(maxlen=STRAGGLER_STEPS)
        self._reader = None
        self._lock = threading.Lock()

    def _make_counts(self):
        with tf.device(self.device):
            return tf.Variable(tf.zeros([3], tf.float64), trainable=False,
                               name="tfreduce_rounds")

    def mark(self, inputs, outputs):
        """Counts one round in the graph being traced: entered once `inputs`, left once `outputs`.

        Nothing outside a ``tf.function``, nor in one traced inside a
        ``tf.compat.v1`` graph: no eager reader could read its counters.

        Args:
          inputs: list of tf.Tensor, what the round's collectives take.
          outputs: list of tf.Tensor, what they give.
        """
        if (not tf.inside_function() or not inputs or not outputs
                or not tf.compat.v1.executing_eagerly_outside_functions()):
            return
        timed = not tf_framework_config.is_op_determinism_enabled()
        self._timed = self._timed and timed
        counts = self._counts
        with tf.name_scope("rounds"), tf.device(self.device):
            with tf.control_dependencies(inputs):
                start = tf.raw_ops.Timestamp() if timed else None
                entered = counts.scatter_add(tf.IndexedSlices(
                    tf.constant([1.0], tf.float64), tf.constant([0])), name="entered")
            with tf.control_dependencies(list(outputs) + [entered.op]):
                if timed:
                    values = tf.stack([tf.constant(1.0, tf.float64),
                                       tf.raw_ops.Timestamp() - start])
                    indices = tf.constant([1, 2])
                else:
                    values, indices = tf.constant([1.0], tf.float64), tf.constant([1])
                counts.scatter_add(tf.IndexedSlices(values, indices), name="left")

    def read(self):
        """(entered, left, waited): two ints and the seconds waited in all rounds left.

        An eager read of the variable (tens of microseconds)."""
        entered, left, waited = self._counts.numpy().tolist()
        return int(entered), int(left), waited

    def latest(self):
        """(entered, left, waits) as the reader thread last saw them, or None before its first read.

        `waits` holds the seconds waited in each of the last STRAGGLER_STEPS
        rounds (the mean of those between two reads; empty while a round
        built under op determinism counts). Starts the reader on the first call;
        never waits for TensorFlow."""
        with self._lock:
            if self._reader is None:
                self._reader = threading.Thread(target=self._read_forever, daemon=True,
                                                name="tfreduce-rounds")
                self._reader.start()
        return self._latest

    def _read_forever(self):
        stop, last = threading.Event(), None
        while not stop.wait(_READ_EVERY):
            try:
                entered, left, waited = self.read()
            except Exception:  # noqa: BLE001 - the interpreter is ending: nothing to tell
                return
            if last is not None and left > last[0] and self._timed:
                # One mean wait per round since the last read: the window is
                # the last rounds, however many a read interval holds.
                rounds = left - last[0]
                self._waits.extend([(waited - last[1]) / rounds] * min(rounds, STRAGGLER_STEPS))
            last = (left, waited)
            self._latest = (entered, left, list(self._waits) if self._timed else [])
