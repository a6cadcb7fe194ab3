"""DistributedGradientTape: a tape whose gradients are all-reduced over the processes.

Source: Horovod's DistributedGradientTape (horovod.tensorflow), for custom
training loops.
"""

import dataclasses

import tensorflow as tf

from tfreduce.basis import kerases
from tfreduce.buffers.compression import Compression, as_compressor
from tfreduce.tensorflow.ops import grouped_allreduce
from tfreduce.tensorflow.process import cluster
from tfreduce.tensorflow.reduce_ops import Average, check_op, check_process_set, global_process_set
from tfreduce.tensorflow.wire import scale

__all__ = ["DistributedGradientTape", "GradientReduction", "PartialDistributedGradientTape",
           "local_layers_of"]


@dataclasses.dataclass(frozen=True)
class GradientReduction:
    """How DistributedGradientTape and DistributedOptimizer reduce gradients, checked once.

    Attributes:
      op: Average or Sum.
      compression: a tfreduce.Compressor.
      sparse_as_dense: bool, IndexedSlices are made dense first.
      gradient_predivide_factor: float f: with op=Average, each gradient is
        divided by f before the sum and multiplied by f after it (Horovod's
        split of the averaging); 1.0 does neither.
    """

    op: str
    compression: object
    sparse_as_dense: bool
    gradient_predivide_factor: float

    @classmethod
    def from_horovod(cls, where, compression, sparse_as_dense, op, gradient_predivide_factor,
                     num_groups, groups, process_set):
        """From Horovod's keyword arguments of `where` (the wrapper, for messages).

        Raises:
          ValueError: an unsupported op, explicit fusion groups (tfreduce packs
            by size), a process set, gradient_predivide_factor != 1 with
            op=Sum; a bad compression.
        """
        if num_groups or groups is not None:
            raise ValueError(f"{where}: num_groups={num_groups!r}, groups={groups!r}: explicit "
                             "fusion groups are not supported; tfreduce packs the gradients "
                             "into 4 MiB buffers")
        check_process_set(process_set, where)
        op = check_op(op, where=where)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError(f"{where}: gradient_predivide_factor="
                             f"{gradient_predivide_factor!r} needs op=Average")
        return cls(op, as_compressor(compression), bool(sparse_as_dense),
                   gradient_predivide_factor)

    def reduce(self, grads):
        """All-reduces a list of gradients (None kept) in one grouped all-reduce.

        Args:
          grads: list of N tf.Tensor, tf.IndexedSlices or None.

        Returns:
          list of N, the reduced gradients (None where the gradient is None).
        """
        present = [n for n, g in enumerate(grads) if g is not None]
        values = [tf.convert_to_tensor(grads[n]) if self.sparse_as_dense else grads[n]
                  for n in present]
        factor = self.gradient_predivide_factor
        scale = {} if factor == 1.0 else {"prescale_factor": 1.0 / factor,
                                          "postscale_factor": factor}
        reduced = grouped_allreduce(values, compression=self.compression, op=self.op, **scale)
        out = list(grads)
        for n, g in zip(present, reduced):
            out[n] = g
        return out

    def reduce_partly(self, grads, local, scale_local):
        """``reduce`` of the gradients not marked local; the local ones stay (Horovod's partial).

        Args:
          grads: list of N tf.Tensor, tf.IndexedSlices or None.
          local: list of N bools, True for a gradient that stays on this process.
          scale_local: bool, divide the local gradients by the number of processes.

        Returns:
          list of N gradients.
        """
        reduced = iter(self.reduce([g for g, mine in zip(grads, local) if not mine]))
        factor = 1.0 / cluster().num_workers if scale_local else 1.0
        return [next(reduced) if not mine else None if g is None else scale(g, factor)
                for g, mine in zip(grads, local)]


class _DistributedGradientTape:
    """The wrapped tape, whose ``gradient`` all-reduces; every other attribute is the tape's."""

    def __init__(self, tape, reduction, scale_local_gradients):
        self._tape = tape
        self._reduction = reduction
        self._scale_local = scale_local_gradients
        self._local = set()  # ids of the sources whose gradients stay on this process

    def register_local_source(self, source):
        """Keeps the gradient of `source` (a variable) on this process: it is not all-reduced.

        As in Horovod, it is divided by the number of processes when the tape
        was made with scale_local_gradients=True (the default), so that the
        local part of a model learns at the rate of the reduced part.
        """
        self._local.add(id(source))

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=None):
        """The tape's gradients of target, all-reduced over every process.

        Args: as tf.GradientTape.gradient; sources a variable, a list of
          them, or a nested structure.

        Returns:
          the reduced gradients, in the structure of sources (None where the
          tape gives None).
        """
        kwargs = {} if unconnected_gradients is None else {
            "unconnected_gradients": unconnected_gradients}
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(grads)
        local = [id(s) in self._local for s in tf.nest.flatten(sources)]
        out = self._reduction.reduce_partly(flat, local, self._scale_local)
        return tf.nest.pack_sequence_as(grads, out)

    @tf.autograph.experimental.do_not_convert
    def get_local_and_global_gradients(self, target, sources, output_gradients=None):
        """Horovod's split of ``gradient``'s result: (local pairs, reduced pairs).

        Returns:
          (list of (source, gradient) of the registered local sources, list
          of (source, gradient) of the others), in the order of sources.
        """
        grads = self.gradient(target, sources, output_gradients)
        pairs = list(zip(sources, grads))
        return ([p for p in pairs if id(p[0]) in self._local],
                [p for p in pairs if id(p[0]) not in self._local])


@tf.autograph.experimental.do_not_convert
def DistributedGradientTape(gradtape, device_dense="", device_sparse="",  # noqa: N802
                            compression=Compression.none, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=global_process_set, scale_local_gradients=True):
    """Wraps a tf.GradientTape: its ``gradient()`` all-reduces over every process.

    Use it after recording, as in Horovod::

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)

    The gradients of one call are reduced together (packed; the mean over
    processes with op=Average). Every process must call ``gradient`` the same
    number of times, with the same variables.

    Args:
      gradtape: a tf.GradientTape.
      device_dense: Horovod's device hint (unused: the process's device is
        used).
      device_sparse: as device_dense.
      compression: tfreduce.Compression.none, .fp16 or .bf16.
      sparse_as_dense: bool, densify IndexedSlices gradients first.
      op: Average (default) or Sum.
      gradient_predivide_factor: float, see ``GradientReduction``.
      num_groups: Horovod's number of fusion groups; tfreduce packs by size:
        must be 0.
      groups: Horovod's fusion groups: must be None.
      process_set: global_process_set (the only one).
      scale_local_gradients: bool, divide the gradients of the sources
        registered with ``register_local_source`` by the number of processes.

    Returns:
      a tape object with the tape's methods, ``gradient`` all-reducing.

    Raises:
      TypeError: gradtape is not a tf.GradientTape.
      ValueError: see ``GradientReduction.from_horovod``.
    """
    del device_dense, device_sparse
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape needs a tf.GradientTape, got "
                        f"{type(gradtape).__name__}")
    return _DistributedGradientTape(gradtape, GradientReduction.from_horovod(
        "DistributedGradientTape", compression, sparse_as_dense, op, gradient_predivide_factor,
        num_groups, groups, process_set), bool(scale_local_gradients))


@tf.autograph.experimental.do_not_convert
def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",  # noqa: N802
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """A DistributedGradientTape whose `local_layers` keep their gradients on each process.

    Horovod's model parallelism within data parallelism: the trainable
    variables of each layer in `local_layers` are registered as local
    sources (``register_local_source``); the others are all-reduced.

    Args:
      local_layers: a keras Layer or a list of them, or None.
      the others: as DistributedGradientTape.

    Raises:
      As DistributedGradientTape; TypeError: a local layer that is not a Keras layer.
    """
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for layer in local_layers_of(local_layers, "PartialDistributedGradientTape"):
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape


def local_layers_of(local_layers, where):
    """`local_layers` as a list of Keras layers.

    Raises:
      TypeError: an item that is not a layer of Keras 3 or tf_keras (named by position).
    """
    if local_layers is None:
        return []
    layers = list(local_layers) if isinstance(local_layers, (list, tuple)) else [local_layers]
    for n, layer in enumerate(layers):
        if not kerases.is_layer(layer):
            raise TypeError(f"{where}: local_layers[{n}] must be a keras.layers.Layer, got "
                            f"{type(layer).__name__}")
    return layers
