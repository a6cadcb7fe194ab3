"""Choosing the all-reduce for a machine: every candidate built and costed by the model.

A ``tfreduce.Reduction`` with a topology plans here: each candidate
reduction of the gradients' shapes is built on the given device names in one
scratch graph (nothing runs, no device is needed), its time on the topology
predicted by ``tfreduce.predict``, and the fastest kept, with the whole
table, so the choice can be read and checked (``plan_allreduce``,
``Reduction.plan``). ``Reduction(topology=...)`` called on gradients plans
with ``plan_for`` on the gradients it is given.
"""

import collections
import copy
import dataclasses
import functools

import tensorflow as tf

from tfreduce.algorithms.frame import run_stages
from tfreduce.algorithms.registry import STAGES, make_stage
from tfreduce.analysis.costmodel import predict
from tfreduce.analysis.hostprobe import resolve_topology
from tfreduce.basis.contract import dense_shape, validate_grads, values_of

__all__ = ["Plan", "plan_for", "plan_shapes", "planned", "forget_plans", "PACK_SIZES"]

#: The pack sizes tried: none, 64 KiB (the default), 1 MiB, 4 MiB.
PACK_SIZES = (None, 64 * 2**10, 2**20, 4 * 2**20)

#: The plans made so far, by (Reduction, layout), the most recent last.
_PLANS = collections.OrderedDict()
_PLANS_KEPT = 256


class Plan:
    """The fastest candidate, and every candidate's predicted time.

    Of candidates predicted equal (within a relative 1e-9, float rounding
    of the simulation's sums), the first tried wins: the simpler algorithm,
    then the smaller pack.

    Args:
      table: list of (algorithm, options, seconds), one per candidate.
      base: the tfreduce.Reduction planned for, whose compression and
        sparse_as_dense every candidate kept.

    Attributes:
      algorithm: str, a name in tfreduce.ALGORITHMS.
      options: dict of allreduce_grads options (pack_bytes, groups).
      seconds: float, its predicted time.
      table: list of (algorithm, options, seconds), the chosen one first,
        then fastest first.
    """

    def __init__(self, table, base):
        best = min(row[2] for row in table)
        chosen = next(row for row in table if row[2] <= best * (1 + 1e-9))
        # Each plan has its own options dicts: the planner's cache keeps the table.
        self.table = [(a, copy.deepcopy(o), s) for a, o, s in
                      [chosen] + sorted((row for row in table if row is not chosen),
                                        key=lambda row: row[2])]
        self.algorithm, self.options, self.seconds = self.table[0]
        self._base = base

    @property
    def reduction(self):
        """tfreduce.Reduction: the chosen algorithm and options, for any door to take."""
        return dataclasses.replace(self._base, algorithm=self.algorithm, topology=None,
                                   **self.options)

    def kwargs(self):
        """{"algorithm": ..., **options}: what to pass to tfreduce.allreduce_grads."""
        return {"algorithm": self.algorithm, **self.options}

    def __repr__(self):
        return f"Plan({self.algorithm}, {self.options}, {self.seconds * 1e3:.3f} ms)"


def candidates(devices, pack_sizes=PACK_SIZES):
    """(algorithm, options) pairs to try on K canonical devices: every registered one.

    Each algorithm of ``registry.STAGES``, in its order, with each option
    set of its ``plan_options`` that its ``bind`` accepts on these devices,
    at each pack size.
    """
    usable = []
    for name, stage in STAGES.items():
        for options in stage.plan_options(len(devices)):
            try:
                make_stage(name, dict(options)).bind(devices)
            except ValueError:
                continue  # this algorithm cannot use these devices
            usable.append((name, options))
    return [(name, {"pack_bytes": pack_bytes, **options})
            for pack_bytes in pack_sizes for name, options in usable]


# Planning is plain Python over a scratch graph: when a reduction is built
# inside a tf.function, autograph calls it as it is, never converted.
def planned(reduction, key, make):
    """A plan made once per reduction and layout: ``make()`` the first time, kept after.

    A ``Reduction`` is a value, so equal Reductions share their plans; the
    256 most recently used are kept. With ``topology="host"`` this is also
    what keeps the probe to once per layout.

    Args:
      reduction: the tfreduce.Reduction planned for (hashable).
      key: hashable, what the plan depends on besides the reduction
        (collective, devices, shapes and dtypes, average).
      make: callable returning the plan.

    Returns:
      the plan ``make`` returned for this reduction and key.
    """
    whole = (reduction, key)
    if whole in _PLANS:
        _PLANS.move_to_end(whole)
    else:
        _PLANS[whole] = make()
        if len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    return _PLANS[whole]


def forget_plans():
    """Drops every kept plan: the next call plans again (and probes a "host" topology again)."""
    _PLANS.clear()


@tf.autograph.experimental.do_not_convert
def plan_for(grads, topology, average, reduction):
    """The plan for validated gradients: what "auto" with a topology builds.

    Plans on tower 0's dense gradients (and IndexedSlices when
    ``sparse_as_dense``); other IndexedSlices are gathered alike by every
    algorithm and are left out.

    Args:
      grads: contract.Gradients, the K x N input, validated.
      topology: a tfreduce.Topology, a preset name, or "host".
      average: bool.
      reduction: the tfreduce.Reduction planned for (its pack_bytes,
        sparse_as_dense and compression).

    Returns:
      Plan, or None when no gradient is planned on (then the default rule).

    Raises:
      ValueError: a planned gradient whose shape is not fully known (named).
    """
    specs = []
    for n in grads.reduced:
        g = grads.grads[0][n]
        if isinstance(g, tf.IndexedSlices) and not reduction.sparse_as_dense:
            continue
        shape = dense_shape(g)
        if not shape.is_fully_defined():
            raise ValueError(
                f"algorithm='auto' with topology= costs the gradients' static shapes: tower 0's "
                f"gradient of variable {n} has shape {shape}; name the algorithm, or plan with "
                f"tfreduce.plan_allreduce on the shapes you expect")
        specs.append((shape.as_list(), values_of(g).dtype))
    return plan_shapes(specs, grads.devices, topology, average, reduction) if specs else None


@tf.autograph.experimental.do_not_convert
def plan_shapes(specs, devices, topology, average, reduction):
    """The plan for gradients of these (shape, dtype) on K canonical device names.

    Args:
      specs: list of N (shape as a list of ints, tf.DType).
      devices: list of K canonical device names; they need not exist here.
      topology: a tfreduce.Topology, a preset name, or "host".
      average: bool.
      reduction: the tfreduce.Reduction planned for: with its pack_bytes
        given, only that size is tried; its compression and sparse_as_dense
        are kept.

    Returns:
      Plan.

    Raises:
      ValueError, TypeError: as ``hostprobe.resolve_topology``.
    """
    topology = resolve_topology(topology, len(devices))  # "host" is probed at each plan
    # The registry too: an algorithm registered later is costed in the next plan.
    key = (tuple((tuple(shape), tf.as_dtype(dtype)) for shape, dtype in specs), tuple(devices),
           topology, bool(average), reduction.pack_bytes, reduction.sparse_as_dense,
           reduction.compression, tuple(STAGES.items()))
    return Plan(_costed(key), reduction)


@functools.lru_cache(maxsize=256)
def _costed(key):
    """The table of (algorithm, options, seconds) for one plan_shapes key.

    The same gradients, devices, topology and options always cost the same,
    so a program that plans again (a new ``Reduction``, ``allreduce_grads``
    with ``topology=`` in a loop, ``plan_allreduce``) reuses the table. A
    Topology hashes by its figures, so a preset made again is the same key.
    """
    specs, devices, topology, average, pack_bytes, sparse_as_dense, compression, _ = key
    pack_sizes = (pack_bytes,) if pack_bytes != "auto" else PACK_SIZES
    table = []
    # One scratch graph: every candidate reduces the same inputs, and each
    # prediction walks back from its own outputs to them.
    with tf.Graph().as_default():
        inputs = []
        for d in devices:
            with tf.device(d):
                inputs.append([tf.zeros(shape, dtype) for shape, dtype in specs])
        for algorithm, choice in candidates(devices, pack_sizes):
            own = {name: value for name, value in choice.items() if name != "pack_bytes"}
            out = run_stages(validate_grads(inputs, devices), [make_stage(algorithm, own)],
                             average, pack_bytes=choice["pack_bytes"],
                             sparse_as_dense=sparse_as_dense, compression=compression)
            table.append((algorithm, choice, predict(out, topology, inputs=inputs).seconds))
    return tuple(table)
