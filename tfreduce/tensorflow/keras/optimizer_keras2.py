"""DistributedOptimizer's Keras 2 (tf_keras) classes: gradients all-reduced where Keras 2 computes them.

Both tf_keras optimizers train through ``minimize``: the current
``optimizers.Optimizer`` calls ``compute_gradients`` and then
``apply_gradients``, the legacy ``OptimizerV2``
(``optimizers.legacy``) ``_compute_gradients`` and then
``apply_gradients``. As in Horovod's Keras 2 optimizer, the subclass made
here all-reduces in the computing half, so ``fit``, ``train_on_batch`` and
custom loops that call ``minimize`` or ``_compute_gradients`` all get
reduced gradients, and ``apply_gradients`` applies what it is given (a
custom loop that differentiates with its own tape wraps the tape in
``DistributedGradientTape``).

With ``backward_passes_per_step`` M > 1 each process sums its gradients
over M calls in ``LocalAggregation`` (Horovod's ``_agg_helper``, whose
``counter`` its tests read): every Mth call all-reduces the sums and
``apply_gradients`` applies them; the other calls apply nothing and only
advance ``iterations``, which counts calls here, as in Horovod's Keras 2
optimizer. The sums are zeroed, not decreased, after each update, so an
infinite gradient spoils one update only.

Source: Horovod's ``horovod/_keras`` DistributedOptimizer and its
``LocalGradientAggregationHelper``.
"""

import tensorflow as tf

__all__ = ["LocalAggregation", "distributed_class"]


class LocalAggregation:
    """This process's sums of its gradients over M backward passes (Horovod's ``_agg_helper``).

    Args:
      passes: int M >= 2, the backward passes per update.
      average: bool, divide the sums by M before the all-reduce.

    Attributes:
      counter: tf.Variable int32, the calls since the last all-reduce, mod
        M (0 right after one); made at the first call.
    """

    def __init__(self, passes, average):
        self.passes, self.average = passes, average
        self.counter = None
        self._sums = None

    def _build(self, grads, variables):
        with tf.init_scope():
            self.counter = tf.Variable(0, dtype=tf.int32, trainable=False,
                                       name="tfreduce_aggregation_counter")
            self._sums = [None if g is None else tf.Variable(
                tf.zeros(v.shape, g.dtype), trainable=False, name="tfreduce_aggregation_sum")
                for g, v in zip(grads, variables)]

    def reduced(self):
        """A bool tf.Tensor: the last call all-reduced (apply_gradients applies then)."""
        if self.counter is None:
            return tf.constant(True)
        return tf.equal(self.counter, 0)

    def compute_gradients(self, grads, variables, reduce):
        """Adds `grads` to the sums; every Mth call, returns ``reduce`` of the sums and zeroes them.

        Args:
          grads: list of N tf.Tensor, tf.IndexedSlices or None, this call's.
          variables: list of N variables.
          reduce: function of a list of N gradients to the list reduced over
            the processes.

        Returns:
          list of N dense tf.Tensor (None where grads has None): the reduced
          sums on an Mth call, the sums so far on the others.
        """
        if self.counter is None:
            self._build(grads, variables)
        added = [total.assign_add(tf.convert_to_tensor(g))
                 for total, g in zip(self._sums, grads) if total is not None]
        with tf.control_dependencies(added):
            count = self.counter.assign((self.counter + 1) % self.passes)
        present = [n for n, total in enumerate(self._sums) if total is not None]

        def all_reduced():
            divisor = self.passes if self.average else 1
            sums = [None if total is None else tf.identity(total) / divisor
                    for total in self._sums]
            out = reduce(sums)
            with tf.control_dependencies([out[n] for n in present]):
                zeroed = [self._sums[n].assign(tf.zeros_like(self._sums[n])) for n in present]
            with tf.control_dependencies(zeroed):
                return [tf.identity(out[n]) for n in present]

        def summed():
            return [tf.identity(self._sums[n]) for n in present]

        # Every process takes the same branch: the counters move in step.
        values = tf.cond(tf.equal(count, 0), all_reduced, summed) if present else []
        out = [None] * len(grads)
        for n, value in zip(present, values if isinstance(values, (list, tuple)) else [values]):
            out[n] = value
        return out


class _Distributed:
    """The methods a Keras 2 distributed optimizer class puts before its base's (see
    distributed_class); the reduction's settings are class attributes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._tfreduce_local = set()  # ids of the variables registered as local
        passes = self._tfreduce_passes_per_step
        self._agg_helper = None if passes == 1 else LocalAggregation(
            passes, self._tfreduce_average_aggregated)

    def register_local_var(self, var):
        """Horovod's: the gradient of `var` stays on this process (divided by the
        processes when scale_local_gradients)."""
        self._tfreduce_local.add(id(var))

    def _tfreduce_reduce(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        grads = [g for g, _ in grads_and_vars]
        variables = [v for _, v in grads_and_vars]
        local = [id(v) in self._tfreduce_local for v in variables]

        def reduce_partly(values):
            return self._tfreduce_reduction.reduce_partly(values, local,
                                                          self._tfreduce_scale_local)

        if self._agg_helper is None:
            grads = reduce_partly(grads)
        else:
            grads = self._agg_helper.compute_gradients(grads, variables, reduce_partly)
        return list(zip(grads, variables))

    @tf.autograph.experimental.do_not_convert
    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """The base's gradients of `loss`, all-reduced: [(gradient, variable)]."""
        base = super()
        if hasattr(base, "_compute_gradients"):  # OptimizerV2
            pairs = base._compute_gradients(loss, var_list, grad_loss=grad_loss, tape=tape)
        elif grad_loss is not None:
            raise ValueError(f"{type(self).__name__}._compute_gradients: grad_loss is the "
                             "legacy OptimizerV2's argument; this optimizer takes none")
        else:
            pairs = base.compute_gradients(loss, var_list, tape)
        return self._tfreduce_reduce(pairs)

    def compute_gradients(self, loss, var_list, tape=None):
        """As _compute_gradients (the current optimizers' name)."""
        return self._compute_gradients(loss, var_list, tape=tape)

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        """The base's update, on every Mth call only with backward_passes_per_step M > 1."""
        if self._agg_helper is None:
            return super().apply_gradients(grads_and_vars, *args, **kwargs)
        grads_and_vars = list(grads_and_vars)  # read in both branches
        variables = [v for _, v in grads_and_vars]
        # The slots exist before the branch that may update them.
        if hasattr(super(), "_create_all_weights"):
            self._create_all_weights(variables)  # OptimizerV2's slot maker
        else:
            self.build(variables)
        base = super()

        def update():
            base.apply_gradients(grads_and_vars, *args, **kwargs)
            return tf.constant(True)

        def skip():
            self.iterations.assign_add(1)
            return tf.constant(False)

        tf.cond(self._agg_helper.reduced(), update, skip)
        return self.iterations


def distributed_class(base, settings):
    """The subclass of tf_keras optimizer class `base` whose gradients are all-reduced.

    Args:
      base: a tf_keras ``optimizers.Optimizer`` or ``optimizers.legacy.Optimizer``
        subclass.
      settings: dict of the class attributes the instances read:
        ``_tfreduce_reduction`` (a GradientReduction),
        ``_tfreduce_passes_per_step``, ``_tfreduce_average_aggregated``,
        ``_tfreduce_scale_local``. Kept on the class, so ``from_config``
        gives a distributed optimizer too.

    Returns:
      the class, named as `base`, of the module of `base`.
    """
    return type(base.__name__, (_Distributed, base), {"__module__": base.__module__,
                                                       **settings})
