"""The two Kerases: Keras 3 (``keras``) and Keras 2 (``tf_keras``), and what differs between them.

On TensorFlow 2.16+ both live side by side: ``import keras`` is Keras 3,
``import tf_keras`` Keras 2, and ``tf.keras`` is Keras 2 when
``TF_USE_LEGACY_KERAS=1`` is set before TensorFlow is imported (most
existing data-parallel code: Horovod's Keras scripts, TF Model Garden). A
tf_keras model is not a ``keras.Model``, and their optimizers differ. This
module is the one place that tells them apart: the trainer and the Keras
doors ask it which Keras an object is of and how to do the few things that
differ (wrap an optimizer for loss scaling, find BatchNormalization layers,
name a variable), and are written once above it.

tf_keras is optional (``pip install tfreduce[keras2]``): nothing here
imports it unless an object of it is given, or ``tf.keras`` is it.
"""

import importlib
import os
import sys

import keras

__all__ = ["LEGACY_ENV", "is_batch_normalization", "is_keras2", "is_layer", "is_model",
           "is_optimizer", "keras_of", "legacy_keras", "loss_scaled", "optimizer_built",
           "optimizer_variables",
           "scale_loss", "scales_loss", "slot_of", "tf_keras", "tf_variable", "variable_name"]

#: The variable that makes ``tf.keras`` Keras 2 (set before TensorFlow is imported).
LEGACY_ENV = "TF_USE_LEGACY_KERAS"


def legacy_keras():
    """The tf_keras module when it is imported (a program uses it), else None."""
    module = sys.modules.get("tf_keras")
    if module is None and os.environ.get(LEGACY_ENV, "").lower() in ("1", "true"):
        try:
            module = importlib.import_module("tf_keras")
        except ImportError:
            return None
    return module


def tf_keras():
    """The Keras that ``tf.keras`` is: tf_keras when TensorFlow was imported under
    TF_USE_LEGACY_KERAS=1 (TensorFlow decides it then, once), else Keras 3. Horovod's Keras
    API took this one."""
    import tensorflow as tf

    if getattr(tf.keras, "__name__", "").startswith("tf_keras"):
        return legacy_keras() or keras
    return keras


def keras_of(obj):
    """The Keras module `obj` (a model, layer, optimizer or loss) is of: keras or tf_keras.

    Returns None for anything else (a function, a Keras 3 loss name)."""
    if isinstance(obj, (keras.Model, keras.layers.Layer, keras.optimizers.Optimizer,
                        keras.losses.Loss)):
        return keras
    legacy = legacy_keras()
    if legacy is not None and isinstance(obj, (legacy.layers.Layer, legacy.losses.Loss,
                                               legacy.optimizers.Optimizer,
                                               legacy.optimizers.legacy.Optimizer)):
        return legacy
    return None


def is_keras2(obj):
    """True for a tf_keras object (Keras 2)."""
    keras_module = keras_of(obj)
    return keras_module is not None and keras_module is not keras


def is_model(obj):
    """True for a Keras 3 or a tf_keras model."""
    keras_module = keras_of(obj)
    return keras_module is not None and isinstance(obj, keras_module.Model)


def is_layer(obj):
    """True for a layer (a model included) of either Keras."""
    keras_module = keras_of(obj)
    return keras_module is not None and isinstance(obj, keras_module.layers.Layer)


def optimizer_built(optimizer):
    """True once `optimizer` (any Keras) has made its variables (slots)."""
    if keras_of(optimizer) is keras:
        return bool(optimizer.built)
    if isinstance(optimizer, keras_of(optimizer).optimizers.Optimizer):
        return bool(getattr(optimizer, "_built", False))
    return bool(optimizer.weights)  # OptimizerV2's appear with its slots


def optimizer_variables(optimizer, variables):
    """The variables of `optimizer` (any Keras), its slots for `variables` made first.

    Keras 3 and tf_keras' optimizers build their slots in ``build``; Keras
    2's legacy OptimizerV2 in ``_create_all_weights`` and lists them with
    ``variables()``."""
    if keras_of(optimizer) is keras:
        if not optimizer.built:
            optimizer.build(variables)
        return list(optimizer.variables)
    legacy = keras_of(optimizer)
    if isinstance(optimizer, legacy.optimizers.Optimizer):
        optimizer.build(variables)  # returns at once once built
        return list(optimizer.variables)
    optimizer._create_all_weights(variables)  # noqa: SLF001 - OptimizerV2's slot maker
    return list(optimizer.variables())


def is_optimizer(obj):
    """True for a Keras 3 optimizer or a tf_keras one (``optimizers.Optimizer``).

    Keras 2's legacy OptimizerV2 (``tf_keras.optimizers.legacy``) is not one:
    it builds its slots lazily, inside its first ``apply_gradients``."""
    keras_module = keras_of(obj)
    return keras_module is not None and isinstance(obj, keras_module.optimizers.Optimizer)


def scales_loss(optimizer):
    """True for a LossScaleOptimizer of either Keras (mixed float16's)."""
    keras_module = keras_of(optimizer) or keras
    return isinstance(optimizer, keras_module.mixed_precision.LossScaleOptimizer)


def loss_scaled(optimizer):
    """`optimizer` wrapped in its Keras' LossScaleOptimizer, as ``Model.compile`` does."""
    return (keras_of(optimizer) or keras).mixed_precision.LossScaleOptimizer(optimizer)


def scale_loss(optimizer, loss):
    """The loss to differentiate: Keras 3's optimizer scales it (a LossScaleOptimizer's
    scale, else 1); a tf_keras one takes the loss as it is (no loss scaling)."""
    return loss if is_keras2(optimizer) else optimizer.scale_loss(loss)


def is_batch_normalization(layer):
    """True for a BatchNormalization layer of either Keras."""
    keras_module = keras_of(layer)
    return keras_module is not None and isinstance(layer, keras_module.layers.BatchNormalization)


def slot_of(variable, references):
    """(n, slot name) of an optimizer variable made for references[n], or (None, None).

    Keras 3 names a slot "<the variable's path, / as _>_<slot>"
    ("sequential_dense_kernel_momentum"); tf_keras "<slot>/<the variable's
    name>" ("m/dense/kernel"). A variable of another shape than its
    reference is not a slot of it (written whole)."""
    best = None
    if isinstance(variable, keras.Variable):
        for n, ref in enumerate(references):
            prefix = ref.path.replace("/", "_") + "_"
            if variable.name.startswith(prefix) and (best is None or len(prefix) > best[2]):
                best = (n, variable.name[len(prefix):], len(prefix))
    else:
        kind, _, owner = variable_name(variable).partition("/")
        for n, ref in enumerate(references):
            if owner == variable_name(ref):
                best = (n, kind)
    if best is None or tuple(variable.shape) != tuple(references[best[0]].shape):
        return None, None
    return best[0], best[1]


def tf_variable(variable):
    """The tf.Variable of a Keras 3 variable (its ``value``); a tf.Variable itself."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def variable_name(variable):
    """A variable's name without its ":0": Keras 3's path, or a tf.Variable's name."""
    path = getattr(variable, "path", None)
    return path if path is not None else variable.name.rsplit(":", 1)[0]
