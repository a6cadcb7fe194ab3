"""The processes of a Horovod-style run: one process per device, ranked by TF_CONFIG.

Horovod's model, on TensorFlow's own gRPC collectives: every process runs the
same script on one device, and ``init()`` makes it rank r of the size
processes. The cluster comes from the standard ``TF_CONFIG`` environment
variable (set by ``tfreduce-launch --workers N``, by hand, or by a cluster
manager), one task per process; several tasks may share a machine. Without
TF_CONFIG, a SLURM job step's variables give it (``srun``: see
``tf_config.slurm_tf_config``), or ``mpirun``'s processes agree on it over
MPI (mpi4py: ``tf_config.mpirun_tf_config``; the collectives still go
through TF's runtime); without any the process is rank 0 of 1, as
``horovodrun -np 1`` would make it.

Ranks: ``rank()`` is the task's place in TF_CONFIG's rank order (chief
first, then the workers). ``local_rank()`` counts the tasks on the same host
(the host part of their addresses), in rank order; ``cross_rank()`` is the
index of this host among the hosts, in the order they first appear, and
``cross_size()`` their number, as Horovod reports them for homogeneous
clusters.

Sources: Horovod's process model (horovod.tensorflow.init, rank, local_rank);
TF_CONFIG as MultiWorkerMirroredStrategy reads it.
"""

import tensorflow as tf

from tfreduce.basis.tf_config import parse_address
from tfreduce.blocks.collective import check_timeout
from tfreduce.workers.cluster import DEFAULT_TIMEOUT
from tfreduce.workers.environment import cluster_from_environment
from tfreduce.workers.localcluster import LocalCluster
from tfreduce.workers.watchdog import stall_seconds_from

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "cluster", "device", "eager_functions", "is_homogeneous",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
           "nccl_built", "ccl_built", "ddl_built", "cuda_built", "rocm_built"]


class _Run:
    """What init() found: the cluster, this process's host layout and device."""

    def __init__(self):
        self.cluster = None     # a started tfreduce.Cluster or a LocalCluster
        self.started = None     # the cluster once started (it outlives shutdown)
        self.hosts = [0]        # host index of every rank
        self.device = None      # this process's device, canonical
        self.functions = {}     # eager calls' traced functions (ops.py), until shutdown


_RUN = _Run()


def _hosts(found):
    """The host index of every rank: hosts numbered in order of first appearance."""
    if found.is_local:
        return [0]
    names = [parse_address(found.address(r), f"rank {r}")[0] for r in range(found.num_workers)]
    order = list(dict.fromkeys(names))
    return [order.index(name) for name in names]


def init(comm=None, process_sets=None, *, stall_seconds=None, timeout_seconds=None):
    """Makes this process a rank of the run: reads TF_CONFIG, starts TF's server.

    Call it first, before TensorFlow creates a tensor or a model. With GPUs,
    the process sees only the GPU of its local rank (GPU ``local_rank() % n``
    of the n it has), as Horovod scripts arrange with
    ``tf.config.set_visible_devices``. Calling it again does nothing (its
    settings are checked, not applied: the first call's stand).

    The cluster: TF_CONFIG; else a SLURM job step's variables
    (``tf_config.slurm_tf_config``; task i of a node listens on port 8888 + i,
    or TFREDUCE_SLURM_PORT_BASE + i); else, under ``mpirun -np N`` (N > 1),
    the N processes (ranked as MPI ranks them, free ports exchanged over
    mpi4py); else this process alone.

    Args:
      comm: Horovod's MPI communicator: must be None (under mpirun the
        processes meet over MPI by themselves; the collectives are TF's).
      process_sets: Horovod's process sets; not supported: must be None.
      stall_seconds: float seconds (tfreduce's own): a peer silent this long
        is named and the run ends (``tfreduce.workers.watchdog``); 0 turns the
        watchdog off; None: $TFREDUCE_STALL_SECONDS, else 20.
      timeout_seconds: float seconds > 0 (tfreduce's own): the longest a
        collective waits, idle, for its peers (``Cluster``'s timeout: the
        watchdog enforces it, and the ops carry no per-op timeout while it
        runs); None: ``Cluster``'s default, 300.

    Raises:
      TypeError: stall_seconds not a number.
      ValueError: comm or process_sets given; a bad stall_seconds or
        timeout_seconds; a malformed TF_CONFIG (see
        ``tfreduce.Cluster.from_tf_config``); this task's port cannot be
        opened; mpirun started several processes and mpi4py does not import.
    """
    if comm is not None:
        raise ValueError(f"init(comm={comm!r}): tfreduce takes no communicator; under mpirun "
                         "the processes find each other over MPI by themselves (COMM_WORLD): "
                         "call init()")
    if process_sets is not None:
        raise ValueError(f"init(process_sets={process_sets!r}): process sets are not "
                         "supported; every collective spans all processes")
    # Checked on one process too: a bad setting fails where it is written.
    if stall_seconds is not None and (isinstance(stall_seconds, bool)
                                      or not isinstance(stall_seconds, (int, float))):
        raise TypeError(f"init: stall_seconds must be a number of seconds (0: off) or None, "
                        f"got {type(stall_seconds).__name__} {stall_seconds!r}")
    try:
        stall = stall_seconds_from(stall_seconds)
        timeout = check_timeout(timeout_seconds, none_means=f"{DEFAULT_TIMEOUT:g} s")
    except ValueError as e:
        raise ValueError(f"init(stall_seconds={stall_seconds!r}, timeout_seconds="
                         f"{timeout_seconds!r}): {e}") from None
    if _RUN.cluster is not None:
        return
    if _RUN.started is None:
        found = (cluster_from_environment(timeout or DEFAULT_TIMEOUT, stall)
                 or LocalCluster())
        _RUN.hosts = _hosts(found)
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            tf.config.set_visible_devices(gpus[_local_rank(found) % len(gpus)], "GPU")
        _RUN.started = found.start()
        _RUN.device = "/device:GPU:0" if gpus else "/device:CPU:0"
    _RUN.cluster = _RUN.started


def _local_rank(found):
    hosts = _RUN.hosts
    return hosts[:found.rank].count(hosts[found.rank])


def shutdown():
    """Waits until every rank gets here (a barrier), then ends the run for this process.

    TensorFlow's server cannot be stopped: a later ``init()`` takes the run
    up again with the same ranks. Does nothing if init() was not called.

    Raises:
      tfreduce.WorkerLostError: a rank is lost or does not arrive in time.
    """
    if _RUN.cluster is None:
        return
    found, _RUN.cluster = _RUN.cluster, None
    found.finish()
    _RUN.functions.clear()  # the eager calls' functions, and the variables they hold


def eager_functions():
    """dict, the traced functions of this run's eager collective calls (cleared at shutdown)."""
    return _RUN.functions


def is_initialized():
    """bool: init() was called (and shutdown() not since)."""
    return _RUN.cluster is not None


def cluster():
    """The started tfreduce.Cluster of the run (a LocalCluster for one process).

    Raises:
      RuntimeError: init() was not called.
    """
    if _RUN.cluster is None:
        raise RuntimeError("tfreduce.tensorflow.init() has not been called: call it first, "
                           "before building the model")
    return _RUN.cluster


def device():
    """str, this process's device: "/device:GPU:0" (its local rank's GPU) or "/device:CPU:0".

    Raises:
      RuntimeError: init() was not called.
    """
    cluster()
    return _RUN.device


def rank():
    """int, this process's rank in 0..size()-1 (rank 0 writes checkpoints and logs)."""
    return cluster().rank


def size():
    """int, the number of processes."""
    return cluster().num_workers


def local_rank():
    """int, this process's rank among the processes on its machine."""
    return _local_rank(cluster())


def local_size():
    """int, the number of processes on this process's machine."""
    found = cluster()
    return _RUN.hosts.count(_RUN.hosts[found.rank])


def cross_rank():
    """int, the index of this process's machine among the machines of the run."""
    found = cluster()
    return _RUN.hosts[found.rank]


def cross_size():
    """int, the number of machines of the run."""
    cluster()
    return len(set(_RUN.hosts))


def is_homogeneous():
    """bool: every machine of the run has the same number of processes."""
    cluster()
    return len({_RUN.hosts.count(h) for h in _RUN.hosts}) == 1


# What Horovod's build flags report. tfreduce runs on TensorFlow's own
# gRPC collectives, and its Horovod calls on MPI when the cluster's
# transport is (``tfreduce.workers.mpi_transport``): no Gloo, oneCCL or DDL; NCCL
# only inside TensorFlow (its version is not Horovod's to report).

def mpi_built():
    """True when mpi4py imports: a cluster can carry the Horovod calls over MPI."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def mpi_enabled():
    """True when this run's Horovod calls go over MPI (init() under mpirun, with mpi4py)."""
    return getattr(_RUN.cluster, "mpi", None) is not None


def mpi_threads_supported():
    """True when MPI runs with MPI_THREAD_MULTIPLE on this run's transport."""
    if not mpi_enabled():
        return False
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built():
    """False: the collectives are TensorFlow's, not Gloo's."""
    return False


def gloo_enabled():
    """False: the collectives are TensorFlow's, not Gloo's."""
    return False


def nccl_built():
    """0: Horovod's NCCL version number; tfreduce links none of its own."""
    return 0


def ccl_built():
    """False: no oneCCL."""
    return False


def ddl_built():
    """False: no IBM DDL."""
    return False


def cuda_built():
    """bool: TensorFlow was built with CUDA."""
    return tf.test.is_built_with_cuda()


def rocm_built():
    """bool: TensorFlow was built with ROCm."""
    return tf.test.is_built_with_rocm()
