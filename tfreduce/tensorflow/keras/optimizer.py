"""DistributedOptimizer: any Keras optimizer, its gradients all-reduced over the processes.

Source: Horovod's DistributedOptimizer (horovod.tensorflow.keras): a subclass
of the optimizer's own class, made at run time and rebuilt from the
optimizer's config, so ``model.compile``/``fit`` and saved models see the
user's optimizer class. The reduction's settings live on that class, so its
``from_config`` makes a distributed optimizer too. Keras 3's subclass
reduces in ``apply`` (below); Keras 2's (tf_keras, both its optimizers) in
the gradients' computation, as Horovod's Keras 2 one (``optimizer_keras2``).
"""

import keras
import tensorflow as tf

from tfreduce.basis import kerases
from tfreduce.buffers.compression import Compression
from tfreduce.tensorflow.keras import optimizer_keras2
from tfreduce.tensorflow.reduce_ops import Average, global_process_set
from tfreduce.tensorflow.tape import GradientReduction, local_layers_of

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "describe_optimizer",
           "distributed_class", "load_model", "own_sums"]


def _distributed_class(base, settings):
    """The subclass of Keras 3 optimizer class `base` whose apply() all-reduces first.

    `settings`: the class attributes (see optimizer_keras2.distributed_class)."""

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        self._tfreduce_local = set()  # ids of the variables registered as local

    def build(self, variables):
        base.build(self, variables)
        if self._tfreduce_passes_per_step > 1:
            # Each process's own sums of the gradients since the last update,
            # saved with the optimizer, so a resumed run continues the cycle.
            self._tfreduce_sums = [self.add_variable_from_reference(v, "tfreduce_sum")
                                   for v in variables]
            self._tfreduce_passes = self.add_variable((), initializer="zeros", dtype="int64",
                                                      name="tfreduce_backward_passes")

    def register_local_var(self, var):
        # Horovod's: this variable's gradient stays on this process.
        self._tfreduce_local.add(id(var))

    def reduce_and_apply(self, grads, variables):
        local = [id(v) in self._tfreduce_local for v in variables]
        out = self._tfreduce_reduction.reduce_partly(grads, local, self._tfreduce_scale_local)
        return base.apply(self, out, variables)

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        passes = self._tfreduce_passes_per_step
        if passes == 1:
            return reduce_and_apply(self, grads, trainable_variables)
        if not self.built:
            self.build(trainable_variables)
        count = self._tfreduce_passes
        count.assign_add(1)
        for total, g in zip(self._tfreduce_sums, grads):
            if g is not None:
                total.assign_add(tf.convert_to_tensor(g))

        def update():
            divisor = passes if self._tfreduce_average_aggregated else 1
            summed = [None if g is None else total / divisor
                      for total, g in zip(self._tfreduce_sums, grads)]
            reduce_and_apply(self, summed, trainable_variables)
            for total in self._tfreduce_sums:
                total.assign(tf.zeros_like(total))
            return tf.constant(True)

        # Every process takes the same branch: the counts move in step.
        tf.cond(tf.equal(count % passes, 0), update, lambda: tf.constant(False))

    members = {"__init__": __init__, "build": build, "apply": apply,
               "register_local_var": register_local_var, "__module__": base.__module__}
    return type(base.__name__, (base,), {**members, **settings})


@tf.autograph.experimental.do_not_convert
def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """A copy of a Keras optimizer whose updates use gradients all-reduced over every process.

    Pass it to ``model.compile``; ``fit`` (and custom ``train_step``s that
    call ``apply_gradients``) then reduce each step's gradients in the
    traced step, packed and compressed as asked, before the update.

    A Keras 2 optimizer (tf_keras: ``optimizers.Optimizer`` or the legacy
    ``OptimizerV2``) is reduced where Keras 2 computes the gradients,
    ``compute_gradients``/``_compute_gradients`` (so ``minimize``, ``fit``
    and ``train_on_batch``), as Horovod's; its ``iterations`` counts every
    call with backward_passes_per_step > 1, as Horovod's, and its
    ``_agg_helper.counter`` the calls since the last update
    (``optimizer_keras2``). What follows is of Keras 3's. A
    ``LossScaleOptimizer`` decides on the reduced gradients, the same on
    every process; under the mixed_float16 policy an optimizer that is not
    one is wrapped in one here, as ``compile`` would do outside.
    ``iterations`` counts updates (with backward_passes_per_step=M, one
    per M calls), as Keras' own gradient accumulation does. The result is a new optimizer of a subclass
    of the optimizer's class (same name), built from its config: state
    already in `optimizer` is not copied.

    Each process computes the gradient of its own loss (the mean over its
    part of the global batch); op=Average (default) makes the update that of
    the mean over processes, equal to the full global batch's when the parts
    are of one size.

    Args:
      optimizer: a keras.optimizers.Optimizer (Keras 3), LossScaleOptimizer
        included; or a tf_keras optimizer, not a LossScaleOptimizer (tf_keras'
        compile wraps the distributed one under mixed_float16).
      name: str, the new optimizer's name (default: the optimizer's).
      device_dense: Horovod's device hint (unused).
      device_sparse: as device_dense.
      compression: tfreduce.Compression.none, .fp16 or .bf16.
      sparse_as_dense: bool, densify IndexedSlices gradients (embeddings)
        before the reduction; otherwise their rows are all-gathered.
      gradient_predivide_factor: float f; with op=Average each gradient is
        divided by f before the sum and multiplied by f/size after.
      op: Average (default) or Sum.
      backward_passes_per_step: int M >= 1: gradients are summed on each
        process over M calls, then all-reduced and applied once (the other
        calls apply nothing).
      average_aggregated_gradients: bool, divide those sums by M (Horovod's
        default False applies their sum).
      num_groups: Horovod's number of fusion groups; must be 0.
      groups: Horovod's fusion groups; must be None.
      process_set: global_process_set (the only one).
      scale_local_gradients: bool, divide the gradients of the variables
        registered with ``register_local_var`` by the number of processes.

    Returns:
      the new optimizer.

    Raises:
      TypeError: optimizer is not a Keras optimizer (a tf.compat.v1 one
        is named), or a tf_keras LossScaleOptimizer.
      ValueError: backward_passes_per_step < 1, an unsupported op, groups
        or process set.
    """
    del device_dense, device_sparse
    keras_module = _keras_of_optimizer(optimizer)
    settings = _settings("DistributedOptimizer", compression, sparse_as_dense,
                         gradient_predivide_factor, op, backward_passes_per_step,
                         average_aggregated_gradients, num_groups, groups, process_set,
                         scale_local_gradients)
    if (keras_module is keras and keras.mixed_precision.global_policy().name == "mixed_float16"
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)):
        # As compile would, but inside: the scale must decide on the reduced
        # gradients, the same on every process (compile's outer wrapper
        # would check each process's own and could skip on one only).
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return distributed_class(type(optimizer), settings).from_config(config)


def _keras_of_optimizer(optimizer):
    """The Keras of `optimizer` (keras or tf_keras), checked as DistributedOptimizer takes it."""
    keras_module = kerases.keras_of(optimizer)
    families = () if keras_module is None else (keras_module.optimizers.Optimizer,) + (
        () if keras_module is keras else (keras_module.optimizers.legacy.Optimizer,))
    if not isinstance(optimizer, families):
        raise TypeError(f"DistributedOptimizer needs a Keras optimizer "
                        f"(keras.optimizers.Adam(...)), got {type(optimizer).__module__}."
                        f"{type(optimizer).__name__}")
    if keras_module is not keras and kerases.scales_loss(optimizer):
        raise TypeError("DistributedOptimizer: give tf_keras' LossScaleOptimizer the "
                        "distributed optimizer, not the other way round: "
                        "LossScaleOptimizer(DistributedOptimizer(opt)) (compile does so under "
                        "the mixed_float16 policy)")
    return keras_module


def _settings(where, compression, sparse_as_dense, gradient_predivide_factor, op,
              backward_passes_per_step, average_aggregated_gradients, num_groups, groups,
              process_set, scale_local_gradients):
    """The distributed class's attributes from Horovod's arguments, checked."""
    if isinstance(backward_passes_per_step, bool) or not isinstance(
            backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got "
                         f"{backward_passes_per_step!r}")
    reduction = GradientReduction.from_horovod(
        where, compression, sparse_as_dense, op, gradient_predivide_factor,
        num_groups, groups, process_set)
    return {"_tfreduce_reduction": reduction,
            "_tfreduce_passes_per_step": backward_passes_per_step,
            "_tfreduce_average_aggregated": bool(average_aggregated_gradients),
            "_tfreduce_scale_local": bool(scale_local_gradients)}


def distributed_class(base, settings):
    """The distributed subclass of optimizer class `base` (of Keras 3 or tf_keras)."""
    if issubclass(base, keras.optimizers.Optimizer):
        return _distributed_class(base, settings)
    return optimizer_keras2.distributed_class(base, settings)


class _SavedOptimizer:
    """Reads a saved optimizer as the distributed subclass of the class it was saved from.

    One Keras 2 name ("Adam") is two classes: the current optimizer and the
    legacy OptimizerV2, which a config marks with ``is_legacy_optimizer``
    (absent: legacy, as Keras 2 reads it)."""

    def __init__(self, current, legacy):
        self._current, self._legacy = current, legacy

    def from_config(self, config, custom_objects=None):
        old = self._legacy is not None and config.get("is_legacy_optimizer", True)
        return (self._legacy if old else self._current).from_config(config, custom_objects)


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none):
    """A saved model whose optimizer comes back as a DistributedOptimizer (Horovod's load_model).

    Loaded by the Keras that ``tf.keras`` is (``kerases.tf_keras``): every
    optimizer class of that Keras, and each of `custom_optimizers`, is read
    as its distributed subclass, so the optimizer's saved state comes back
    inside the distributed optimizer.

    Args:
      filepath: str, a model saved by that Keras' ``model.save``.
      custom_optimizers: list of optimizer classes of the user's own.
      custom_objects: dict, as Keras' load_model takes it.
      compression: as DistributedOptimizer's.

    Returns:
      the model.

    Raises:
      what Keras' load_model raises; ValueError: a bad compression.
    """
    keras_module = kerases.tf_keras()
    settings = _settings("load_model", compression, False, 1.0, Average, 1, False, 0, None,
                         global_process_set, True)
    legacy = None if keras_module is keras else keras_module.optimizers.legacy  # OptimizerV2
    objects = {}
    for name, current in vars(keras_module.optimizers).items():
        if (isinstance(current, type) and issubclass(current, keras_module.optimizers.Optimizer)
                and current is not keras_module.optimizers.Optimizer
                and not issubclass(current, keras_module.mixed_precision.LossScaleOptimizer)):
            old = getattr(legacy, name, None)
            reader = _SavedOptimizer(distributed_class(current, settings),
                                     None if old is None else distributed_class(old, settings))
            # Keras 2's h5 reader looks optimizers up by lower-case name.
            objects[name] = objects[name.lower()] = reader
    for custom in custom_optimizers or []:
        objects[custom.__name__] = distributed_class(custom, settings)
    objects.update(custom_objects or {})
    return keras_module.models.load_model(filepath, custom_objects=objects)


@tf.autograph.experimental.do_not_convert
def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """A DistributedOptimizer whose `local_layers` update from this process's gradients alone.

    Horovod's model parallelism within data parallelism: the trainable
    variables of each local layer are registered with
    ``register_local_var`` (their gradients divided by the number of
    processes when scale_local_gradients is True); the others are reduced.

    Args:
      local_layers: a keras Layer or a list of them, or None.
      the others: as DistributedOptimizer.

    Raises:
      As DistributedOptimizer; TypeError: a local layer that is not a Keras layer.
    """
    distributed = DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
        0, groups, process_set, scale_local_gradients)
    for layer in local_layers_of(local_layers, "PartialDistributedOptimizer"):
        for variable in layer.trainable_weights:
            distributed.register_local_var(variable)
    return distributed


def describe_optimizer(optimizer):
    """The optimizer's class and reduction settings, as text the processes compare."""
    if optimizer is None:
        return "no optimizer"
    settings = getattr(optimizer, "_tfreduce_reduction", None)
    passes = getattr(optimizer, "_tfreduce_passes_per_step", None)
    return (f"optimizer {type(optimizer).__name__}, reduction {settings!r}, "
            f"backward_passes_per_step {passes}")


def own_sums(optimizer):
    """The variables in which a DistributedOptimizer sums this process's gradients between updates.

    With backward_passes_per_step > 1 they hold this process's own batches,
    which no broadcast may overwrite mid-cycle; otherwise, and for other
    optimizers, an empty list.
    """
    return list(getattr(optimizer, "_tfreduce_sums", ()))
