"""Synchronous data-parallel training of a Keras 3 model on K devices.

`ReplicatedTrainer` keeps one replica of the model (a "tower") and one
optimizer on each of K devices. Every step splits the global batch across the
towers, computes per-tower gradients, reduces them with one call of its
`tfreduce.Reduction` and applies the same reduced gradients on every tower,
so the replicas stay identical. This is the in-graph replicated scheme
of tensorflow/benchmarks' `variable_update=replicated` and of tensorpack's
SyncMultiGPUTrainerReplicated, written for TF2 `tf.function` and Keras 3.

Several workers (processes, usually one per machine, each with its own
K devices; see `tfreduce.workers.cluster`): under TF_CONFIG, or with
`cluster=`, every worker runs the same program on the same global
batches. Each step then takes this worker's part of the global batch
(`Cluster.batch_slice`), so the T = W * K towers of all W workers get
the shards one process with T devices would give them, and every
all-reduce is the reduction followed by the cross-worker hop (one process
is a `tfreduce.workers.localcluster.LocalCluster`: the same code, no hop). The
broadcasts copy rank 0's tower 0, step counter included, to every tower
of every worker. Only rank 0 (`is_chief`) writes checkpoints and summaries and
shows progress; `restore` reads the checkpoint on rank 0 only. Every
worker evaluates and predicts on all the data it is given, so all get
the same results. A lost worker fails the step with
`tfreduce.WorkerLostError`.

Modules: replicated_trainer (the public class), towers (the replicas),
step (one step's graphs), towertimes (the tower the others wait for),
losses, batching, loop (fit, evaluate, predict), checkpoints, signals
(SIGTERM) and elastic (fit under the elastic launcher); replicated_trainer
imports the others, and none imports it.
"""

from tfreduce.trainer.replicated_trainer import ReplicatedTrainer

__all__ = ["ReplicatedTrainer"]
