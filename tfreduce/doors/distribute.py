"""tfreduce's all-reduce inside ``tf.distribute.MirroredStrategy``: Keras ``model.fit`` on it.

``MirroredStrategy(devices, cross_device_ops=...)`` takes the object that
reduces across its K devices. Keras 3 ``model.fit`` under the strategy ends
each step's gradient path in one ``batch_reduce`` call that carries all N
gradients, each a per-replica value over the K devices: tfreduce's K x N
input. ``CrossDeviceOps`` turns that call into one call of its
``tfreduce.Reduction``, so every Keras user gets tfreduce's algorithms
(any-K hierarchical with groups as data, packing, the ring, traffic
analysis of the built step) without leaving ``model.fit``.

It subclasses ``tf.distribute.CrossDeviceOps`` and implements the methods
TensorFlow's own implementations (``NcclAllReduce``,
``HierarchicalCopyAllReduce``, ``ReductionToOneDevice``) do. It needs the
per-replica and mirrored value classes of ``tensorflow.python.distribute``,
which have no public names; so do TF's own implementations.
"""

import dataclasses

import tensorflow as tf
from tensorflow.python.distribute import (cross_device_ops as tf_cross_device_ops,
                                          distribute_utils, values as tf_values)
# Private but long-standing: whether the graph being built is compiled by XLA (TF's own test,
# which MirroredStrategy makes too).
from tensorflow.python.ops import control_flow_util

from tfreduce.algorithms.registry import STAGES
from tfreduce.basis.collective_rules import builds
from tfreduce.choice.reduction import as_reduction
from tfreduce.doors.collectives import all_gather

__all__ = ["CrossDeviceOps"]


class CrossDeviceOps(tf.distribute.CrossDeviceOps):
    """A ``tf.distribute.CrossDeviceOps`` that reduces with a tfreduce algorithm.

    Usage, with an ordinary Keras ``compile`` / ``fit`` / ``evaluate`` under
    ``strategy.scope()``::

        strategy = tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tfreduce.CrossDeviceOps(
                "hierarchical", groups=[[0, 1], [2, 3]]))

    What each call does:

    - ``batch_reduce_implementation`` (Keras' gradients, ``extended.
      batch_reduce_to``): when every value lives on the destinations' K
      distinct devices, the N per-replica values become one K x N all-reduce
      (``average=True`` for ``ReduceOp.MEAN``), whose ``out[k][n]`` on
      device k makes the n-th ``Mirrored`` result. Values whose devices
      differ from their destinations' are reduced one by one as below.
    - ``reduce_implementation`` (``strategy.reduce``, metrics): one value as
      a K x 1 call when its devices are the destinations'; otherwise, e.g.
      reducing to the host CPU, ``tf.distribute.ReductionToOneDevice``
      does it, as TF's ``NcclAllReduce`` and ``HierarchicalCopyAllReduce``
      also fall back.
    - ``broadcast_implementation``: one copy per destination device, each
      placed there.
    - ``_gather_implementation`` (``ReplicaContext.all_gather``,
      ``strategy.gather``): values on K distinct devices are all-gathered
      with ``tfreduce.all_gather`` and this reduction's algorithm (the
      gathered axis moved to the front and back); to other destinations
      (``strategy.gather`` to the current device) the first replica's
      result is copied there. TF's own ``NcclAllReduce`` and
      ``HierarchicalCopyAllReduce`` gather on one device instead, and so
      does this one for "nccl" (TF has no NCCL all-gather op).
    - int32 values never reach it: MirroredStrategy reduces them with
      ``ReductionToOneDevice`` itself, whatever ``cross_device_ops`` is.
    - ``CommunicationOptions(bytes_per_pack=B)``, where the user passes it,
      replaces ``pack_bytes`` for that call, and its ``timeout_seconds``
      becomes the collective algorithm's ``timeout``.

    Single host only: ``MultiWorkerMirroredStrategy`` takes no cross-device
    ops (use ``ReplicatedTrainer`` with a ``Cluster`` there). XLA: a reduction
    inside a compiled step (``compile(jit_compile=True)``) raises ValueError,
    as XLA compiles each replica's step for its device alone; on GPUs, where
    Keras' default "auto" compiles, MirroredStrategy does not call
    ``cross_device_ops`` under XLA at all (it logs that it uses its own
    all-reduce): pass ``jit_compile=False`` to ``compile``, or use
    ``ReplicatedTrainer(jit_compile=True)`` (docs/keras.md#xla).

    Args:
      algorithm: a name in ``tfreduce.ALGORITHMS``; "auto" picks by devices
        at the first reduction (or, with ``topology=``, plans for them).
      reduction: a ``tfreduce.Reduction`` to use instead of ``algorithm``
        and ``**options``.
      **options: the options of ``tfreduce.Reduction`` (``groups``,
        ``communication``, ``keys``, ``timeout``, ``pack_bytes``,
        ``sparse_as_dense``, ``compression``, ``topology``).

    Attributes:
      reduction: the ``tfreduce.Reduction`` every reduction is built with.

    Raises:
      ValueError, TypeError: a bad choice (see ``tfreduce.Reduction``);
        groups that do not cover the strategy's K devices raise at the first
        reduction, naming both.
    """

    def __init__(self, algorithm="auto", *, reduction=None, **options):
        super().__init__()
        try:
            self.reduction = as_reduction(algorithm, reduction, options)
        except (TypeError, ValueError) as error:
            raise type(error)(f"CrossDeviceOps: {error}") from None
        self._one_device = tf.distribute.ReductionToOneDevice()
        # The reduction with a call's CommunicationOptions, made once each.
        self._with_options = {(): self.reduction}

    def __repr__(self):
        return f"tfreduce.CrossDeviceOps(reduction={self.reduction!r})"

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        _refuse_xla()
        if _devices_match(per_replica_value, destinations):
            return self._all_reduce_batch(reduce_op, [per_replica_value], options)[0]
        return self._one_device.reduce_implementation(
            reduce_op, per_replica_value, destinations, options)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        _refuse_xla()
        first = value_destination_pairs[0][0]
        if all(_devices_match(value, destinations) and _devices_match(value, first)
               for value, destinations in value_destination_pairs):
            return self._all_reduce_batch(
                reduce_op, [value for value, _ in value_destination_pairs], options)
        return [self.reduce_implementation(reduce_op, value, destinations, options)
                for value, destinations in value_destination_pairs]

    def broadcast_implementation(self, tensor, destinations):
        devices = tf_cross_device_ops.get_devices_from(destinations)
        copies = []
        for device in devices:
            with tf.device(device):
                copies.append(tf.identity(tensor))
        return distribute_utils.regroup(tuple(copies), wrap_class=tf_values.Mirrored)

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        rank = per_replica_value.values[0].shape.rank
        algorithm = self.reduction.algorithm
        if (not _on_distinct_devices(per_replica_value) or rank is None
                or (algorithm != "auto" and not builds(STAGES[algorithm], "all_gather"))):
            # Values that share a device, an unknown rank, or NCCL (no
            # all-gather op): gathered on one device, as TF's own ops do.
            return self._one_device._gather_implementation(  # pylint: disable=protected-access
                per_replica_value, destinations, axis, options)
        devices = list(tf_cross_device_ops.get_devices_from(per_replica_value))
        # tfreduce gathers along axis 0: the gathered axis is moved there
        # on each replica's device, and back after.
        perm = None if axis == 0 else [axis] + [a for a in range(rank) if a != axis]
        tensors = []
        for value, device in zip(per_replica_value.values, devices):
            with tf.device(device):
                tensors.append([value if perm is None else tf.transpose(value, perm)])
        # Compression and a topology choose how to all-reduce: not for a gather.
        reduction = dataclasses.replace(self._reduction_for(options), compression=None,
                                        topology=None)
        gathered = all_gather(tensors, devices, reduction=reduction)
        out = []
        for row, device in zip(gathered, devices):
            with tf.device(device):
                out.append(row[0] if perm is None else tf.transpose(
                    row[0], [perm.index(a) for a in range(rank)]))
        if _devices_match(per_replica_value, destinations):
            return distribute_utils.regroup(tuple(out), wrap_class=tf_values.Mirrored)
        # Elsewhere (strategy.gather to the current device): the first
        # replica's result, copied there.
        return self.broadcast_implementation(out[0], destinations)

    def _reduction_for(self, options):
        """The reduction, with the call's bytes_per_pack and timeout when it sets them."""
        changes = {}
        if options is not None and options.bytes_per_pack:
            changes["pack_bytes"] = options.bytes_per_pack
        if (options is not None and options.timeout_seconds
                and self.reduction.algorithm == "collective"):
            changes["timeout"] = options.timeout_seconds
        key = tuple(sorted(changes.items()))
        if key not in self._with_options:
            self._with_options[key] = dataclasses.replace(self.reduction, **changes)
        return self._with_options[key]

    def _all_reduce_batch(self, reduce_op, values, options):
        """N per-replica values over the same K devices -> N Mirrored values, one call."""
        devices = list(tf_cross_device_ops.get_devices_from(values[0]))
        num_devices = len(devices)
        all_grads = [[value.values[k] for value in values] for k in range(num_devices)]
        out = self._reduction_for(options)(all_grads, devices,
                                           average=reduce_op == tf.distribute.ReduceOp.MEAN)
        return [distribute_utils.regroup(tuple(out[k][n] for k in range(num_devices)),
                                         wrap_class=tf_values.Mirrored)
                for n in range(len(values))]


def _on_distinct_devices(value):
    """True if a per-replica value lives on K distinct devices."""
    return _devices_match(value, value)


def _refuse_xla():
    """Raises ValueError when the reduction would be built inside an XLA-compiled step."""
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(
            "tfreduce.CrossDeviceOps inside an XLA-compiled step (compile(jit_compile=True) "
            "under MirroredStrategy): XLA compiles each replica's step for its own device, "
            "which cannot reach the other replicas' values, and on GPUs MirroredStrategy would "
            "put its own all-reduce in place of this one. Pass jit_compile=False to compile, or "
            "train with tfreduce.ReplicatedTrainer(jit_compile=True): each tower's forward and "
            "backward pass compiled, the reduction outside (docs/keras.md#xla)")


def _devices_match(value, destinations):
    """True if a per-replica value lives on K distinct devices, the destinations' in order.

    Values that share a device (eager ``experimental_distribute_values_from_
    function`` leaves them all on the host) are no all-reduce over K devices.
    """
    if not isinstance(value, tf_values.DistributedValues):
        return False
    devices = tf_cross_device_ops.get_devices_from(value)
    return (len(set(devices)) == len(devices)
            and devices == tf_cross_device_ops.get_devices_from(destinations))
