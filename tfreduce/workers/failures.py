"""Failure detection: which peers are lost after a collective failed, and saying so.

When a peer dies, TF fails the cross-worker collective with UnavailableError
(within about a second: its connections are refused) or, for a peer that
hangs or whose host vanished, DeadlineExceededError after the cluster's
timeout (``COLLECTIVE_FAILURES``). ``unreachable_workers`` probes the peers
and ``lost_worker_message`` names the ones that do not answer;
``Cluster.detect_lost_workers`` raises it as a ``WorkerLostError``.
"""

import contextlib
import re
import socket

import tensorflow as tf
# Private but long-standing TF API, the one MultiWorkerMirroredStrategy uses
# for its own peer health checks.
from tensorflow.python.eager import context

from tfreduce.basis.tf_config import parse_address

__all__ = ["COLLECTIVE_FAILURES", "PEER_LOST", "WorkerLostError", "lost_workers_named", "unheard_workers",
           "unreachable_workers", "lost_worker_message"]

# Errors a collective reports when a peer is gone, hangs or restarted.
COLLECTIVE_FAILURES = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
    tf.errors.FailedPreconditionError,
)


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


#: What a worker sees when a peer is gone: the watchdog's error or the
#: transport's. An elastic job re-forms on these (``tfreduce.workers.generations``).
PEER_LOST = (WorkerLostError, tf.errors.UnavailableError, tf.errors.AbortedError)


@contextlib.contextmanager
def lost_workers_named(cluster, probe_timeout):
    """``Cluster.detect_lost_workers``: a failed collective as a WorkerLostError naming the lost."""
    try:
        yield
    except COLLECTIVE_FAILURES as e:
        lost = cluster.unreachable_workers(probe_timeout)
        if not lost and not isinstance(e, tf.errors.DeadlineExceededError):
            raise
        raise WorkerLostError(lost_worker_message(cluster, e, lost),
                              [cluster.describe(r) for r in lost], e) from e


def unheard_workers(cluster, missing):
    """The WorkerLostError of peers whose first heartbeat did not come (``Cluster.start``).

    Args:
      cluster: tfreduce.Cluster of this worker.
      missing: list of int ranks never heard within ``cluster.timeout``.
    """
    names = [cluster.describe(r) for r in missing]
    return WorkerLostError(
        f"{cluster.describe(cluster.rank)}: no heartbeat from {', '.join(names)} within "
        f"{cluster.timeout:g} s of this worker's start: not started, or UDP between the hosts "
        f"is blocked (the watchdog's heartbeats go to the port number of each worker's "
        f"server; stall_seconds=0 runs without it)", names, None)


def _tf_reason(error):
    """The line of a TF error message that says what happened to the collective."""
    # TF appends where the op was defined, an indented traceback whose file
    # and function names may say "collective" too: only unindented lines count.
    lines = [line.strip() for line in str(error.message or "").splitlines()
             if not line[:1].isspace()]
    lines = [line for line in lines if line and not line.startswith(("[[", "Detected at"))
             and line != "Graph execution error:"]
    for line in lines:
        if "Collective" in line or "collective" in line:
            return line
    return lines[0] if lines else ""


def _tf_node(error):
    """The name of the op a TF error came from ("[[{{node NAME}}]]"), or None."""
    found = re.search(r"\{\{node ([^}]+)\}\}", str(error.message or ""))
    return found.group(1) if found else None


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


def lost_worker_message(cluster, error, lost):
    """What a WorkerLostError says: who is lost (or that none is), what to do, TF's reason.

    Args:
      cluster: tfreduce.Cluster of this worker.
      error: the ``tf.errors.OpError`` a collective raised.
      lost: list of int ranks that do not answer (``unreachable_workers``).

    Returns:
      str.
    """
    names = [cluster.describe(r) for r in lost]
    reason = f"(TF: {type(error).__name__}: {_tf_reason(error)})"
    node = _tf_node(error)
    if names:
        what = f"the collective this worker waits in ({node})" if node else "the all-reduce"
        return (f"{cluster.describe(cluster.rank)}: lost {', '.join(names)}: "
                f"{'it does' if len(names) == 1 else 'they do'} not answer, and {what} "
                f"cannot go on without {'it' if len(names) == 1 else 'them'}. "
                f"Stop every worker, restart them all and resume from the last "
                f"checkpoint. {reason}")
    what = f"a collective ({node})" if node else "a collective"
    return (f"{cluster.describe(cluster.rank)}: {what} waited {cluster.timeout:g}s for "
            f"its peers and every worker still answers: one of them is stuck, much "
            f"slower, or running a different program (other models, shapes or number of "
            f"steps). {reason}")
