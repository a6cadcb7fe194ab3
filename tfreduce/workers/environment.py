"""The cluster this process's environment describes: TF_CONFIG, a SLURM job step, or mpirun.

``hvd.init()`` and ``ReplicatedTrainer(cluster="auto")`` ask the same
question, answered here once: TF_CONFIG when it is set (the launcher's, a
cluster manager's, or by hand); else a SLURM job step's variables
(``tf_config.slurm_tf_config``); else, when ``mpirun`` started several
processes, the TF_CONFIG they agree on over MPI (mpi4py,
``tf_config.mpirun_tf_config``: the collectives still go through TF's
runtime); else none, one process.
"""

import os

from tfreduce.basis.tf_config import (SLURM_PORT_BASE, mpirun_size, mpirun_tf_config,
                                      slurm_tf_config)
from tfreduce.workers.cluster import DEFAULT_TIMEOUT, Cluster

__all__ = ["cluster_from_environment"]


def cluster_from_environment(timeout=DEFAULT_TIMEOUT, stall_seconds=None, transport="auto"):
    """The (unstarted) Cluster this process's environment describes, or None for one process.

    In this order: TF_CONFIG (tfreduce-launch, tf.distribute's convention);
    a SLURM job step of several tasks (SLURM_* variables, as
    ``SlurmClusterResolver`` reads them); mpirun's processes (Open MPI's or
    MPICH's variables), which exchange hosts and free ports over mpi4py.
    Public as ``tfreduce.cluster_from_environment()``; ``hvd.init()`` and
    ``ReplicatedTrainer(cluster="auto")`` call it. Start the cluster
    (``Cluster.start``) before any tensor exists.

    Args:
      timeout: float seconds, as ``Cluster``'s.
      stall_seconds: float seconds or None, as ``Cluster``'s.
      transport: as ``Cluster``'s; "auto": the eager calls go over MPI when
        mpirun started the processes and mpi4py imports.

    Returns:
      tfreduce.Cluster of W workers (not started), or None when this
      process runs alone.

    Raises:
      ValueError: a malformed TF_CONFIG or SLURM variable (as
        ``Cluster.from_tf_config``, ``tf_config.slurm_tf_config``); mpirun
        started several processes and mpi4py does not import (each would
        otherwise train alone).
    """
    if os.environ.get("TF_CONFIG"):
        return Cluster.from_tf_config(timeout=timeout, stall_seconds=stall_seconds,
                                      transport=transport)
    given = slurm_tf_config(
        port_base=int(os.environ.get("TFREDUCE_SLURM_PORT_BASE", SLURM_PORT_BASE)))
    if given is None and (mpirun_size() or 1) > 1:
        try:
            from mpi4py import MPI
        except ImportError as error:
            raise ValueError(
                f"mpirun started {mpirun_size()} processes, but mpi4py does not import "
                f"({error}): without it they cannot find each other, and each would train "
                "alone. pip install mpi4py, or start them with tfreduce-launch --workers N"
            ) from None
        given = mpirun_tf_config(MPI.COMM_WORLD)
    if given is None:
        return None
    return Cluster.from_tf_config(given, timeout=timeout, stall_seconds=stall_seconds,
                                  transport=transport)
