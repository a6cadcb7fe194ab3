"""Stopping a run cleanly on SIGTERM, the signal Slurm, Kubernetes and the launcher send.

While `fit` runs, SIGTERM only sets a flag; the step in progress finishes,
then `fit` writes its checkpoint and raises `Terminated`. In a cluster every
step sums the workers' flags in the all-reduce of its metrics, so all
workers stop after the same step, none waiting for a collective the others
never start.
"""

import contextlib
import signal
import threading

__all__ = ["Terminated", "StopRequest"]


class Terminated(KeyboardInterrupt):
    """`fit` stopped on a signal after a whole step, its checkpoint written.

    A KeyboardInterrupt, so code that stops on Ctrl-C stops on it too.

    Attributes:
      signum: int, the signal received (signal.SIGTERM), or None when another
        worker of the cluster received it.
      step: int, the steps taken when the run stopped.
    """

    def __init__(self, signum, step):
        who = signal.Signals(signum).name if signum is not None else "another worker's signal"
        super().__init__(f"stopped by {who} at step {step}")
        self.signum = signum
        self.step = step


class StopRequest:
    """The SIGTERM flag of one trainer: set by the handler, read between steps.

    Attributes:
      signum: int, the signal received since `handling` began, or None.
    """

    def __init__(self):
        self.signum = None

    @property
    def requested(self):
        """bool: a signal arrived."""
        return self.signum is not None

    @contextlib.contextmanager
    def handling(self, signums=(signal.SIGTERM,)):
        """Within the context, the signals set the flag instead of killing the process.

        Python runs signal handlers in the main thread only: elsewhere the
        signals keep their handlers.
        """
        self.signum = None
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def handler(signum, frame):
            self.signum = signum

        previous = {s: signal.signal(s, handler) for s in signums}
        try:
            yield self
        finally:
            for s, old in previous.items():
                if old is not None:  # None: a handler installed outside Python
                    signal.signal(s, old)
