"""Choosing the all-reduce for a machine: every candidate built and costed by the model.

``plan_allreduce`` builds each candidate reduction of the given gradient
shapes on the given device names in one scratch graph (nothing runs, no
device is needed), predicts its time on the topology with
``tfreduce.predict`` and returns the fastest, with the whole table, so the
choice can be read and checked. ``allreduce_grads(..., algorithm="auto",
topology=...)`` (and so the trainer and ``CrossDeviceOps``) plans with
``plan_for`` on the gradients it is given.
"""

import tensorflow as tf

from tfreduce.contract import dense_shape, validate_grads, values_of
from tfreduce.costmodel import predict
from tfreduce.devices import is_gpu, normalize_devices
from tfreduce.frame import run_stages
from tfreduce.hierarchical import default_groups
from tfreduce.hostprobe import resolve_topology
from tfreduce.registry import FRAME_OPTIONS, frame_options, make_stage
from tfreduce.topology import check_topology

__all__ = ["Plan", "plan_allreduce", "plan_for", "check_auto_options", "PACK_SIZES"]

#: The pack sizes tried: none, 64 KiB (the default), 1 MiB, 4 MiB.
PACK_SIZES = (None, 64 * 2**10, 2**20, 4 * 2**20)


class Plan:
    """The fastest candidate, and every candidate's predicted time.

    Of candidates predicted equal (within a relative 1e-9, float rounding
    of the simulation's sums), the first tried wins: the simpler algorithm,
    then the smaller pack.

    Attributes:
      algorithm: str, a name in tfreduce.ALGORITHMS.
      options: dict of allreduce_grads options (pack_bytes, groups).
      seconds: float, its predicted time.
      table: list of (algorithm, options, seconds), the chosen one first,
        then fastest first.
    """

    def __init__(self, table):
        best = min(row[2] for row in table)
        chosen = next(row for row in table if row[2] <= best * (1 + 1e-9))
        self.table = [chosen] + sorted((row for row in table if row is not chosen),
                                       key=lambda row: row[2])
        self.algorithm, self.options, self.seconds = chosen

    def kwargs(self):
        """{"algorithm": ..., **options}: what to pass to tfreduce.allreduce_grads."""
        return {"algorithm": self.algorithm, **self.options}

    def __repr__(self):
        return f"Plan({self.algorithm}, {self.options}, {self.seconds * 1e3:.3f} ms)"


def candidates(num_devices, on_gpus, pack_sizes=PACK_SIZES):
    """(algorithm, options) pairs to try for K devices."""
    algorithms = ["flat", "ring", "collective"] + (["nccl"] if on_gpus else [])
    groups = [default_groups(num_devices)]
    if num_devices % 4 == 0 and num_devices > 4:
        groups.append([list(range(g, g + 4)) for g in range(0, num_devices, 4)])
    out = []
    for pack_bytes in pack_sizes:
        out += [(a, {"pack_bytes": pack_bytes}) for a in algorithms]
        out += [("hierarchical", {"pack_bytes": pack_bytes, "groups": g}) for g in groups]
    return out


# Planning is plain Python over a scratch graph: when the dispatcher runs
# inside a tf.function, autograph calls it as it is, never converted.
@tf.autograph.experimental.do_not_convert
def check_auto_options(algorithm, topology, options, num_devices=None):
    """Checks ``topology=`` against the algorithm and options it comes with.

    The one check of the dispatcher, the trainer and ``CrossDeviceOps``.

    Args:
      algorithm: str, the algorithm named.
      topology: what ``topology=`` was given, or None (nothing to check).
      options: dict, the other options given.
      num_devices: int K, or None when not known yet.

    Raises:
      ValueError: a topology with a named algorithm; see ``check_topology``.
      TypeError: an option other than the frame's; see ``check_topology``.
    """
    if topology is None:
        return
    if algorithm != "auto":
        raise ValueError(f"topology= chooses the algorithm (algorithm='auto'), but "
                         f"algorithm={algorithm!r} was named: pass one of them")
    _check_frame_only(options)
    check_topology(topology, num_devices)


def _check_frame_only(options):
    unknown = sorted(set(options) - set(FRAME_OPTIONS))
    if unknown:
        raise TypeError(f"planning takes only the frame's options {list(FRAME_OPTIONS)}, got "
                        f"{unknown}: the plan picks the algorithm and its groups")


def plan_allreduce(shapes, devices, topology, dtype=tf.float32, average=True, **options):
    """The all-reduce with the lowest predicted time for these gradients on this machine.

    Tries flat, hierarchical (the default groups and, for K a multiple of
    4 above 4, groups of four), ring, collective and, on GPU names, NCCL,
    each unpacked and with every size in PACK_SIZES (or only the
    ``pack_bytes`` given).

    Args:
      shapes: list of N gradient shapes (lists of ints), e.g. the model's
        trainable variables' shapes.
      devices: list of K device names ("/gpu:k"); they need not exist here.
      topology: a tfreduce.Topology, a preset name, or "host".
      dtype: tf.DType of the gradients.
      average: bool.
      **options: frame options every candidate keeps: ``pack_bytes`` (then
        only that size is tried), ``compression``, ``sparse_as_dense``.

    Returns:
      Plan; ``tfreduce.allreduce_grads(grads, devices, **plan.kwargs())``.

    Raises:
      ValueError: no shapes, an unknown preset, or a topology with fewer
        devices than K.
      TypeError: an option other than the frame's, or a topology of the
        wrong type.
    """
    if not shapes:
        raise ValueError("plan_allreduce: give the shapes of at least one gradient")
    return _plan([(list(s), tf.as_dtype(dtype)) for s in shapes], normalize_devices(devices),
                 topology, average, options)


@tf.autograph.experimental.do_not_convert
def plan_for(grads, topology, average, options):
    """The plan for validated gradients: ``allreduce_grads``' "auto" with a topology.

    Plans on tower 0's dense gradients (and IndexedSlices when
    ``sparse_as_dense``); other IndexedSlices are gathered alike by every
    algorithm and are left out.

    Args:
      grads: contract.Gradients, the K x N input, validated.
      topology: a tfreduce.Topology, a preset name, or "host".
      average: bool.
      options: dict of frame options the candidates keep.

    Returns:
      Plan, or None when no gradient is planned on (then the default rule).

    Raises:
      ValueError: a planned gradient whose shape is not fully known (named).
    """
    specs = []
    for n in grads.reduced:
        g = grads.grads[0][n]
        if isinstance(g, tf.IndexedSlices) and not options.get("sparse_as_dense"):
            continue
        shape = dense_shape(g)
        if not shape.is_fully_defined():
            raise ValueError(
                f"algorithm='auto' with topology= costs the gradients' static shapes: tower 0's "
                f"gradient of variable {n} has shape {shape}; name the algorithm, or plan with "
                f"tfreduce.plan_allreduce on the shapes you expect")
        specs.append((shape.as_list(), values_of(g).dtype))
    return _plan(specs, grads.devices, topology, average, options) if specs else None


def _plan(specs, devices, topology, average, options):
    _check_frame_only(options)
    topology = resolve_topology(topology, len(devices))
    pack_sizes = (options["pack_bytes"],) if "pack_bytes" in options else PACK_SIZES
    table = []
    # One scratch graph: every candidate reduces the same inputs, and each
    # prediction walks back from its own outputs to them.
    with tf.Graph().as_default():
        inputs = []
        for d in devices:
            with tf.device(d):
                inputs.append([tf.zeros(shape, dtype) for shape, dtype in specs])
        for algorithm, choice in candidates(len(devices), all(map(is_gpu, devices)), pack_sizes):
            candidate = {**options, **choice}
            out = run_stages(validate_grads(inputs, devices),
                             [make_stage(algorithm, candidate)], average,
                             **frame_options(candidate))
            table.append((algorithm, choice, predict(out, topology, inputs=inputs).seconds))
    return Plan(table)
