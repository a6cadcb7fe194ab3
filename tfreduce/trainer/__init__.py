"""Synchronous data-parallel training of a Keras 3 model on K devices.

`ReplicatedTrainer` keeps one replica of the model (a "tower") and one
optimizer on each of K devices. Every step splits the global batch across the
towers, computes per-tower gradients, reduces them with one call to
`tfreduce.allreduce_grads` and applies the same reduced gradients on every
tower, so the replicas stay identical. This is the in-graph replicated scheme
of tensorflow/benchmarks' `variable_update=replicated` and of tensorpack's
SyncMultiGPUTrainerReplicated, written for TF2 `tf.function` and Keras 3.

Modules: replicated_trainer (the public class), towers (the replicas),
step (one step's graphs), losses, batching, loop (fit, evaluate, predict)
and checkpoints; replicated_trainer imports the others, and none imports it.
"""

from tfreduce.trainer.replicated_trainer import ReplicatedTrainer

__all__ = ["ReplicatedTrainer"]
