"""Synchronous data-parallel training of a Keras 3 model on K devices.

`ReplicatedTrainer` keeps one replica of the model (a "tower") and one
optimizer on each of K devices. Every step splits the global batch across the
towers, computes per-tower gradients, reduces them with one call to
`tfreduce.allreduce_grads` and applies the same reduced gradients on every
tower, so the replicas stay identical. This is the in-graph replicated scheme
of tensorflow/benchmarks' `variable_update=replicated` and of tensorpack's
SyncMultiGPUTrainerReplicated, written for TF2 `tf.function` and Keras 3.
"""

import contextlib
import os
import re
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from tfreduce.allreduce import ALGORITHMS, allreduce_grads
from tfreduce.cluster import Cluster
from tfreduce.contract import shard_sizes
from tfreduce.devices import tower_devices
from tfreduce.multiworker import (
    CROSS_WORKER_PACK_BYTES,
    allreduce_grads_multiworker,
    broadcast_variables_multiworker,
)
from tfreduce.replicated import broadcast_variables, max_replica_difference

_CHECKPOINT_NAME = "ckpt"
_CHECKPOINTS_KEPT = 3
# The device that holds the step counter and where the global batch is split
# and per-tower results are gathered: the host, which every tower can reach.
_HOST = "/device:CPU:0"


def _resolve_cluster(cluster):
    """The started Cluster of a multi-worker run, or None for one process.

    Args:
      cluster: "auto" (a Cluster from TF_CONFIG when that variable is set,
        else None), None, or a tfreduce.Cluster.

    Raises:
      TypeError: cluster is none of these.
    """
    if isinstance(cluster, str) and cluster == "auto":
        if not os.environ.get("TF_CONFIG"):
            return None
        cluster = Cluster.from_tf_config()
    if cluster is None:
        return None
    if not isinstance(cluster, Cluster):
        raise TypeError(
            f'cluster must be "auto", None or a tfreduce.Cluster, got {type(cluster).__name__}'
        )
    # Before any tensor exists: from here on this worker's devices carry its
    # job and task. start() does nothing on a cluster that already started.
    return cluster.start()


def _per_example_loss_fn(loss):
    """Returns fn(y_true, y_pred) -> one loss value per example.

    A `keras.losses.Loss` is used through its unreduced `call`: its own
    reduction would average over the tower's shard, while the trainer needs
    per-example values to weight each shard by its share of the global batch.
    `call` also keeps the model's dtype, where `Loss.__call__` casts to the
    loss's dtype (float32 by default).
    """
    if isinstance(loss, str):
        resolved = keras.losses.get(loss)
        if resolved is None:
            raise ValueError(
                f"unknown loss {loss!r}; give a keras loss name, a keras.losses.Loss or a function"
            )
        loss = resolved
    if isinstance(loss, keras.losses.Loss):
        return loss.call
    if callable(loss):
        return loss
    raise TypeError(
        "loss must be a keras loss name, a keras.losses.Loss or a function "
        f"(y_true, y_pred) -> per-example losses, got {type(loss).__name__}"
    )


def _moving_statistics(model):
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
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            found.extend([layer.moving_mean, layer.moving_variance])
    return found


def _correct_count(y_true, y_pred):
    """Number of correct class predictions, or None when it is not defined.

    Defined for class scores y_pred [batch, classes] against integer labels
    [batch] or [batch, 1], or one-hot labels [batch, classes].
    """
    if y_pred.shape.rank != 2 or y_pred.shape[-1] is None or y_pred.shape[-1] < 2:
        return None
    if y_true.shape.rank == 2 and y_true.shape[-1] == 1 and y_true.dtype.is_integer:
        y_true = tf.squeeze(y_true, axis=-1)
    if y_true.shape.rank == 1 and y_true.dtype.is_integer:
        labels = tf.cast(y_true, tf.int64)
    elif y_true.shape.rank == 2 and y_true.shape[-1] == y_pred.shape[-1]:
        labels = tf.argmax(y_true, axis=-1)
    else:
        return None
    hits = tf.equal(tf.argmax(y_pred, axis=-1), labels)
    return tf.reduce_sum(tf.cast(hits, tf.int64))


class ReplicatedTrainer:
    """Trains K replicas of a Keras model with one gradient all-reduce per step.

    Tower k holds a replica of the model (`models[k]`) and its own optimizer,
    all their variables on `devices[k]`. One step on a global batch of B
    examples:

    1. splits the batch into K contiguous shards; when K does not divide B
       the first B % K towers take one example more (B=10, K=4 gives 3, 3, 2,
       2), so no example is dropped or repeated;
    2. runs forward and backward on every tower; tower k's loss is the sum of
       its per-example losses times K/B when `average=True` (the all-reduce
       then divides the sum by K), or times 1/B when `average=False` (the
       all-reduce sums). Either way the reduced gradient is exactly the
       gradient of the mean loss over the B examples of the global batch,
       even for uneven shards: with equal shards, K/B is the shard mean;
    3. calls `tfreduce.allreduce_grads` once on the K x N gradients;
    4. applies the reduced gradients with each tower's optimizer. Every tower
       applies the same update to the same values, so the replicas stay equal;
    5. replaces the moving mean and variance of every trainable
       BatchNormalization layer with their average over towers weighted by
       shard size (one more all-reduce with the same algorithm). For a
       moving mean this is exactly the update one device makes from the
       global batch; a moving variance becomes the weighted mean of shard
       variances, which leaves out the spread between shard means. The
       normalisation inside a step still uses each shard's own statistics,
       as in any data-parallel BatchNorm that is not cross-replica.

    At start, and after `restore`, tower 0's variables (model and optimizer)
    are broadcast to every tower; `bcast_period=n` repeats that every n steps
    to wipe out any drift. Random layers such as Dropout keep their random
    state in model variables, so after a broadcast every tower draws the same
    random numbers, each on its own shard of the batch.

    A model whose variables are created on first call (a Sequential without
    an Input) is built on the first batch the trainer sees.

    Several workers (processes, usually one per machine, each with its own
    K devices; see `tfreduce.cluster`): under TF_CONFIG, or with
    `cluster=`, every worker runs the same program on the same global
    batches. Each step then takes this worker's part of the global batch
    (`Cluster.batch_slice`), so the T = W * K towers of all W workers get
    the shards one process with T devices would give them, and both
    all-reduces go through `tfreduce.allreduce_grads_multiworker` (this
    worker's towers with `algorithm`, then across workers). The broadcasts
    copy rank 0's tower 0, step counter included, to every tower of every
    worker. Only rank 0 (`is_chief`) writes checkpoints and summaries and
    shows progress; `restore` reads the checkpoint on rank 0 only. Every
    worker evaluates and predicts on all the data it is given, so all get
    the same results. A lost worker fails the step with
    `tfreduce.cluster.WorkerLostError`.

    Example:

        trainer = tfreduce.ReplicatedTrainer(           # tfreduce:
            model_fn=make_model,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer_fn=lambda: keras.optimizers.Adam(1e-3),
            devices=["/gpu:0", "/gpu:1"],
            algorithm="hierarchical",
        )
        trainer.fit(x_train, y_train, epochs=5, batch_size=128,
                    validation_data=(x_test, y_test), checkpoint_dir="ckpt")

    Attributes:
      models: list of K `keras.Model`, the tower replicas; models[0] is tower 0.
      optimizers: list of K Keras optimizers, optimizers[k] updates models[k].
      devices: list of K canonical device names, devices[k] holds tower k.
      step: int, the number of training steps taken (restored by `restore`).
      cluster: the started tfreduce.Cluster, or None in a single process.
      is_chief: bool, True on rank 0 (and in a single process), the
        worker that writes checkpoints and logs.
    """

    def __init__(
        self,
        model_fn,
        loss,
        optimizer_fn,
        devices=None,
        algorithm="auto",
        average=True,
        *,
        bcast_period=0,
        cluster="auto",
        **allreduce_options,
    ):
        """Builds one model replica and one optimizer per device.

        Args:
          model_fn: function () -> keras.Model, called once per tower under
            that tower's device so the replica's variables live there. Every
            call must build the same architecture.
          loss: a keras.losses.Loss, a Keras loss name ("mse"), or a function
            (y_true, y_pred) -> per-example losses of shape [batch] (trailing
            axes are averaged). Only per-example values are used; the
            trainer forms the global-batch mean itself.
          optimizer_fn: function () -> keras.optimizers.Optimizer, called once
            per tower; each optimizer's slots live on its tower.
          devices: list of K device names, one tower each; default all GPUs,
            or all logical CPU devices when there is no GPU.
          algorithm: str, a name in tfreduce.ALGORITHMS, passed to
            tfreduce.allreduce_grads.
          average: bool, passed to tfreduce.allreduce_grads; the loss scaling
            adapts so the global-batch mean is optimised either way.
          bcast_period: int >= 0; when positive, tower 0's variables are
            broadcast to all towers every `bcast_period` steps (MegEngine's
            bcast_period). 0 broadcasts only at start and after restore.
          cluster: "auto", None or a tfreduce.Cluster. "auto": when the
            TF_CONFIG environment variable is set, `Cluster.from_tf_config()`;
            otherwise a single process. The cluster is started here, before
            any variable exists, so configure logical devices first. `devices`
            are then this worker's own devices.
          **allreduce_options: passed to tfreduce.allreduce_grads, such as
            groups=[[0, 1], [2, 3]] for "hierarchical" or pack_bytes=; in a
            cluster, pack_bytes goes to allreduce_grads_multiworker and the
            others to its local algorithm.

        Raises:
          TypeError: model_fn or optimizer_fn is not callable or returns the
            wrong type, or loss is not a loss.
          ValueError: unknown algorithm, bad or missing devices, a negative
            bcast_period, or replicas that differ in their variables.
          TypeError: cluster is not "auto", None or a Cluster.
        """
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
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {list(ALGORITHMS)}")
        if isinstance(bcast_period, bool) or not isinstance(bcast_period, int) or bcast_period < 0:
            raise ValueError(
                f"bcast_period must be an int >= 0 (0: never re-broadcast), got {bcast_period!r}"
            )
        self.cluster = _resolve_cluster(cluster)
        self.devices = tower_devices(devices)
        workers = self.cluster.num_workers if self.cluster is not None else 1
        # T, the towers of all workers, among which each global batch is split.
        self._total_towers = workers * len(self.devices)
        self._loss_fn = _per_example_loss_fn(loss)
        self._algorithm = algorithm
        self._average = bool(average)
        self._bcast_period = bcast_period
        self._allreduce_options = dict(allreduce_options)

        self.models = []
        self.optimizers = []
        for k, device in enumerate(self.devices):
            with tf.device(device):
                model = model_fn()
                optimizer = optimizer_fn()
            if not isinstance(model, keras.Model):
                raise TypeError(
                    f"model_fn returned {type(model).__name__} for tower {k}; "
                    "it must return a keras.Model"
                )
            if not isinstance(optimizer, keras.optimizers.Optimizer):
                raise TypeError(
                    f"optimizer_fn returned {type(optimizer).__name__} for tower {k}; "
                    "it must return a keras.optimizers.Optimizer"
                )
            self.models.append(model)
            self.optimizers.append(optimizer)

        with tf.device(_HOST):
            self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        self._checkpoint = None
        self._pending_restore = None
        self._built = False
        self._train_fn = None
        self._eval_fn = None
        self._predict_fn = None
        self._broadcast_fn = None
        self._difference_fn = None
        self._has_accuracy = False
        if all(model.built for model in self.models):
            self._build(None)

    # ------------------------------------------------------------------ build

    @property
    def step(self):
        """int: the number of training steps taken so far."""
        return int(self._step.numpy())

    @property
    def is_chief(self):
        """bool: rank 0 of the cluster, or True in a single process."""
        return self.cluster is None or self.cluster.is_chief

    def _collectives(self):
        """Context of every call that runs cross-worker collectives.

        Turns the failure of a collective whose peer died into a
        WorkerLostError that names the lost worker.
        """
        if self.cluster is None:
            return contextlib.nullcontext()
        return self.cluster.detect_lost_workers()

    def _allreduce(self, all_grads, average):
        """The trainer's all-reduce: within this process, or across the cluster."""
        if self.cluster is None:
            return allreduce_grads(
                all_grads,
                self.devices,
                average=average,
                algorithm=self._algorithm,
                **self._allreduce_options,
            )
        local_options = dict(self._allreduce_options)
        pack_bytes = local_options.pop("pack_bytes", CROSS_WORKER_PACK_BYTES)
        return allreduce_grads_multiworker(
            all_grads,
            self.devices,
            average=average,
            cluster=self.cluster,
            local_algorithm=self._algorithm,
            local_options=local_options,
            pack_bytes=pack_bytes,
        )

    def _build(self, x):
        """Creates every variable on its tower, checks the replicas and syncs them.

        Args:
          x: a batch to build unbuilt models with, or None when all are built.
        """
        for k, (model, optimizer, device) in enumerate(
            zip(self.models, self.optimizers, self.devices)
        ):
            with tf.device(device):
                if not model.built:
                    # One example is enough to create the variables; the
                    # inference call leaves BatchNorm statistics untouched.
                    model(x[:1], training=False)
                optimizer.build(model.trainable_variables)
        self._trainable = [list(m.trainable_variables) for m in self.models]
        self._moving = [_moving_statistics(m) for m in self.models]
        self._all_vars = [
            list(m.variables) + list(o.variables) for m, o in zip(self.models, self.optimizers)
        ]
        reference = self._all_vars[0]
        for k, tower_vars in enumerate(self._all_vars[1:], start=1):
            if len(tower_vars) != len(reference):
                raise ValueError(
                    f"tower {k} has {len(tower_vars)} model and optimizer variables, tower 0 has "
                    f"{len(reference)}; model_fn and optimizer_fn must build the same thing "
                    "on every call"
                )
            for v, v0 in zip(tower_vars, reference):
                if tuple(v.shape) != tuple(v0.shape) or v.dtype != v0.dtype:
                    raise ValueError(
                        f"tower {k} variable {v.path!r} is {v.dtype}{list(v.shape)} but tower 0's "
                        f"{v0.path!r} is {v0.dtype}{list(v0.shape)}; model_fn must build "
                        "the same model on every call"
                    )
        # The raw tf.Variables, which the core reductions read and assign.
        raw = [[v.value for v in tower] for tower in self._all_vars]

        def broadcast():
            # The assignments run as the function's stateful ops; their
            # Operation results cannot be returned from a tf.function.
            broadcast_variables(raw, root=0)

        def broadcast_cluster():
            # Rank 0's step counter travels too: only rank 0 reads
            # checkpoints, and every worker must continue from its step.
            # Second, after the variables: collectives are issued in order.
            ops = broadcast_variables_multiworker(raw, self.cluster)
            with tf.control_dependencies(ops):
                ops = broadcast_variables_multiworker([[self._step]], self.cluster)
            with tf.control_dependencies(ops):
                return tf.constant(0)

        self._broadcast_fn = tf.function(
            broadcast if self.cluster is None else broadcast_cluster, autograph=False
        )
        self._difference_fn = tf.function(lambda: max_replica_difference(raw), autograph=False)
        # Tower 0's model and optimizer describe the whole run, since the
        # replicas are equal. The explicit variable list adds what Keras does
        # not track for checkpoints (the random state of Dropout layers), which
        # an exact resume needs.
        self._checkpoint = tf.train.Checkpoint(
            model=self.models[0],
            optimizer=self.optimizers[0],
            model_variables=list(self.models[0].variables),
            step=self._step,
        )
        self._built = True
        if self._pending_restore is not None:
            prefix, self._pending_restore = self._pending_restore, None
            self._restore_prefix(prefix)
        self._run_broadcast()

    def _run_broadcast(self):
        with self._collectives():
            self._broadcast_fn()

    def _ensure_built(self, x):
        if not self._built:
            self._build(x)

    def _check_batch(self, x, y, what):
        """Converts a global batch to tensors and checks it can be split."""
        x = tf.convert_to_tensor(x)
        y = tf.convert_to_tensor(y)
        if x.shape.rank == 0 or y.shape.rank == 0:
            raise ValueError(f"{what}: x and y need a batch axis, got x {x.shape} and y {y.shape}")
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"{what}: x has {x.shape[0]} examples but y has {y.shape[0]}")
        return x, y

    @staticmethod
    def _signature(t):
        return tf.TensorSpec([None] + t.shape[1:].as_list(), t.dtype)

    # ------------------------------------------------------------------ steps

    def _tower_loss_sum(self, model, x, y, training):
        """Sum of per-example losses of one shard and the model's outputs."""
        y_pred = model(x, training=training)
        per_example = tf.convert_to_tensor(self._loss_fn(y, y_pred))
        if per_example.shape.rank == 0:
            raise ValueError(
                "loss returned a single value for the whole shard; the trainer needs one "
                "value per example "
                "(give a keras.losses.Loss, a loss name, or a function without reduction)"
            )
        if per_example.shape.rank > 1:
            per_example = tf.reduce_mean(per_example, axis=list(range(1, per_example.shape.rank)))
        return tf.reduce_sum(per_example), y_pred

    def _regularization(self, model, dtype):
        if not model.losses:
            return tf.zeros([], dtype)
        return tf.cast(tf.add_n(model.losses), dtype)

    def _train_graph(self, x, y, batch):
        """One synchronous step; traced once by tf.function.

        Args:
          x, y: this worker's part of the global batch (all of it in a
            single process).
          batch: int32 scalar B, the size of the global batch.
        """
        num_towers = len(self.devices)
        total_towers = self._total_towers
        with tf.device(_HOST):
            sizes = shard_sizes(tf.shape(x)[0], num_towers)
            x_shards = tf.split(x, sizes, num=num_towers)
            y_shards = tf.split(y, sizes, num=num_towers)
        all_grads, loss_sums, corrects, regs = [], [], [], []
        for k, (model, device) in enumerate(zip(self.models, self.devices)):
            with tf.device(device), tf.name_scope(f"tower{k}"):
                x_k = tf.identity(x_shards[k])
                y_k = tf.identity(y_shards[k])
                with tf.GradientTape() as tape:
                    loss_sum, y_pred = self._tower_loss_sum(model, x_k, y_k, training=True)
                    dtype = loss_sum.dtype
                    # Scale before the reduction so that its sum (or mean)
                    # is the gradient of the global-batch mean loss.
                    scale = tf.cast(total_towers if self._average else 1, dtype) / tf.cast(
                        batch, dtype
                    )
                    reg = self._regularization(model, dtype)
                    # Every tower adds the same regularisation term; a sum
                    # over the T towers would count it T times.
                    reg_weight = 1.0 if self._average else 1.0 / total_towers
                    tower_loss = loss_sum * scale + reg * reg_weight
                grads = tape.gradient(tower_loss, self._trainable[k])
            all_grads.append(list(grads))
            loss_sums.append(loss_sum)
            regs.append(reg)
            corrects.append(_correct_count(y_k, y_pred))
        reduced = self._allreduce(all_grads, self._average)
        for k, (optimizer, device) in enumerate(zip(self.optimizers, self.devices)):
            with tf.device(device), tf.name_scope(f"tower{k}_apply"):
                optimizer.apply_gradients(zip(reduced[k], self._trainable[k]))
        self._has_accuracy = corrects[0] is not None
        # Each worker's collectives run one after the other, in the same
        # order on every worker: independent ones could wait for each other.
        after = [g for g in reduced[0] if g is not None] if self.cluster is not None else []
        after = self._sync_moving(sizes, batch, after)
        if self.cluster is not None:
            loss_sums, corrects = self._sum_metrics(loss_sums, corrects, after)
        with tf.device(_HOST):
            self._step.assign_add(1)
            dtype = loss_sums[0].dtype
            mean_loss = tf.add_n(loss_sums) / tf.cast(batch, dtype) + tf.cast(regs[0], dtype)
            correct = (
                tf.cast(tf.add_n(corrects), tf.int64)
                if self._has_accuracy
                else tf.constant(0, tf.int64)
            )
        return tf.cast(mean_loss, tf.float64), correct

    def _sum_metrics(self, loss_sums, corrects, after):
        """Loss sums and correct counts summed over the towers of every worker.

        Returns:
          ([loss sum], [correct count] or [None]) of the global batch, in float64
          (exact for counts below 2**53).
        """
        values = []
        for k, device in enumerate(self.devices):
            with tf.device(device):
                row = [tf.cast(loss_sums[k], tf.float64)]
                if self._has_accuracy:
                    row.append(tf.cast(corrects[k], tf.float64))
                values.append(row)
        with tf.control_dependencies(after), tf.name_scope("metrics"):
            summed = self._allreduce(values, average=False)[0]
        return [summed[0]], [summed[1] if self._has_accuracy else None]

    def _sync_moving(self, sizes, batch, after):
        """Sets BatchNorm moving statistics to their shard-weighted mean over towers.

        Args:
          sizes: int32 [K], this worker's shard sizes.
          batch: int32 scalar B, the global batch size; the weights
            sizes[k] / B of all T towers add up to 1.
          after: tensors the reduction runs after (control dependencies).

        Returns:
          the tensors a later collective must run after.
        """
        if not self._moving[0]:
            return after
        weighted = []
        for k, device in enumerate(self.devices):
            with tf.device(device), tf.name_scope(f"tower{k}_moving"):
                share = tf.cast(sizes[k], tf.float64) / tf.cast(batch, tf.float64)
                weighted.append([v * tf.cast(share, v.dtype) for v in self._moving[k]])
        # Reduced with the same engine as the gradients, with the weights
        # already applied, so a plain sum gives the weighted mean.
        with tf.control_dependencies(after):
            reduced = self._allreduce(weighted, average=False)
        for k, device in enumerate(self.devices):
            with tf.device(device):
                for v, value in zip(self._moving[k], reduced[k]):
                    v.assign(value)
        return list(reduced[0])

    def _eval_graph(self, x, y):
        """Sum of losses and correct predictions over a batch, split across towers."""
        num_towers = len(self.devices)
        with tf.device(_HOST):
            sizes = shard_sizes(tf.shape(x)[0], num_towers)
            x_shards = tf.split(x, sizes, num=num_towers)
            y_shards = tf.split(y, sizes, num=num_towers)
        loss_sums, corrects = [], []
        for k, (model, device) in enumerate(zip(self.models, self.devices)):
            with tf.device(device), tf.name_scope(f"tower{k}"):
                loss_sum, y_pred = self._tower_loss_sum(
                    model, x_shards[k], y_shards[k], training=False
                )
                loss_sums.append(tf.cast(loss_sum, tf.float64))
                corrects.append(_correct_count(y_shards[k], y_pred))
        with tf.device(_HOST):
            correct = tf.add_n(corrects) if corrects[0] is not None else tf.constant(-1, tf.int64)
            return tf.add_n(loss_sums), correct

    def _predict_graph(self, x):
        num_towers = len(self.devices)
        with tf.device(_HOST):
            x_shards = tf.split(x, shard_sizes(tf.shape(x)[0], num_towers), num=num_towers)
        outputs = []
        for k, (model, device) in enumerate(zip(self.models, self.devices)):
            with tf.device(device), tf.name_scope(f"tower{k}"):
                outputs.append(model(x_shards[k], training=False))
        with tf.device(_HOST):
            return tf.concat(outputs, axis=0)

    def _run_train_step(self, x, y):
        """Runs one step; returns (mean loss float, correct count int or None)."""
        x, y = self._check_batch(x, y, "train_step")
        batch = int(x.shape[0])
        total = self._total_towers
        if batch < total:
            towers = (
                f"{total} towers ({self.cluster.num_workers} workers x {len(self.devices)})"
                if self.cluster is not None
                else f"{total} towers"
            )
            raise ValueError(
                f"train_step: the global batch has {batch} examples but there are "
                f"{towers}; every tower needs at least one example, so use "
                f"a batch of at least {total}"
            )
        if self.cluster is not None:
            # Every worker is given the same global batch and takes its part.
            start, stop = self.cluster.batch_slice(batch, len(self.devices))
            x, y = x[start:stop], y[start:stop]
        self._ensure_built(x)
        if self._train_fn is None:
            # The batch axis stays None: a worker's part may differ in size
            # from step to step, and a retrace on one worker only would
            # build its collectives out of step with the others.
            self._train_fn = tf.function(
                self._train_graph,
                input_signature=[
                    self._signature(x),
                    self._signature(y),
                    tf.TensorSpec([], tf.int32),
                ],
            )
        with self._collectives():
            loss, correct = self._train_fn(x, y, tf.constant(batch, tf.int32))
        if self._bcast_period and self.step % self._bcast_period == 0:
            self._run_broadcast()
        return float(loss), (int(correct) if self._has_accuracy else None)

    def train_step(self, x, y):
        """Trains on one global batch, split across the towers.

        Args:
          x: tf.Tensor or np.ndarray [batch, ...], the inputs of the global batch.
          y: tf.Tensor or np.ndarray [batch, ...], the targets (for example int
            class labels [batch]).

        Returns:
          float, the mean loss over the global batch (plus regularisation),
          computed before the update.

        Raises:
          ValueError: x and y disagree on the batch size, or the batch has
            fewer examples than there are towers (of all workers).
          tfreduce.cluster.WorkerLostError: in a cluster, a worker is lost.
        """
        return self._run_train_step(x, y)[0]

    def check_replicas(self):
        """Largest absolute difference between any tower's variable and tower 0's.

        Compares every model and optimizer variable. After a step it is 0 for
        floating-point models on devices of one kind.

        Returns:
          float, max over towers k, variables n and elements of
          |models[k] variable n - models[0] variable n|.

        Raises:
          ValueError: the models are not built yet (no batch seen).
        """
        if not self._built:
            raise ValueError("check_replicas: the models are not built yet; train on a batch first")
        return float(self._difference_fn())

    def broadcast(self):
        """Copies tower 0's model and optimizer variables to every tower.

        In a cluster, rank 0's tower 0 (and step counter) goes to every tower
        of every worker; call it on every worker at the same point.

        Raises:
          ValueError: the models are not built yet (no batch seen).
        """
        if not self._built:
            raise ValueError("broadcast: the models are not built yet; train on a batch first")
        self._run_broadcast()

    # ------------------------------------------------------------------ data

    @staticmethod
    def _is_dataset(x):
        return isinstance(x, tf.data.Dataset)

    def _numpy_batches(self, x, y, batch_size, order, skip, drop_small):
        """Yields (x, y) batches of the examples in `order`, from batch `skip` on."""
        count = len(order)
        for start in range(skip * batch_size, count, batch_size):
            index = order[start : start + batch_size]
            if drop_small and len(index) < self._total_towers:
                return
            yield x[index], y[index]

    def _steps_per_epoch(self, x, batch_size):
        """Training steps in one epoch; a last batch smaller than T is skipped."""
        if self._is_dataset(x):
            cardinality = int(x.cardinality())
            if cardinality == tf.data.INFINITE_CARDINALITY:
                raise ValueError(
                    "fit: the dataset is infinite; give a finite dataset of global batches "
                    "(one epoch)"
                )
            if cardinality == tf.data.UNKNOWN_CARDINALITY:
                # Counting once is the only way to know where an epoch ends,
                # which a resume needs to find its place.
                cardinality = sum(1 for _ in x)
            return cardinality
        full, rest = divmod(len(x), batch_size)
        return full + (1 if rest >= self._total_towers else 0)

    def _check_arrays(self, x, y, what):
        if y is None:
            raise ValueError(
                f"{what}: y is missing; give x and y arrays, or a dataset of (x, y) batches as x"
            )
        if len(x) != len(y):
            raise ValueError(f"{what}: x has {len(x)} examples but y has {len(y)}")
        if len(x) == 0:
            raise ValueError(f"{what}: no examples (x is empty)")

    def _batches(self, x, y, batch_size, what):
        """(x, y) batches of a dataset or of arrays in order, for evaluate/predict."""
        if self._is_dataset(x):
            if y is not None:
                raise ValueError(
                    f"{what}: y must be None when x is a tf.data.Dataset of (x, y) batches"
                )
            return iter(x)
        self._check_arrays(x, y, what)
        return self._numpy_batches(x, y, batch_size, np.arange(len(x)), 0, drop_small=False)

    # ------------------------------------------------------------------ fit

    def fit(
        self,
        x,
        y=None,
        *,
        epochs=1,
        batch_size=32,
        shuffle=True,
        seed=0,
        validation_data=None,
        logdir=None,
        checkpoint_dir=None,
        callbacks=(),
        verbose=1,
    ):
        """Trains until `epochs` epochs are done, counting restored ones.

        The epoch and batch to start from follow from the step counter, so
        after `restore` (or a previous `fit`) training continues where it
        stopped; with array input and the same arguments the result equals
        an uninterrupted run. Array input is reshuffled each epoch by a
        generator seeded with (seed, epoch); a last batch with fewer examples
        than towers is skipped in that epoch (its examples land in other
        batches in other epochs when shuffling). A dataset is iterated as
        given: it must be finite and yield (x, y) global batches of at least K
        examples each, and a resume is exact only if it yields the same
        batches in every pass.

        Ctrl-C (KeyboardInterrupt) during fit writes a checkpoint to
        `checkpoint_dir`, when given, and then re-raises.

        In a cluster every worker calls fit with the same data and
        arguments; batches are global (split over the T = W * K towers of all
        workers), only rank 0 writes summaries and checkpoints and shows
        progress (the others ignore logdir, checkpoint_dir and verbose), and
        a successful fit ends with `Cluster.finish()`, which waits for every
        worker.

        Args:
          x: np.ndarray [examples, ...] of inputs, or a tf.data.Dataset of
            (x, y) global batches.
          y: np.ndarray [examples, ...] of targets; None for a dataset.
          epochs: int, the epoch to train up to (total, not additional).
          batch_size: int >= T, global batch size for array input (T = K
            towers, times W workers in a cluster).
          shuffle: bool, reshuffle array input every epoch.
          seed: int, seed of the shuffling.
          validation_data: (x_val, y_val) arrays or a dataset of (x, y)
            batches, evaluated after every epoch.
          logdir: directory for TensorBoard summaries: per step loss,
            accuracy, learning rate and step time; per epoch the epoch
            means, validation results and images/s. None: no summaries.
          checkpoint_dir: directory where a checkpoint is written after every
            epoch and on Ctrl-C (see `save`). None: no checkpoints.
          callbacks: functions fn(epoch, logs) called after every epoch with
            the 1-based epoch number and that epoch's dict of results.
          verbose: 0 silent, 1 progress bar per epoch.

        Returns:
          dict of lists, one entry per epoch run by this call: "epoch",
          "loss", "accuracy" (when defined), "val_loss" and "val_accuracy"
          (with validation_data), "images_per_sec" (training images over
          the epoch's wall time, including the first step's tracing).

        Raises:
          ValueError: bad arrays or dataset, batch_size smaller than K, or
            an infinite dataset.
          KeyboardInterrupt: re-raised after the checkpoint is written.
        """
        num_towers = self._total_towers
        if self._is_dataset(x):
            if y is not None:
                raise ValueError(
                    "fit: y must be None when x is a tf.data.Dataset of (x, y) batches"
                )
        else:
            self._check_arrays(x, y, "fit")
            x, y = np.asarray(x), np.asarray(y)
            if batch_size < num_towers:
                raise ValueError(
                    f"fit: batch_size={batch_size} is smaller than the {num_towers} towers; "
                    "every tower needs at "
                    f"least one example, so use a batch_size of at least {num_towers}"
                )
        steps_per_epoch = self._steps_per_epoch(x, batch_size)
        if steps_per_epoch == 0:
            raise ValueError(
                f"fit: no batch of at least {num_towers} examples (one per tower) in the "
                "training data"
            )
        if not self.is_chief:
            # Rank 0 writes and reports for the whole cluster.
            logdir, checkpoint_dir, verbose = None, None, 0
        writer = tf.summary.create_file_writer(logdir) if logdir else None
        history = {}
        try:
            first_epoch, skip = divmod(self.step, steps_per_epoch)
            for epoch in range(first_epoch, epochs):
                logs = self._fit_epoch(
                    x,
                    y,
                    epoch,
                    epochs,
                    batch_size,
                    shuffle,
                    seed,
                    skip,
                    steps_per_epoch,
                    writer,
                    verbose,
                )
                skip = 0
                if validation_data is not None:
                    val_x, val_y = (
                        (validation_data, None)
                        if self._is_dataset(validation_data)
                        else validation_data
                    )
                    results = self.evaluate(val_x, val_y, batch_size=max(batch_size, 256))
                    logs.update({f"val_{name}": value for name, value in results.items()})
                if writer is not None:
                    with writer.as_default(step=self.step):
                        for name, value in logs.items():
                            tf.summary.scalar(f"epoch/{name}", value)
                    writer.flush()
                if verbose:
                    print(" - ".join(f"{name}: {value:.4g}" for name, value in logs.items()))
                logs = {"epoch": epoch + 1, **logs}
                for name, value in logs.items():
                    history.setdefault(name, []).append(value)
                if checkpoint_dir is not None:
                    self.save(checkpoint_dir)
                for callback in callbacks:
                    callback(epoch + 1, logs)
        except KeyboardInterrupt:
            if checkpoint_dir is not None:
                path = self.save(checkpoint_dir)
                print(
                    f"\ninterrupted at step {self.step}; checkpoint written to {path}",
                    file=sys.stderr,
                )
            raise
        finally:
            if writer is not None:
                writer.close()
        if self.cluster is not None:
            # No worker leaves while a peer still needs its answers. Not in
            # a finally: after a failure the peers may never get here.
            self.cluster.finish()
        return history

    def _fit_epoch(
        self, x, y, epoch, epochs, batch_size, shuffle, seed, skip, steps_per_epoch, writer, verbose
    ):
        """Runs the steps of one epoch from batch `skip`; returns the epoch's logs."""
        if self._is_dataset(x):
            batches = iter(x.skip(skip))
        else:
            order = (
                np.random.default_rng([seed, epoch]).permutation(len(x))
                if shuffle
                else np.arange(len(x))
            )
            batches = self._numpy_batches(x, y, batch_size, order, skip, drop_small=True)
        if verbose:
            print(f"Epoch {epoch + 1}/{epochs}")
        progress = keras.utils.Progbar(
            steps_per_epoch, verbose=verbose, stateful_metrics=["loss", "accuracy", "images/s"]
        )
        if skip:
            progress.update(skip)
        loss_total, correct_total, seen = 0.0, 0, 0
        # Throughput is measured on the wall clock, so it counts batching,
        # logging and tracing too, not just the time inside the step.
        epoch_start = time.perf_counter()
        for step_in_epoch, (x_batch, y_batch) in enumerate(batches, start=skip + 1):
            start = time.perf_counter()
            loss, correct = self._run_train_step(x_batch, y_batch)
            step_time = time.perf_counter() - start
            size = int(x_batch.shape[0])
            elapsed = time.perf_counter() - epoch_start
            seen += size
            loss_total += loss * size
            values = [("loss", loss_total / seen)]
            if correct is not None:
                correct_total += correct
                values.append(("accuracy", correct_total / seen))
            values.append(("images/s", seen / elapsed))
            progress.update(step_in_epoch, values)
            if writer is not None:
                with writer.as_default(step=self.step):
                    tf.summary.scalar("train/loss", loss)
                    if correct is not None:
                        tf.summary.scalar("train/accuracy", correct / size)
                    tf.summary.scalar("train/learning_rate", self._learning_rate())
                    tf.summary.scalar("train/step_time_s", step_time)
        logs = {"loss": loss_total / max(seen, 1)}
        if self._has_accuracy:
            logs["accuracy"] = correct_total / max(seen, 1)
        logs["images_per_sec"] = seen / (time.perf_counter() - epoch_start)
        return logs

    def _learning_rate(self):
        return float(tf.convert_to_tensor(self.optimizers[0].learning_rate))

    # ------------------------------------------------------------------ eval

    def evaluate(self, x, y=None, batch_size=256):
        """Mean loss and accuracy over a dataset, each batch split across the towers.

        Args:
          x: np.ndarray [examples, ...] or a tf.data.Dataset of (x, y) batches.
          y: np.ndarray [examples, ...] of targets; None for a dataset.
          batch_size: int, global batch size for array input.

        Returns:
          dict: "loss" (float, mean per-example loss plus regularisation) and,
          for class scores against int or one-hot labels, "accuracy" (float).

        Raises:
          ValueError: bad arrays (empty, or x and y of different lengths).
        """
        loss_total, correct_total, count, has_accuracy = 0.0, 0, 0, True
        for x_batch, y_batch in self._batches(x, y, batch_size, "evaluate"):
            x_batch, y_batch = self._check_batch(x_batch, y_batch, "evaluate")
            self._ensure_built(x_batch)
            if self._eval_fn is None:
                self._eval_fn = tf.function(
                    self._eval_graph,
                    input_signature=[self._signature(x_batch), self._signature(y_batch)],
                )
            loss_sum, correct = self._eval_fn(x_batch, y_batch)
            loss_total += float(loss_sum)
            count += int(x_batch.shape[0])
            has_accuracy = has_accuracy and int(correct) >= 0
            correct_total += int(correct)
        if count == 0:
            raise ValueError("evaluate: the data has no examples")
        reg = float(self._regularization(self.models[0], tf.float64))
        results = {"loss": loss_total / count + reg}
        if has_accuracy:
            results["accuracy"] = correct_total / count
        return results

    def predict(self, x, batch_size=256):
        """Model outputs for every example, each batch split across the towers.

        Args:
          x: np.ndarray [examples, ...], or a tf.data.Dataset of input batches
            (or of (x, y) batches, whose y is ignored).
          batch_size: int, global batch size for array input.

        Returns:
          np.ndarray [examples, ...outputs], in input order.

        Raises:
          ValueError: x has no examples.
        """
        if self._is_dataset(x):
            batches = (b[0] if isinstance(b, tuple) else b for b in x)
        else:
            x = np.asarray(x)
            batches = (x[i : i + batch_size] for i in range(0, len(x), batch_size))
        outputs = []
        for x_batch in batches:
            x_batch = tf.convert_to_tensor(x_batch)
            self._ensure_built(x_batch)
            if self._predict_fn is None:
                self._predict_fn = tf.function(
                    self._predict_graph, input_signature=[self._signature(x_batch)]
                )
            outputs.append(self._predict_fn(x_batch).numpy())
        if not outputs:
            raise ValueError("predict: x has no examples")
        return np.concatenate(outputs, axis=0)

    # ------------------------------------------------------------------ checkpoints

    def save(self, path):
        """Writes a checkpoint of tower 0's model, optimizer and the step counter.

        `path` is a directory. Each save writes the files of a new checkpoint
        `ckpt-<n>` under a number no earlier checkpoint there used, and only
        then rewrites the small `checkpoint` index file that names the
        latest one (tf.train.CheckpointManager, which replaces that file
        atomically). A crash during a save therefore leaves the previous
        checkpoint as the latest, never a half-written one. The three newest
        checkpoints are kept. In a cluster only rank 0 writes; the other
        ranks hold the same values and write nothing.

        Args:
          path: str, checkpoint directory (created if missing).

        Returns:
          str, the prefix of the checkpoint written; None on the other ranks
          of a cluster.

        Raises:
          ValueError: the models are not built yet (no batch seen).
        """
        if not self._built:
            raise ValueError("save: the models are not built yet; train on a batch first")
        if not self.is_chief:
            return None
        os.makedirs(path, exist_ok=True)
        manager = tf.train.CheckpointManager(
            self._checkpoint, path, max_to_keep=_CHECKPOINTS_KEPT, checkpoint_name=_CHECKPOINT_NAME
        )
        used = [
            int(match.group(1))
            for name in os.listdir(path)
            if (match := re.fullmatch(rf"{_CHECKPOINT_NAME}-(\d+)\.index", name))
        ]
        # A fresh number, so the files the index currently names are never
        # overwritten while it still names them.
        return manager.save(checkpoint_number=max(used, default=0) + 1)

    def restore(self, path):
        """Restores a checkpoint written by `save` and broadcasts it to all towers.

        Afterwards `fit` with the same data and arguments continues the run
        exactly where the checkpoint was written. In a cluster, call it on
        every worker: rank 0 reads the checkpoint and broadcasts it, so only
        rank 0 needs to see `path`.

        Args:
          path: str, a checkpoint directory (its latest checkpoint is used)
            or the prefix of one checkpoint ("dir/ckpt-3").

        Returns:
          str, the prefix of the checkpoint restored; None on the other ranks
          of a cluster.

        Raises:
          FileNotFoundError: there is no checkpoint at path (rank 0).
          ValueError: the checkpoint does not match this trainer's model.
        """
        if not self.is_chief:
            # Rank 0's values arrive with the broadcast, at build if the
            # models are not built yet.
            if self._built:
                self._run_broadcast()
            return None
        prefix = tf.train.latest_checkpoint(path) if os.path.isdir(path) else path
        if prefix is None or not tf.io.gfile.exists(prefix + ".index"):
            raise FileNotFoundError(
                f"restore: no checkpoint at {path!r} (neither a checkpoint directory nor prefix)"
            )
        if not self._built:
            # Restored once the first batch has built the models.
            self._pending_restore = prefix
            return prefix
        self._restore_prefix(prefix)
        self._run_broadcast()
        return prefix

    def _restore_prefix(self, prefix):
        status = self._checkpoint.restore(prefix)
        try:
            status.assert_existing_objects_matched()
        except AssertionError as error:
            raise ValueError(
                f"restore: checkpoint {prefix!r} does not match this trainer's model: {error}"
            ) from None
