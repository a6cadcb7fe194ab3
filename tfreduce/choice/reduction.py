"""How to communicate, as one value: ``tfreduce.Reduction``.

A Reduction holds the whole choice (the algorithm, the options it takes,
the pack size, sparse_as_dense, the compression and, for "auto", the
topology to plan for) and checks it once, when it is made. Every door that
all-reduces builds one from its keywords or takes one: ``allreduce_grads``
and the per-algorithm functions, ``ReplicatedTrainer``, ``CrossDeviceOps``,
``allreduce_grads_multiworker`` and ``plan_allreduce``; so the options are
documented and checked here only.

Called on K x N gradients it builds the all-reduce (the K x N contract is in
``tfreduce.doors.allreduce``'s module docstring): the frame validates and packs the
input once, runs the algorithm's stage (followed, across workers, by the
cross-worker stage) and unpacks once. "auto" becomes an algorithm when the
devices are known: the registry's rule, or with a topology the cost model's
plan for the gradients' shapes, made on first use and kept by the planner
(``planner.planned``) for later calls with the same shapes. The stage of the
other collectives is chosen where they are built
(``collective_build.collective_stage``).
"""

import dataclasses
from collections.abc import Sequence

import tensorflow as tf

from tfreduce.algorithms.frame import run_stages
from tfreduce.algorithms.registry import choose_algorithm, make_stage, stage_options
from tfreduce.algorithms.tree import TreeStage
from tfreduce.basis.choices import ALGORITHMS, DEFAULT_PACK_BYTES
from tfreduce.basis.contract import check_flag, dense_shape, validate_grads, values_of
from tfreduce.basis.devices import normalize_devices
from tfreduce.basis.topology import Topology, check_topology
from tfreduce.blocks.collective import CollectiveKeys
from tfreduce.buffers.compression import Compression, Compressor, as_compressor
from tfreduce.buffers.packing import check_pack_bytes
from tfreduce.workers.cluster import Cluster
from tfreduce.workers.crossworker import (CROSS_WORKER_PACK_BYTES, CrossWorkerStage,
                                          cross_worker_options)
from tfreduce.workers.localcluster import LocalCluster

__all__ = ["Reduction", "as_reduction", "FRAME_OPTIONS"]

#: The options every algorithm takes: the frame's.
FRAME_OPTIONS = ("pack_bytes", "sparse_as_dense", "compression", "deterministic")
#: Those a plan (topology=) takes: a plan refuses deterministic.
PLANNED_OPTIONS = FRAME_OPTIONS[:3]


@dataclasses.dataclass(frozen=True, repr=False)
class Reduction:
    """How to all-reduce: the algorithm, its options, packing, compression, topology.

    A frozen value, checked once when it is made; pass it to any door (the
    trainer's ``reduction=``, ``CrossDeviceOps(reduction=...)``,
    ``allreduce_grads(..., reduction=...)``) or call it on K x N gradients.
    The keyword forms (``allreduce_grads(grads, algorithm="ring",
    pack_bytes=None)``) build one of these.

    Example::

        reduction = tfreduce.Reduction("hierarchical", groups=[[0, 1], [2, 3]],
                                       compression="fp16")
        out = reduction(all_grads, devices, average=True)  # K x N, out[k][n] on devices[k]

    Args:
      algorithm: str, a name in ``tfreduce.ALGORITHMS``: "flat" (each
        gradient summed on one root device and copied back), "hierarchical"
        (summed inside groups, then across the group roots; the DGX-1
        scheme), "ring" (reduce-scatter then all-gather around a ring),
        "nccl" (GPUs only), "collective" (TF's collective ops), or "auto":
        NCCL when every device is a GPU, else flat; with ``topology`` the
        candidate the cost model predicts fastest there.
      groups: hierarchical only: list of lists of device indices that
        covers 0..K-1 exactly once, e.g. ``[[0, 1, 2, 3], [4, 5, 6, 7]]``;
        None: two halves (``tfreduce.default_groups``).
      communication: collective only: "auto", "ring" or "nccl", TF's hint
        for its collective ops.
      keys: collective only: a ``tfreduce.CollectiveKeys`` shared by every
        collective reduction of a program; None draws the call's keys from a
        hash of its graph, scope, devices and shapes.
      timeout: collective only: float seconds > 0 a collective waits for its
        peers before failing; None waits forever (TF's 0 is refused).
      pack_bytes: int bytes: gradients smaller than this, of one dtype, are
        fused into buffers of about this size before reducing; None or 0
        packs nothing; "auto": 64 KiB in one process
        (``DEFAULT_PACK_BYTES``), 4 MiB across workers, the planned size
        with a topology.
      sparse_as_dense: bool, reduce ``tf.IndexedSlices`` as dense tensors
        instead of gathering their rows.
      compression: a ``tfreduce.Compressor`` (``Compression.none``,
        ``.fp16``, ``.bf16``) or its alias None, "none", "fp16", "bf16":
        float32 and float64 gradients cross devices in 16 bits; NCCL has no
        bfloat16.
      topology: "auto" only: a ``tfreduce.Topology``, a preset name
        ("dgx1-v100", see ``tfreduce.basis.topology.PRESETS``) or "host" (this
        machine, probed): the algorithm, groups and pack size (unless
        ``pack_bytes`` is given) are the fastest that ``tfreduce.predict``
        finds for the gradients' shapes there (``plan``).
      deterministic: bool, every element summed in one fixed tree over the
        towers (``tfreduce.algorithms.tree``), from copies and two-input
        ``tf.add`` ops: the same bits for every algorithm, pack size and
        order of the buffers, and with ``ReplicatedTrainer(...,
        deterministic=True)`` for any number of towers (docs/determinism.md).
        Across workers the workers' sums are all-gathered and summed in the
        tree in rank order. Not with "nccl", compression or a topology.

    Raises:
      ValueError: an unknown algorithm; a topology with a named algorithm,
        or an unknown preset; a bad option value (groups that are no
        partition, an unknown communication, a timeout <= 0, a negative
        pack_bytes, an unknown compression).
      TypeError: an option the algorithm does not take (with a topology:
        any but the frame's); a value of the wrong type.
    """

    algorithm: str = "auto"
    _: dataclasses.KW_ONLY
    groups: Sequence[Sequence[int]] | None = None
    communication: str = "auto"
    keys: CollectiveKeys | None = None
    timeout: float | None = None
    pack_bytes: int | str | None = "auto"
    sparse_as_dense: bool = False
    compression: Compressor | str | None = None
    topology: Topology | str | None = None
    deterministic: bool = False
    # The named algorithm's stage, made (and so its options checked) once.
    _stage: object = dataclasses.field(default=None, init=False, compare=False)

    def __post_init__(self):
        # The one check of the communication choice.
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown all-reduce algorithm {self.algorithm!r}; choose one of "
                             f"{ALGORITHMS}")
        given = [name for name, default in _defaults().items()
                 if name not in FRAME_OPTIONS + ("topology",)
                 and _given(getattr(self, name), default)]
        if self.topology is not None:
            if self.algorithm != "auto":
                raise ValueError(f"topology= chooses the algorithm (algorithm='auto'), but "
                                 f"algorithm={self.algorithm!r} was named: pass one of them")
            if given:
                raise TypeError(f"planning takes only the frame's options "
                                f"{list(PLANNED_OPTIONS)}, got {given}: the plan picks the algorithm and its groups")
            check_topology(self.topology)
        takes = stage_options(self.algorithm)
        unknown = [name for name in given if name not in takes]
        if unknown:
            hint = ("" if self.algorithm != "auto" else
                    ": 'auto' picks the algorithm from the devices; name the algorithm to "
                    "give its own options")
            raise TypeError(f"algorithm {self.algorithm!r} takes no option {unknown}; it takes "
                            f"{sorted(set(takes) | set(FRAME_OPTIONS))}{hint}")
        if self.pack_bytes != "auto":
            check_pack_bytes(self.pack_bytes)
        check_flag(self.sparse_as_dense, "sparse_as_dense")
        object.__setattr__(self, "compression", as_compressor(self.compression))
        check_flag(self.deterministic, "deterministic")
        if self.deterministic:
            self._check_deterministic()
        if self.algorithm != "auto":
            # The stage's constructor checks its options' values.
            stage = make_stage(self.algorithm, {name: getattr(self, name) for name in takes})
            object.__setattr__(self, "_stage", stage)
        if self.groups is not None:
            object.__setattr__(self, "groups", tuple(tuple(g) for g in self.groups))

    def _check_deterministic(self):
        if self.algorithm == "nccl":
            raise ValueError("deterministic=True sums in a fixed tree of tf.add ops; NCCL's "
                             "all-reduce is one op that sums in its own order: use algorithm= "
                             "'flat', 'hierarchical', 'ring' or 'collective'")
        if self.compression.compresses:
            raise ValueError(f"deterministic=True with compression={self.compression.name!r}: "
                             f"each tower's partial sum would be rounded at a level of the tree "
                             f"that depends on the number of towers; pass compression=None")
        if self.topology is not None:
            raise ValueError(f"deterministic=True with topology={self.topology!r}: a plan "
                             f"picks the algorithm by its predicted time; name the algorithm "
                             f"(every one gives the same bits)")

    def __repr__(self):
        return f"tfreduce.Reduction({self._arguments(repr)})"

    @property
    def stage(self):
        """The named algorithm's ``stage.Stage``, unbound, made once; None for "auto"."""
        return self._stage

    def describe(self):
        """The choice as text that is the same in every process that makes it.

        Objects without a value-like text (keys, a Topology) are named by type.
        """
        def text(value):
            plain = (bool, int, float, str, list, tuple, type(None))
            return repr(value) if isinstance(value, plain) else type(value).__name__
        return self._arguments(text)

    def _arguments(self, text):
        parts = [repr(self.algorithm)]
        for name, default in _defaults().items():
            value = getattr(self, name)
            if name != "compression" and _given(value, default):
                if name == "groups":
                    value = [list(g) for g in value]
                parts.append(f"{name}={text(value)}")
        if self.compression.compresses:
            parts.append(f"compression={self.compression.name!r}")
        return ", ".join(parts)

    @tf.autograph.experimental.do_not_convert
    def __call__(self, all_grads, devices=None, average=False, *, cluster=None):
        """All-reduces K x N gradients: ``out[k][n]`` is the sum (or mean) over k, on devices[k].

        Args:
          all_grads: list of K lists of N gradients (``tf.Tensor``,
            ``tf.IndexedSlices`` or None); ``all_grads[k][n]`` from tower k.
          devices: list of K device strings, or None for the tensors' devices.
          average: bool, the mean over all towers instead of the sum.
          cluster: None (this process), or the started ``tfreduce.Cluster``
            this worker belongs to: every worker calls with its own K
            towers, the sum is over every tower of every worker, and the
            cross-worker hop uses the cluster's keys and timeout.

        Returns:
          list[list[tf.Tensor]], K x N; ``out[k][n]`` is placed on
          ``devices[k]`` (in a cluster named in full, with the worker's job
          and task), with the shape and dtype of ``all_grads[k][n]``
          (IndexedSlices stay IndexedSlices); None where every tower's
          gradient is None.

        Raises:
          TypeError, ValueError: bad gradients or devices (naming the tower,
            the variable and the values), ``average`` not a bool, devices
            this reduction cannot use (NCCL on CPUs, groups that do not
            cover K), a topology across workers.
        """
        check_flag(average, "average")
        if cluster is not None and not isinstance(cluster, (Cluster, LocalCluster)):
            raise TypeError(f"cluster must be a tfreduce.Cluster or None (this process), got "
                            f"{type(cluster).__name__} {cluster!r}")
        grads = validate_grads(all_grads, devices)
        later = []
        if cluster is not None and not cluster.is_local:
            # Full names keep the ops on this worker; the cross-worker hop
            # follows the local stage.
            grads.devices = cluster.devices(grads.devices)
            options, keys = cross_worker_options(cluster, "auto", None, None)
            later.append(CrossWorkerStage(cluster, options, keys, self.compression,
                                          self.deterministic))
        return self.reduce(grads, average, later)

    def reduce(self, grads, average, later=()):
        """Builds the reduction of gradients validated by the caller (a lower level than a call).

        The doors call it: a call of the value, and the multi-worker
        reduction with a cross-worker stage of its own options.

        Args:
          grads: contract.Gradients, the K x N input, validated once.
          average: bool, checked by the caller.
          later: list of stage.Stage to run after this reduction's own
            stage: the cross-worker stage of a multi-worker reduction, which
            then does the compression (of the local sums) itself.

        Returns:
          list of K lists of N, ``out[k][n]`` on ``grads.devices[k]``.
        """
        if later and self.topology is not None:
            raise ValueError(self._across_workers_message())
        stage, pack_bytes = self._local_stage(grads, average)
        if pack_bytes == "auto":
            pack_bytes = CROSS_WORKER_PACK_BYTES if later else DEFAULT_PACK_BYTES
        # Across workers the cross-worker stage compresses the local sums
        # itself: only the network hop crosses in 16 bits.
        return run_stages(grads, [stage, *later], average,
                          scope="allreduce_multiworker" if later else None,
                          pack_bytes=pack_bytes, sparse_as_dense=self.sparse_as_dense,
                          compression=Compression.none if later else self.compression)

    def check_devices(self, devices, cluster=None):
        """Checks, before anything is built, that this reduction can run on these devices.

        Args:
          devices: list of K canonical device names.
          cluster: None, or the cluster the devices' worker belongs to.

        Raises:
          ValueError: NCCL on devices that are not GPUs, groups that do not
            cover K, a topology with fewer than K devices, a topology across
            workers.
        """
        if self.topology is not None:
            if cluster is not None and not cluster.is_local:
                raise ValueError(self._across_workers_message())
            check_topology(self.topology, len(devices))
            return
        stage = self._stage or make_stage(choose_algorithm(devices), {})
        stage.bind(normalize_devices(devices))

    def plan(self, shapes, devices, dtype=tf.float32, average=True):
        """The candidate the cost model predicts fastest for these gradients on ``topology``.

        Tries flat, hierarchical (the default groups and, for K a multiple
        of 4 above 4, groups of four), ring, collective and, on GPU names,
        NCCL, each unpacked and packed at 64 KiB, 1 MiB and 4 MiB (only
        ``pack_bytes`` when it is given), with this reduction's compression
        and sparse_as_dense; each is built in a scratch graph (nothing runs,
        the devices need not exist) and costed by ``tfreduce.predict``.

        Args:
          shapes: list of N gradient shapes (lists of ints).
          devices: list of K device names ("/gpu:k").
          dtype: tf.DType of the gradients.
          average: bool.

        Returns:
          planner.Plan; ``plan.reduction`` is the chosen Reduction.

        Raises:
          ValueError: no topology, no shapes, or a topology with fewer
            devices than K.
        """
        if self.topology is None:
            raise ValueError("plan: this Reduction has no topology to plan for; make it with "
                             "topology=<a tfreduce.Topology, a preset name or \"host\">")
        if not shapes:
            raise ValueError("plan: give the shapes of at least one gradient")
        specs = [(list(s), tf.as_dtype(dtype)) for s in shapes]
        from tfreduce.analysis.planner import plan_shapes  # the cost model, only to plan
        return plan_shapes(specs, normalize_devices(devices), self.topology, average, self)

    def _local_stage(self, grads, average):
        # (this process's stage, its pack size): the named one, the rule's
        # for "auto", or the plan's with a topology (made once per layout).
        if self.deterministic:
            # The algorithm moves the data; the fixed tree sums it.
            name = self._stage.name if self._stage is not None else choose_algorithm(grads.devices)
            stage = self._stage or make_stage("ring" if name == "nccl" else name, {})
            return TreeStage(stage), self.pack_bytes
        if self._stage is not None:
            return self._stage, self.pack_bytes
        plan = None
        if self.topology is not None:
            key = (tuple(grads.devices), average, tuple(
                (str(dense_shape(grads.grads[0][n])), values_of(grads.grads[0][n]).dtype.name,
                 isinstance(grads.grads[0][n], tf.IndexedSlices)) for n in grads.reduced))
            from tfreduce.analysis.planner import planned  # the cost model, only to plan
            plan = planned(self, key, lambda: plan_for(grads, self.topology, average, self))
        if plan is None:
            return make_stage(choose_algorithm(grads.devices), {}), self.pack_bytes
        options = dict(plan.options)
        pack_bytes = options.pop("pack_bytes")
        return make_stage(plan.algorithm, options), pack_bytes

    def _across_workers_message(self):
        return (f"topology={self.topology!r}: a plan is for the devices of one process; across "
                f"workers pass its choice, tfreduce.plan_allreduce(...).reduction")


def plan_for(grads, topology, average, reduction):
    """``planner.plan_for``, imported at the first plan: a door loads the cost model only then."""
    from tfreduce.analysis.planner import plan_for as plan
    return plan(grads, topology, average, reduction)


def as_reduction(algorithm="auto", reduction=None, options=None):
    """A door's Reduction: ``reduction`` itself, or one made of the algorithm and options.

    Args:
      algorithm: str, the door's ``algorithm`` argument.
      reduction: a Reduction, or None.
      options: dict of the door's other options (Reduction's fields).

    Returns:
      Reduction.

    Raises:
      TypeError: reduction is not a Reduction, or comes with an algorithm
        or options; the Reduction's own errors otherwise.
    """
    options = options or {}
    if reduction is None:
        return Reduction(algorithm, **options)
    if not isinstance(reduction, Reduction):
        raise TypeError(f"reduction must be a tfreduce.Reduction, got "
                        f"{type(reduction).__name__} {reduction!r}")
    if algorithm != "auto" or options:
        raise TypeError(f"pass either reduction= or the algorithm and its options, not both: "
                        f"got {reduction!r} and algorithm={algorithm!r}, options "
                        f"{sorted(options)}")
    return reduction


def _defaults():
    """{option: the default that means "not given"} of every field but the algorithm."""
    return {f.name: f.default for f in dataclasses.fields(Reduction)
            if f.init and f.name != "algorithm"}


def _given(value, default):
    """True if an option holds another value than the one that means "not given"."""
    return value is not None if default is None else value != default
