"""The profiled steps of a fit: a timeline of steps a..b (``fit(profile_steps=)``).

Keras' TensorBoard callback takes ``profile_batch=(a, b)``; ``fit`` takes
``profile_steps=(a, b)``, 1-based global step numbers (as the step
counter: a resumed fit goes on counting). Only those steps run under
TensorFlow's profiler: with None, the default, nothing is added to a step.
A window after the run's last step (or before its first) profiles
nothing: fit warns before its first step.
The profiler's own files stay in ``logdir`` (TensorBoard's profile tab
reads them; worker w > 0 of a cluster profiles under ``logdir/worker<w>``);
tfreduce reads them into a ``tfreduce.analysis.timeline.Timeline`` and writes it as
``logdir/timeline.json.gz`` (Chrome trace format, gzipped) and
``timeline.png``; worker w > 0 writes ``timeline-worker<w>.json.gz`` and
``.png``.
"""

import os
import warnings

from tfreduce.analysis.profiler import StepProfiler

__all__ = ["ProfiledSteps", "check_profile_steps"]


def check_profile_steps(profile_steps, logdir):
    """(first, last) step numbers to profile, or None.

    Args:
      profile_steps: None, an int a (step a alone) or a pair (a, b) of
        ints 1 <= a <= b.
      logdir: where the timeline goes; must be given with profile_steps.

    Raises:
      TypeError: profile_steps of another type.
      ValueError: steps below 1, a > b, or no logdir.
    """
    if profile_steps is None:
        return None
    steps = (profile_steps, profile_steps) if isinstance(profile_steps, int) else profile_steps
    if (not isinstance(steps, (tuple, list)) or len(steps) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)):
        raise TypeError(f"profile_steps must be an int step or a pair (first, last) of int "
                        f"steps, got {profile_steps!r}")
    first, last = steps
    if not 1 <= first <= last:
        raise ValueError(f"profile_steps must be 1 <= first <= last (1-based step numbers), "
                         f"got {profile_steps!r}")
    if logdir is None:
        raise ValueError(f"profile_steps={profile_steps!r} needs logdir: the profile and its "
                         f"timeline are written there")
    return first, last


class ProfiledSteps:
    """Runs a fit's steps, the steps first..last under the profiler.

    Args:
      steps: (first, last) from check_profile_steps, or None (no profiling).
      logdir: str directory of the profile and the timeline.
      devices: the towers' devices, in tower order.
      graphs: fn() -> list of the traced step graphs (they place the ops).
      models: the replicas, one keras.Model per tower (they name the layers).
      rank: int, this worker's rank.

    Attributes:
      timeline: the Timeline of the profiled steps, once written; or None.
    """

    def __init__(self, steps, logdir, devices, graphs, models, rank):
        self._steps = steps
        self._logdir = logdir
        self._devices = devices
        self._graphs = graphs
        self._models = models
        self._rank = rank
        self._profiler = None
        self.timeline = None

    def check_window(self, first_step, last_step):
        """Warns when no step of the run (first_step..last_step, 1-based) is in the window.

        Called by fit before its first step (``fit`` is the caller's caller),
        so an empty window is said at once, not found missing afterwards.
        """
        if self._steps is None or self._steps[0] <= last_step and self._steps[1] >= first_step:
            return
        steps = (f"trains steps {first_step}..{last_step}" if first_step <= last_step else
                 f"trains no step (the step counter is at {first_step - 1} of {last_step})")
        warnings.warn(f"fit(profile_steps={self._steps}): this run {steps}, none in the window: "
                      f"no timeline is written", stacklevel=4)

    def run(self, run_step, number, x, y):
        """run_step(x, y) for step ``number`` (1-based), profiled when in the window."""
        if self._steps is None or self.timeline is not None:
            return run_step(x, y)
        first, last = self._steps
        if self._profiler is None and first <= number <= last:
            # The profiler names its file after the host: workers on one
            # machine each write under their own directory.
            where = self._logdir if self._rank == 0 else os.path.join(
                self._logdir, f"worker{self._rank}")
            self._profiler = StepProfiler(where, self._devices, self._graphs, self._models,
                                          process=f"worker {self._rank}")
            self._profiler.__enter__()
        if self._profiler is None:
            return run_step(x, y)
        try:
            return self._profiler.step(f"step {number}", run_step, x, y)
        finally:
            if number >= last:
                self.close()

    def close(self, failed=False):
        """Stops the profiler (at the window's end or the fit's) and writes the timeline."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(RuntimeError if failed else None, None, None)
        if failed:
            return
        self.timeline = profiler.timeline
        name = "timeline" if self._rank == 0 else f"timeline-worker{self._rank}"
        for suffix in (".json.gz", ".png"):
            self.timeline.save(os.path.join(self._logdir, name + suffix))
