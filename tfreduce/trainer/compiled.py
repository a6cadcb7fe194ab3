"""XLA in the trainer: each tower's forward and backward pass one compiled cluster on its device.

``ReplicatedTrainer(jit_compile=True)`` compiles, on each tower k, the
forward pass, the loss (with Keras' loss scaling) and the gradients into
one ``tf.function(jit_compile=True)`` called under ``devices[k]``: one XLA
cluster per tower, reading and writing only that tower's variables. The
split of the batch, the all-reduce, compression, the non-finite guard,
the update and the BatchNorm sync stay outside, as built without XLA, so
the towers apply the same update and stay bit-identical. This is
tf_cnn_benchmarks' ``--xla_compile`` (``maybe_compile`` in
benchmark_cnn.py: the towers' forward and gradients compiled, the
all-reduce and the update not); a whole step compiled at once cannot
span the towers (XLA reaches one device's resources only).

``jit_compile="auto"`` compiles when every tower is a GPU (Keras' own rule
for one device turns XLA off on CPU-only machines). Before the first
compile, tower 0's pass is lowered to HLO once at the shapes of the trace
(an unknown dimension taken as 1): an op XLA cannot compile (no XLA
kernel, a shape known only at run time) raises ValueError naming it with
``True``, or with ``"auto"`` warns once and runs every tower uncompiled.
Each tower compiles once per shape it sees (a last, smaller batch is a
second compile).
"""

import re
import warnings

import tensorflow as tf

from tfreduce.basis import kerases
from tfreduce.basis.devices import is_gpu
from tfreduce.trainer.losses import regularization, tower_loss_sum

__all__ = ["TowerPasses", "resolve_jit_compile", "uncompilable"]


def resolve_jit_compile(jit_compile, devices):
    """What the towers do: False (uncompiled), True (compiled, or raise), "auto" (compiled,
    or uncompiled with a warning); "auto" on towers that are not all GPUs is False.

    Args:
      jit_compile: False, True or "auto".
      devices: list of K canonical device names.

    Raises:
      TypeError: jit_compile is none of them.
    """
    auto = isinstance(jit_compile, str) and jit_compile == "auto"
    if not (jit_compile is True or jit_compile is False or auto):
        raise TypeError(f'jit_compile must be True, False or "auto", got '
                        f"{type(jit_compile).__name__} {jit_compile!r}")
    if auto and not all(is_gpu(d) for d in devices):
        return False
    return jit_compile


def uncompilable(function, args):
    """Why XLA cannot compile `function` at the shapes of `args`: None when it can.

    Args:
      function: a tf.function(jit_compile=True).
      args: its positional arguments, a structure of tf.Tensors (symbolic
        ones too: unknown dimensions are taken as 1).

    Returns:
      None, or str: the op XLA has no kernel for ("PyFunc": XLA names the
      first it meets), else the first line of XLA's own message (e.g. a
      shape that must be known when compiling).
    """
    specs = tf.nest.map_structure(
        lambda t: tf.TensorSpec([1 if d is None else d for d in t.shape], t.dtype), args)
    try:
        function.experimental_get_compiler_ir(*specs)(stage="hlo")
    except (ValueError, tf.errors.InvalidArgumentError) as error:
        text = str(error)
        if "tf2xla conversion failed" not in text and "unsupported operations" not in text:
            return None  # not XLA's: the pass at these stand-in shapes; the real trace decides
        ops = re.findall(r"(\w+) \(No registered '", text)
        if ops:
            return ", ".join(dict.fromkeys(ops))
        return text.split("\n")[0].removeprefix("Failed getting HLO text: ").strip("'")
    return None


def _pass(model, optimizer, variables, loss_fn, combine):
    """fn(x, y, *scalars) -> (N gradients, loss sum, y_pred, reg) of one tower."""

    def run(x, y, *scalars):
        with tf.GradientTape() as tape:
            loss_sum, y_pred = tower_loss_sum(loss_fn, model, x, y, training=True)
            reg = regularization(model, loss_sum.dtype)
            # Keras' loss scaling (LossScaleOptimizer, loss_scale_factor);
            # apply_gradients divides it out again.
            loss = kerases.scale_loss(optimizer, combine(loss_sum, reg, *scalars))
        return list(tape.gradient(loss, variables)), loss_sum, y_pred, reg

    return run


class TowerPasses:
    """The K towers' forward and backward passes, each compiled with XLA on its device or not.

    Args:
      towers: Towers, built.
      loss_fn: fn(y_true, y_pred) -> per-example losses.
      combine: fn(loss_sum, reg, *scalars) -> the scalar loss whose
        gradient a tower takes (before Keras' loss scaling); scalars are
        what the caller passes after x and y.
      jit_compile: as ``resolve_jit_compile`` returns.
    """

    def __init__(self, towers, loss_fn, combine, jit_compile):
        self.jit_compile = jit_compile
        self._runs = [_pass(m, o, v, loss_fn, combine)
                      for m, o, v in zip(towers.models, towers.optimizers, towers.trainable)]
        # One function per tower: each reads its own tower's variables only.
        self._compiled = ([tf.function(run, jit_compile=True, autograph=False)
                           for run in self._runs] if jit_compile else None)
        self._probed = not jit_compile

    @property
    def compiled(self):
        """bool: the towers run compiled (False after "auto" fell back)."""
        return self._compiled is not None

    def __call__(self, k, x, y, *scalars):
        """Tower k's pass, under the caller's tf.device(devices[k]).

        Args:
          k: int, the tower.
          x, y: tower k's inputs and targets (structures of tensors).
          scalars: the tensors `combine` takes after the loss sum and reg.

        Returns:
          (list of N gradients, None where a variable has none; loss sum
          [] in the loss's dtype; y_pred, the model's outputs; reg, the
          regularisation term []).

        Raises:
          ValueError: jit_compile=True and XLA cannot compile the pass
            (naming the ops, and what to do).
        """
        if not self._probed:
            why = uncompilable(self._compiled[0], (x, y) + scalars)
            if why is not None:
                self._give_up(why)  # raises (so a next step raises again), or falls back
            self._probed = True
        if self._compiled is None:
            return self._runs[k](x, y, *scalars)
        return self._compiled[k](x, y, *scalars)

    def _give_up(self, why):
        text = f"XLA cannot compile the towers' forward and backward pass: {why}. "
        if self.jit_compile is True:
            raise ValueError(text + 'Pass jit_compile=False (or "auto": uncompiled, with a '
                             "warning), or replace the op with one XLA compiles")
        warnings.warn(text + "The towers run uncompiled (jit_compile=\"auto\").", stacklevel=4)
        self._compiled = None
