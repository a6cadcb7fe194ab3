"""Failure detection: turning a collective that failed into a named lost worker.

When a peer dies, TF fails the cross-worker collective with UnavailableError
(within about a second: its connections are refused) or, for a peer that
hangs or whose host vanished, DeadlineExceededError after the cluster's
timeout. ``detect_lost_workers`` probes the peers after such a failure and
raises a ``WorkerLostError`` that names the ones that do not answer;
``tfreduce.Cluster`` exposes both as methods.
"""

import contextlib
import socket

import tensorflow as tf
# Private but long-standing TF API, the one MultiWorkerMirroredStrategy uses
# for its own peer health checks.
from tensorflow.python.eager import context

from tfreduce.tf_config import parse_address

__all__ = ["WorkerLostError", "unreachable_workers", "detect_lost_workers"]

# Errors a collective reports when a peer is gone, hangs or restarted.
_COLLECTIVE_FAILURES = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
    tf.errors.FailedPreconditionError,
)


def _tf_reason(error):
    """The line of a TF error message that says what happened to the collective."""
    lines = [line.strip() for line in str(error.message or "").splitlines()]
    lines = [line for line in lines if line and not line.startswith(("[[", "Detected at"))
             and line != "Graph execution error:"]
    for line in lines:
        if "Collective" in line or "collective" in line:
            return line
    return lines[0] if lines else ""


class WorkerLostError(RuntimeError):
    """A cross-worker collective failed because a worker is lost or stuck.

    Attributes:
      lost: list of str, the workers that did not answer a probe after the
        failure, e.g. ``["worker 1 (10.0.0.2:2222)"]``; empty when every
        worker answered (the collective then timed out on a worker that is
        alive but stuck or far slower than the others).
      error: the ``tf.errors.OpError`` the collective raised.
    """

    def __init__(self, message, lost, error):
        super().__init__(message)
        self.lost = lost
        self.error = error



def unreachable_workers(cluster, probe_timeout, eager):
    """The other tasks that do not answer now.

    After ``Cluster.start()`` (``eager``) each peer is asked through TF's
    collective health check, which also notices a peer that restarted;
    otherwise a TCP connection to its port is attempted.

    Args:
      cluster: tfreduce.Cluster of this worker.
      probe_timeout: float seconds to wait for each peer.
      eager: bool, the cluster's server runs in the TF2 eager context.

    Returns:
      list of int ranks.
    """
    lost = []
    for rank in range(cluster.num_workers):
        if rank != cluster.rank and not _answers(cluster, rank, probe_timeout, eager):
            lost.append(rank)
    return lost


def _answers(cluster, rank, probe_timeout, eager):
    if eager:
        try:
            context.context().check_collective_ops_peer_health(
                cluster.task_name(rank), timeout_in_ms=int(probe_timeout * 1000))
            return True
        except tf.errors.OpError:
            return False
    host, port = parse_address(cluster.address(rank), "address")
    try:
        socket.create_connection((host, port), timeout=probe_timeout).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def detect_lost_workers(cluster, probe_timeout, eager):
    """A context that turns a failed cross-worker collective into a WorkerLostError.

    On UnavailableError, DeadlineExceededError and the other errors of a
    collective whose peer is gone, the peers are probed and the error names
    the ones that do not answer; a deadline with every peer answering names
    none (a stuck or slower peer). Other errors pass through unchanged.

    Args:
      cluster: tfreduce.Cluster of this worker.
      probe_timeout: float seconds to wait for each peer's answer.
      eager: bool, as in ``unreachable_workers``.

    Raises:
      WorkerLostError: from the collective's ``tf.errors.OpError``.
    """
    try:
        yield
    except _COLLECTIVE_FAILURES as e:
        lost = unreachable_workers(cluster, probe_timeout, eager)
        if not lost and not isinstance(e, tf.errors.DeadlineExceededError):
            raise
        names = [cluster.describe(r) for r in lost]
        first_line = _tf_reason(e)
        if names:
            message = (
                f"{cluster.describe(cluster.rank)}: lost {', '.join(names)}: "
                f"{'it does' if len(names) == 1 else 'they do'} not answer, and "
                f"the all-reduce cannot go on without "
                f"{'it' if len(names) == 1 else 'them'}. Stop every worker, "
                f"restart them all and resume from the last checkpoint. "
                f"(TF: {type(e).__name__}: {first_line})")
        else:
            message = (
                f"{cluster.describe(cluster.rank)}: a collective waited {cluster.timeout:g}s "
                f"for its peers and every worker still answers: one of them is "
                f"stuck, much slower, or running a different program (other "
                f"models, shapes or number of steps). "
                f"(TF: {type(e).__name__}: {first_line})")
        raise WorkerLostError(message, names, e) from e
