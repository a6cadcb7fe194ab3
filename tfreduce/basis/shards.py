"""The K x N input of the collectives besides all-reduce, checked once per call.

``tfreduce.doors.collectives`` takes ``all_tensors[k][n]``, tensor n of tower k,
like the all-reduce's gradients, but its tensors are split and joined along
axis 0: towers may differ in their row counts where the collective joins
rows (all-gather, all-to-all), and a scalar has no rows to split. This
module checks that input, the ``splits`` of an all-to-all and the ``root``
of a broadcast or reduce, and says which tower, tensor and values are wrong.
"""

import tensorflow as tf

from tfreduce.basis.collective_rules import COLLECTIVE_RULES
from tfreduce.basis.contract import (as_tensor, dense_shape, device_of, is_int, validate_groups,
                                     values_of)
from tfreduce.basis.devices import check_devices_exist, normalize_devices

__all__ = ["Tensors", "check_list", "validate_tensors", "check_splits", "check_root",
           "resolve_groups"]

class Tensors:
    """A validated K x N tensor list and its devices.

    Attributes:
      tensors: list[list], K x N of ``tf.Tensor``, ``tf.IndexedSlices`` or None.
      devices: list[str], K canonical device strings.
      num_towers: int K.
      num_vars: int N.
      present: list[int], the n whose tensor is given (on every tower, or
        on the root for a broadcast); the others are None everywhere.
    """

    def __init__(self, tensors, devices, present):
        self.tensors = tensors
        self.devices = devices
        self.num_towers = len(tensors)
        self.num_vars = len(tensors[0]) if tensors else 0
        self.present = present


def check_list(all_tensors, collective):
    """Raises TypeError unless ``all_tensors`` is a non-empty list (of K rows); returns K."""
    if not isinstance(all_tensors, (list, tuple)) or not all_tensors:
        raise TypeError(f"{collective}: all_tensors must be a non-empty list of K lists of N "
                        f"tensors, got {all_tensors!r:.80}")
    return len(all_tensors)


def _rows(all_tensors, collective, roots):
    # The K rows as lists; where only the roots' are read, the others may be None.
    if COLLECTIVE_RULES[collective].shapes != "root":
        return all_tensors
    for r in roots:
        if not isinstance(all_tensors[r], (list, tuple)):
            raise TypeError(f"{collective}: all_tensors[{r}] (a root tower) must be a list of "
                            f"N tensors, got {type(all_tensors[r]).__name__}")
    num_vars = len(all_tensors[roots[0]])
    return [[None] * num_vars if row is None and k not in roots else row
            for k, row in enumerate(all_tensors)]


def validate_tensors(all_tensors, devices, collective, roots=(0,)):
    """Checks the K x N input of one collective and resolves its devices.

    Args:
      all_tensors: list of K lists of N tensors (``all_tensors[k][n]`` on
        tower k); for "broadcast" only the roots' rows are read and the
        others may be None.
      devices: list of K device strings, or None for the tensors' devices.
      collective: str, a name in ``COLLECTIVE_RULES``, whose row says what
        it needs of the shapes.
      roots: list of int, the root tower of each group (broadcast).

    Returns:
      Tensors.

    Raises:
      TypeError: not a list of K lists; something that is not a tensor.
      ValueError: towers with different N; a tensor given on some towers
        only; dtypes that differ; shapes that differ where the collective
        needs one shape (reduce_scatter, reduce) or in the axes after the
        first (all_gather, all_to_all); a scalar to split or join along
        axis 0; bad or missing devices.
    """
    check_list(all_tensors, collective)
    rows = _rows(all_tensors, collective, list(roots))
    for k, row in enumerate(rows):
        if not isinstance(row, (list, tuple)):
            raise TypeError(f"{collective}: all_tensors[{k}] (tower {k}) must be a list of N "
                            f"tensors, got {type(row).__name__}")
    num_vars = len(rows[0])
    if num_vars == 0:
        raise ValueError(f"{collective}: tower 0 has no tensors")
    for k, row in enumerate(rows):
        if len(row) != num_vars:
            raise ValueError(f"{collective}: tower {k} has {len(row)} tensors, tower 0 has "
                             f"{num_vars}: every tower lists the same N tensors")
    tensors = [[as_tensor(t, k, n, "tensor {n}", "tensor") for n, t in enumerate(row)]
               for k, row in enumerate(rows)]
    rule = COLLECTIVE_RULES[collective]
    shapes, refuse_scalar = rule.shapes, rule.refuses_scalar
    present = []
    for n in range(num_vars):
        if shapes == "root":
            given = [r for r in roots if tensors[r][n] is not None]
            if given and len(given) != len(roots):
                raise ValueError(f"{collective}: tensor {n} is None on root towers "
                                 f"{sorted(set(roots) - set(given))} but not on {given}")
            if given:
                present.append(n)
            continue
        if _check_column(tensors, n, collective, shapes, refuse_scalar):
            present.append(n)
    given = devices
    if devices is None:
        devices = [device_of(row, k, f"{collective}: ", "tensors")
                   for k, row in enumerate(tensors)]
    devices = normalize_devices(devices, num_towers=len(tensors))
    if tf.executing_eagerly() or tf.inside_function():
        check_devices_exist(devices, given)
    return Tensors(tensors, devices, present)


def _check_column(tensors, n, collective, shapes, refuse_scalar):
    # True if tensor n is given (on every tower).
    column = [row[n] for row in tensors]
    missing = [k for k, t in enumerate(column) if t is None]
    if missing and len(missing) != len(column):
        raise ValueError(f"{collective}: tensor {n} is None on towers {missing} but not on the "
                         f"others: a tensor is given on every tower or on none")
    if missing:
        return False
    ref, ref_shape = values_of(column[0]), dense_shape(column[0])
    if shapes == "same" and not (ref.dtype.is_floating or ref.dtype.is_integer):
        raise TypeError(f"{collective}: tensor {n} has dtype {ref.dtype.name}; {collective} "
                        f"sums floating-point and integer tensors")
    for k, t in enumerate(column):
        shape = dense_shape(t)
        if refuse_scalar and shape.rank == 0:
            raise ValueError(f"{collective}: tensor {n} on tower {k} is a scalar (shape []): "
                             f"{collective} works along axis 0; reshape it to [1]")
        if values_of(t).dtype != ref.dtype:
            raise ValueError(f"{collective}: tensor {n}: tower {k} has dtype "
                             f"{values_of(t).dtype.name}, tower 0 has {ref.dtype.name}")
        if shapes == "same" and not shape.is_compatible_with(ref_shape):
            raise ValueError(f"{collective}: tensor {n}: tower {k} has shape {shape}, tower 0 "
                             f"has {ref_shape}; {collective} needs one shape on every tower")
        if shapes == "rows" and (shape.rank != ref_shape.rank or (
                shape.rank is not None and not shape[1:].is_compatible_with(ref_shape[1:]))):
            raise ValueError(f"{collective}: tensor {n}: tower {k} has shape {shape}, tower 0 "
                             f"has {ref_shape}; {collective} joins rows along axis 0, so the "
                             f"other axes must agree")
    return True


def resolve_groups(groups, num_towers, collective):
    """The groups a collective runs inside: ``groups`` checked, or one group of all towers.

    Args:
      groups: None, or a list of lists of tower indices that partitions
        0..K-1 (sizes may differ).
      num_towers: int K.
      collective: str, for messages.

    Returns:
      list[list[int]].

    Raises:
      TypeError, ValueError: groups that do not partition 0..K-1.
    """
    if groups is None:
        return [list(range(num_towers))]
    try:
        return validate_groups(groups, num_towers)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{collective}: {error}") from None


def check_root(root, groups, collective):
    """Checks that ``root`` is a position inside every group.

    Args:
      root: the ``root=`` argument.
      groups: list[list[int]], the resolved groups.
      collective: str, for the message.

    Returns:
      int, root (a NumPy integer made an int).

    Raises:
      ValueError: root is not an int in 0..(the smallest group's size - 1),
        naming that group.
    """
    smallest = min(groups, key=len)
    if not is_int(root) or not 0 <= root < len(smallest):
        where = (f"the {len(smallest)} towers" if len(groups) == 1 else
                 f"every group (group {groups.index(smallest)}, {smallest}, has "
                 f"{len(smallest)} towers)")
        raise ValueError(f"{collective}: root must be an int position in 0..{len(smallest) - 1} "
                         f"inside {where}, got {root!r}")
    return int(root)


def check_splits(splits, tensors, groups, parts=None):
    """Checks the ``splits`` of an all-to-all: K ints >= 0 per tower that add up to its rows.

    Args:
      splits: list of K lists; ``splits[j]`` holds one int per tower of
        tower j's group: the rows tower j sends to each, in group order.
      tensors: Tensors.
      groups: list[list[int]], the resolved groups.
      parts: int, the pieces per tower when not the group's size (T across
        workers).

    Returns:
      list of K lists of ints.

    Raises:
      ValueError: not K lists, the wrong number of ints, a negative or
        non-int count, or counts that do not add up to a tower's rows
        (naming the tower, the tensor, the splits and the rows).
    """
    size = {k: parts or len(g) for g in groups for k in g}
    if not isinstance(splits, (list, tuple)) or len(splits) != tensors.num_towers:
        raise ValueError(f"all_to_all: splits must be a list of K={tensors.num_towers} lists "
                         f"(one per tower), got {splits!r:.80}")
    out = []
    for j, counts in enumerate(splits):
        if (not isinstance(counts, (list, tuple)) or len(counts) != size[j] or any(
                not is_int(c) or c < 0 for c in counts)):
            raise ValueError(f"all_to_all: splits[{j}] must be {size[j]} ints >= 0 (the rows "
                             f"tower {j} sends to each tower of its group), got {counts!r}")
        for n in tensors.present:
            rows = dense_shape(tensors.tensors[j][n])[0]
            if rows is not None and sum(counts) != rows:
                raise ValueError(f"all_to_all: splits[{j}] = {list(counts)} add up to "
                                 f"{sum(counts)}, but tensor {n} on tower {j} has {rows} rows")
        out.append([int(c) for c in counts])
    return out
