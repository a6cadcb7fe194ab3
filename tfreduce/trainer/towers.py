"""The K tower replicas of one worker: made, built, checked and kept equal.

Tower k is a replica of the model and its own optimizer, all their variables
on devices[k]. This module resolves the cluster the towers belong to (before
any variable exists), creates the replicas, builds their variables, checks
that every tower built the same thing, and makes the functions that
broadcast tower 0 to every tower and measure how far the towers drifted.
"""

import dataclasses

import tensorflow as tf

from tfreduce.basis import kerases
from tfreduce.algorithms.replicated import max_replica_difference
from tfreduce.basis.contract import tf_variables
from tfreduce.doors.multiworker import broadcast_variables_multiworker
from tfreduce.trainer.sharding import sharding_for
from tfreduce.trainer.update import scales_loss
from tfreduce.trainer.zero import check_optimizer
from tfreduce.workers.cluster import Cluster
from tfreduce.workers.environment import cluster_from_environment
from tfreduce.workers.localcluster import LocalCluster


@dataclasses.dataclass(frozen=True)
class Towers:
    """This worker's K built replicas; every list has one entry per tower k.

    Attributes:
      models: list of K keras.Model.
      optimizers: list of K Keras optimizers, optimizers[k] updates models[k].
      devices: list of K canonical device names, devices[k] holds tower k.
      trainable: K x N list of the trainable variables, the gradients' order.
      moving: K x M list of the moving mean and variance of every trainable
        BatchNormalization layer (M may be 0).
      forward: K x F list of what a training forward pass changes: the
        moving statistics and the seed state of random layers (Dropout).
      variables: K x V list of every model and optimizer variable, the ones a
        broadcast copies and a replica check compares (with ZeRO, the
        model's only: each optimizer holds its own shard).
      sharding: where the optimizer state lives (trainer.sharding):
        ReplicatedState at zero_stage 0, else ZeroState.
    """

    models: list
    optimizers: list
    devices: list
    trainable: list
    moving: list
    forward: list
    variables: list
    sharding: object = None


def resolve_cluster(given):
    """The started Cluster of a multi-worker run, or a LocalCluster for one process.

    The one place the trainer's ``cluster=`` argument is read: from here on
    the trainer calls the same methods on either.

    Args:
      given: "auto" (the cluster the environment describes: TF_CONFIG, a
        SLURM job step or mpirun's processes, ``workers.environment``; else
        one process), None (one process), or a tfreduce.Cluster.

    Raises:
      TypeError: given is none of these.
      ValueError: as ``workers.environment.cluster_from_environment``.
    """
    if isinstance(given, str) and given == "auto":
        given = cluster_from_environment()
    if given is None:
        return LocalCluster()
    if not isinstance(given, Cluster):
        raise TypeError(
            f'cluster must be "auto", None or a tfreduce.Cluster, got {type(given).__name__}'
        )
    # Before any tensor exists: from here on this worker's devices carry its
    # job and task. start() does nothing on a cluster that already started.
    return given.start()


def check_factories(model_fn, optimizer_fn):
    """Raises TypeError unless model_fn and optimizer_fn are callable."""
    if not callable(model_fn):
        raise TypeError(
            f"model_fn must be a function that returns a new keras.Model, got {model_fn!r}"
        )
    if not callable(optimizer_fn):
        raise TypeError(
            "optimizer_fn must be a function that returns a new optimizer (one per "
            f"tower), got {type(optimizer_fn).__name__}; pass e.g. "
            "lambda: keras.optimizers.SGD(0.1)"
        )


def create_replicas(model_fn, optimizer_fn, devices, zero_stage=0):
    """Calls model_fn and optimizer_fn once per tower under that tower's device.

    A model under Keras' mixed_float16 policy gets its optimizer wrapped in
    a keras.optimizers.LossScaleOptimizer, as `Model.compile` does.

    Returns:
      (list of K keras.Model, list of K Keras optimizers).

    Raises:
      TypeError: model_fn or optimizer_fn returned the wrong type.
      ValueError: with zero_stage > 0, an optimizer that cannot update a
        shard (trainer.zero.check_optimizer).
    """
    models, optimizers = [], []
    for k, device in enumerate(devices):
        with tf.device(device):
            model = model_fn()
            optimizer = optimizer_fn()
        if not kerases.is_model(model):
            raise TypeError(
                f"model_fn returned {type(model).__name__} for tower {k}; "
                "it must return a keras.Model (or a tf_keras.Model)"
            )
        if not kerases.is_optimizer(optimizer):
            legacy = "" if not kerases.is_keras2(optimizer) else (
                " (a tf_keras.optimizers.legacy one builds its slots inside its first step: "
                "use tf_keras.optimizers.SGD, Adam, ...)")
            raise TypeError(
                f"optimizer_fn returned {type(optimizer).__name__} for tower {k}; "
                f"it must return a keras.optimizers.Optimizer (or a tf_keras one){legacy}"
            )
        if kerases.is_keras2(model) != kerases.is_keras2(optimizer):
            raise TypeError(
                f"tower {k}: model_fn returned a {'tf_keras' if kerases.is_keras2(model) else 'Keras 3'} "
                f"model and optimizer_fn a {'tf_keras' if kerases.is_keras2(optimizer) else 'Keras 3'} "
                f"optimizer; give both of one Keras")
        if model.dtype_policy.name == "mixed_float16" and kerases.is_keras2(model):
            raise ValueError(
                f"tower {k}: a tf_keras model under the mixed_float16 policy: the trainer "
                f"scales losses with Keras 3's LossScaleOptimizer only; train it in float32, "
                f"or build it with Keras 3")
        if model.dtype_policy.name == "mixed_float16" and not scales_loss(optimizer):
            # As Keras' compile does: float16 gradients underflow without
            # loss scaling. Its scale lives on the tower too (a compiled
            # tower reads only its own device's variables).
            with tf.device(device):
                optimizer = kerases.loss_scaled(optimizer)
        check_optimizer(optimizer, k, zero_stage)
        models.append(model)
        optimizers.append(optimizer)
    return models, optimizers


def moving_statistics(model):
    """The moving mean and variance of every BatchNormalization layer that trains.

    Found by walking the layer tree, not by taking every non-trainable
    variable: frozen weights are non-trainable too, and averaging them every
    step would cost an all-reduce of the frozen part of the model for
    nothing. A frozen BatchNormalization runs in inference mode and keeps its
    statistics, so it is left out as well. `_flatten_layers` is Keras' own
    walk, which also reaches layers held as attributes of custom layers.
    """
    found = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if kerases.is_batch_normalization(layer) and layer.trainable:
            found.extend([layer.moving_mean, layer.moving_variance])
    return found


def forward_state(model):
    """The variables a training forward pass changes: moving statistics, seed states.

    A skipped step puts them back (``update.TowerState``): Keras assigns
    them inside the forward pass, before anything knows whether the step's
    gradients are finite.
    """
    seeds = [v for v in model.non_trainable_variables
             if kerases.variable_name(v).rsplit("/", 1)[-1] == "seed_generator_state"]
    return moving_statistics(model) + seeds


def build_towers(models, optimizers, devices, x, zero):
    """Creates every variable on its tower and checks that the towers match.

    Args:
      models, optimizers, devices: lists of K, tower k's replica, optimizer
        and device.
      x: a batch [batch, ...] to build unbuilt models with, or None when all
        are built.
      zero: (zero_stage, total towers T, this worker's first tower): the
        towers' sharding (trainer.sharding.sharding_for), whose targets
        the optimizers are built on.

    Returns:
      Towers.

    Raises:
      ValueError: the towers differ in their variables; a tower of a ZeRO
        run with loss scaling would hold no element.
    """
    for model, device in zip(models, devices):
        with tf.device(device):
            if not model.built:
                # One example is enough to create the variables; the
                # inference call leaves BatchNorm statistics untouched.
                model(tf.nest.map_structure(lambda t: t[:1], x), training=False)
    trainable = [list(m.trainable_variables) for m in models]
    sharding = sharding_for(zero[0], trainable, devices, *zero[1:])
    sharding.check_loss_scaling(optimizers)
    for k, (optimizer, device) in enumerate(zip(optimizers, devices)):
        with tf.device(device):
            optimizer.build(sharding.targets(k))
    shared = [sharding.shared_variables(o) for o in optimizers]
    towers = Towers(
        models=models,
        optimizers=optimizers,
        devices=devices,
        trainable=trainable,
        moving=[moving_statistics(m) for m in models],
        forward=[forward_state(m) for m in models],
        variables=[list(m.variables) + own for m, own in zip(models, shared)],
        sharding=sharding,
    )
    _check_match(towers.variables)
    return towers


def _check_match(all_vars):
    """Raises ValueError unless every tower's variables match tower 0's in shape and dtype."""
    reference = all_vars[0]
    for k, tower_vars in enumerate(all_vars[1:], start=1):
        if len(tower_vars) != len(reference):
            raise ValueError(
                f"tower {k} has {len(tower_vars)} model and optimizer variables, tower 0 has "
                f"{len(reference)}; model_fn and optimizer_fn must build the same thing "
                "on every call"
            )
        for v, v0 in zip(tower_vars, reference):
            if tuple(v.shape) != tuple(v0.shape) or v.dtype != v0.dtype:
                raise ValueError(
                    f"tower {k} variable {kerases.variable_name(v)!r} is {v.dtype}"
                    f"{list(v.shape)} but tower 0's {kerases.variable_name(v0)!r} is "
                    f"{v0.dtype}{list(v0.shape)}; model_fn must build "
                    "the same model on every call"
                )


def sync_functions(towers, cluster, counters):
    """The tf.functions that broadcast tower 0 and measure the towers' difference.

    Args:
      towers: Towers, built.
      cluster: the started tfreduce.Cluster, or a LocalCluster.
      counters: the host tf.Variables of the run (the step counter, the
        epoch's running totals); in a cluster rank 0's values are broadcast
        with the variables.

    Returns:
      (broadcast, difference): broadcast() copies tower 0's variables (rank
      0's in a cluster) to every tower (with ZeRO, then sets each piece from
      them); difference() returns the float
      largest absolute difference between any tower's variable and tower 0's.
    """
    # The raw tf.Variables, which the core reductions read and assign.
    raw = tf_variables(towers.variables)

    def broadcast():
        # Rank 0's counters travel too: only rank 0 reads checkpoints, and
        # every worker must continue from its step (one tower of one
        # process: nothing to copy). Second, after the variables:
        # collectives are issued in order. The assignments' Operations
        # cannot be returned from a tf.function: it returns a constant.
        ops = broadcast_variables_multiworker(raw, cluster)
        with tf.control_dependencies(ops):
            ops = broadcast_variables_multiworker([list(counters)], cluster)
        with tf.control_dependencies(ops):
            # With ZeRO, each piece takes its range of the weights just broadcast.
            towers.sharding.load_pieces(towers.trainable)
            return tf.constant(0)

    broadcast_fn = tf.function(broadcast, autograph=False)
    difference_fn = tf.function(lambda: max_replica_difference(raw), autograph=False)
    return broadcast_fn, difference_fn


def _nbytes(variables):
    return sum(int(v.shape.num_elements()) * tf.as_dtype(v.dtype).size for v in variables)


def state_variables(towers, state):
    """The variables on each tower's device, by kind (ReplicatedTrainer.state_variables).

    Args:
      towers: Towers, built.
      state: update.TowerState.

    Returns:
      list of K dicts of lists of tf.Variable: "weights", "optimizer",
      "accumulation", "compression".
    """
    out = []
    for k, (model, optimizer) in enumerate(zip(towers.models, towers.optimizers)):
        out.append({
            "weights": list(model.variables) + list(state.saved[k]),
            "optimizer": list(optimizer.variables) + towers.sharding.variables(k),
            "accumulation": list(state.sums[k]) if state.sums else [],
            "compression": state.powersgd.tower_variables(k) if state.powersgd else [],
        })
    return out


def state_bytes(towers, state):
    """The bytes of state on each tower's device, by kind (ReplicatedTrainer.state_bytes).

    Args:
      towers: Towers, built.
      state: update.TowerState.

    Returns:
      list of K dicts of ints: "weights", "optimizer", "accumulation",
      "compression", "total".
    """
    out = []
    for kinds in state_variables(towers, state):
        row = {kind: _nbytes(variables) for kind, variables in kinds.items()}
        row["total"] = sum(row.values())
        out.append(row)
    return out
