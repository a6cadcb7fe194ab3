"""The K x N contract: validation (gradients, groups, variables), (grad, var) lists, shard sizes.

Every public reduction in tfreduce takes ``all_grads``, a list of K lists of N
gradients (``all_grads[k][n]`` is the gradient of variable n on tower k), and
returns the same K x N structure with ``out[k][n]`` placed on ``devices[k]``.
This module checks that input once, before any op is built, so that a mistake
is reported with the tower, the variable and the values involved instead of
surfacing later as a shape error deep inside a graph.
"""

import numbers

import numpy as np
import tensorflow as tf

from tfreduce.basis.devices import check_devices_exist, normalize_devices

__all__ = [
    "Gradients",
    "validate_grads",
    "validate_groups",
    "tf_variables",
    "split_grad_list",
    "merge_grad_list",
    "nbytes",
    "shard_sizes",
    "check_variables",
    "check_flag",
    "dense_shape",
    "values_of",
    "as_tensor",
    "device_of",
]


def nbytes(tensor):
    """Static size of a tensor's (or IndexedSlices' values') data in bytes.

    Unknown dimensions count as 1, so a tensor of unknown shape weighs at
    least one element; this only steers load balancing.
    """
    if isinstance(tensor, tf.IndexedSlices):
        tensor = tensor.values
    shape = tensor.shape
    count = 1
    if shape.rank is not None:
        for d in shape:
            count *= d if d is not None else 1
    return count * tensor.dtype.size


def is_int(value):
    """True for an int or a NumPy integer (``np.array_split`` sizes, ``argmax``), never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_root_rank(root_rank, num_ranks, prefix="", what=""):
    """Raises ValueError unless root_rank is an int rank in 0..num_ranks-1.

    The message: "{prefix}root_rank must be an int in 0..N-1 (the ranks of the
    N{what}), got R".
    """
    if not is_int(root_rank) or not 0 <= root_rank < num_ranks:
        raise ValueError(f"{prefix}root_rank must be an int in 0..{num_ranks - 1} (the ranks "
                         f"of the {num_ranks}{what}), got {root_rank!r}")


def shard_sizes(total, num_shards):
    """Splits ``total`` items into ``num_shards`` nearly equal shards.

    The one rule every split in tfreduce follows (a global batch over the
    towers, a gradient into ring chunks): the first ``total % num_shards``
    shards hold one item more, so sizes differ by at most one and nothing is
    dropped; with fewer items than shards the last shards are empty.
    ``shard_sizes(10, 4) == [3, 3, 2, 2]``, ``shard_sizes(2, 4) == [1, 1, 0, 0]``.

    Args:
      total: int >= 0, or an integer scalar tf.Tensor (a size known only
        when the graph runs).
      num_shards: int >= 1.

    Returns:
      list of ``num_shards`` ints summing to ``total``; for a tensor
      ``total``, a 1-D tensor of its dtype with ``num_shards`` elements.
    """
    if tf.is_tensor(total):
        base, extra = total // num_shards, total % num_shards
        return base + tf.cast(tf.range(num_shards) < extra, total.dtype)
    base, extra = divmod(total, num_shards)
    return [base + (1 if c < extra else 0) for c in range(num_shards)]


def validate_groups(groups, num_devices=None):
    """Checks that ``groups`` partitions ``range(num_devices)``.

    Args:
      groups: list of lists of int device indices, e.g.
        ``[[0, 1, 2, 3], [4, 5, 6, 7]]`` for K=8.
      num_devices: int K; None (K not known yet): the groups must partition
        0..(their largest index), so only a K above that can still fail.

    Returns:
      list[list[int]], a copy of ``groups``.

    Raises:
      TypeError: if groups is not a list of lists of ints.
      ValueError: if a group is empty, an index is out of range, or an index
        is missing or appears twice.
    """
    if not isinstance(groups, (list, tuple)) or not groups:
        raise TypeError(
            f"groups must be a non-empty list of lists of device indices, "
            f"e.g. [[0, 1], [2, 3]], got {groups!r}")
    if num_devices is None:
        indices = [i for group in groups if isinstance(group, (list, tuple)) for i in group
                   if is_int(i)]
        num_devices = max(indices, default=-1) + 1
    owner = {}
    out = []
    for g, group in enumerate(groups):
        if not isinstance(group, (list, tuple)):
            raise TypeError(
                f"groups[{g}] must be a list of device indices, got {group!r}")
        if not group:
            raise ValueError(f"groups[{g}] is empty: every group needs a device")
        for i in group:
            if not is_int(i):
                raise TypeError(
                    f"groups[{g}] holds {i!r}; device indices must be ints")
            if not 0 <= i < num_devices:
                raise ValueError(
                    f"groups[{g}] holds device index {i}, outside 0..{num_devices - 1} "
                    f"for {num_devices} devices")
            if i in owner:
                raise ValueError(
                    f"device index {i} is in groups[{owner[i]}] and groups[{g}]: "
                    f"every index must be in exactly one group")
            owner[i] = g
        out.append([int(i) for i in group])
    missing = sorted(set(range(num_devices)) - set(owner))
    if missing:
        raise ValueError(
            f"groups {groups!r} leave device indices {missing} out: every index "
            f"0..{num_devices - 1} must be in exactly one group")
    return out


class Gradients:
    """A validated K x N gradient list and its devices.

    Attributes:
      grads: list[list], K x N; dense gradients are ``tf.Tensor``,
        ``tf.IndexedSlices`` stay as they are, None stays None.
      devices: list[str], K canonical device strings.
      num_towers: int K.
      num_vars: int N.
      reduced: list[int], the indices n whose gradient is not None (on every
        tower); the others are None on every tower.
    """

    def __init__(self, grads, devices):
        self.grads = grads
        self.devices = devices
        self.num_towers = len(grads)
        self.num_vars = len(grads[0])
        self.reduced = [n for n in range(self.num_vars) if grads[0][n] is not None]

    def column(self, n):
        """The K gradients of variable n, tower order."""
        return [self.grads[k][n] for k in range(self.num_towers)]

    def static(self, n):
        """True if variable n's shape is fully known on every tower (then one shape)."""
        return all(dense_shape(g).is_fully_defined() for g in self.column(n))

    def empty_output(self):
        """A K x N list of None to fill in."""
        return [[None] * self.num_vars for _ in range(self.num_towers)]


def as_tensor(g, k, n, what="variable {n}", kind="gradient"):
    """One element of a K x N list: a tf.Tensor, tf.IndexedSlices or None (a tf.Variable is read).

    Raises:
      TypeError: anything else, naming tower k and ``what`` (formatted with n).
    """
    if g is None or isinstance(g, (tf.Tensor, tf.IndexedSlices)):
        return g
    if isinstance(g, tf.Variable):
        return tf.convert_to_tensor(g)
    raise TypeError(
        f"tower {k}, {what.format(n=n)}: a {kind} must be a tf.Tensor, "
        f"tf.IndexedSlices or None, got {type(g).__name__}")


def values_of(g):
    """A gradient's values: the tensor itself, or an IndexedSlices' values."""
    return g.values if isinstance(g, tf.IndexedSlices) else g


def device_of(tower, k, prefix="", kind="gradients"):
    """Tower k's device: that of the first of its tensors that has one.

    Raises:
      ValueError: none of them has a device (``prefix`` starts the message).
    """
    for g in tower:
        if g is not None:
            d = values_of(g).device
            if d:
                return d
    raise ValueError(
        f"{prefix}devices=None, but the {kind} of tower {k} carry no device: build "
        f"them under tf.device(...) or pass devices=[...]")


def validate_grads(all_grads, devices=None):
    """Checks a K x N gradient list and resolves its devices.

    Args:
      all_grads: list of K lists of N gradients (``tf.Tensor``,
        ``tf.IndexedSlices`` or None); ``all_grads[k][n]`` is the gradient of
        variable n on tower k. Tuples are accepted.
      devices: list of K device strings, or None to take tower k's device from
        the first of its gradients that has one.

    Returns:
      Gradients, with canonical devices.

    Raises:
      TypeError: if all_grads is not a list of lists, or holds something that
        is not a gradient.
      ValueError: empty input; towers with different N; a variable whose
        shapes or dtypes differ across towers; a variable that is None on some
        towers only; bad or duplicate devices; devices=None and a tower whose
        gradients carry no device; executing eagerly or tracing a
        tf.function, a device that does not exist in this process.
    """
    if not isinstance(all_grads, (list, tuple)):
        raise TypeError(
            f"all_grads must be a list of K lists of N gradients, got "
            f"{type(all_grads).__name__}")
    if not all_grads:
        raise ValueError("all_grads is empty: it needs one list of gradients per tower")
    for k, tower in enumerate(all_grads):
        if not isinstance(tower, (list, tuple)):
            raise TypeError(
                f"all_grads[{k}] (tower {k}) must be a list of N gradients, got "
                f"{type(tower).__name__}; for (grad, var) pairs use split_grad_list")
    num_vars = len(all_grads[0])
    if num_vars == 0:
        raise ValueError("tower 0 has no gradients: there is nothing to all-reduce")
    for k, tower in enumerate(all_grads):
        if len(tower) != num_vars:
            raise ValueError(
                f"tower {k} has {len(tower)} gradients, tower 0 has {num_vars}: "
                f"every tower must list the gradients of the same N variables")
    grads = [[as_tensor(g, k, n) for n, g in enumerate(tower)]
             for k, tower in enumerate(all_grads)]
    for n in range(num_vars):
        _check_variable(grads, n)
    given = devices
    if devices is None:
        devices = [device_of(tower, k) for k, tower in enumerate(grads)]
    devices = normalize_devices(devices, num_towers=len(grads))
    if tf.executing_eagerly() or tf.inside_function():
        # A v1 Graph may be built for another machine (structure tests,
        # graphs exported to run elsewhere); eager code and tf.function run
        # here, where TF would silently put a missing device's ops on CPU:0.
        check_devices_exist(devices, given)
    return Gradients(grads, devices)


def _check_variable(grads, n):
    column = [tower[n] for tower in grads]
    missing = [k for k, g in enumerate(column) if g is None]
    if missing and len(missing) != len(column):
        present = [k for k, g in enumerate(column) if g is not None]
        raise ValueError(
            f"variable {n}: the gradient is None on towers {missing} but not on "
            f"towers {present}; a variable must have a gradient on every tower "
            f"or on none")
    if missing:
        return
    ref = values_of(column[0])
    if not (ref.dtype.is_floating or ref.dtype.is_integer):
        raise TypeError(
            f"variable {n}: gradients of dtype {ref.dtype.name} cannot be all-reduced; "
            f"tfreduce sums floating-point and integer gradients")
    ref_shape = dense_shape(column[0])
    for k, g in enumerate(column[1:], start=1):
        v = values_of(g)
        if v.dtype != ref.dtype:
            raise ValueError(
                f"variable {n}: tower {k} has dtype {v.dtype.name}, tower 0 has "
                f"{ref.dtype.name}")
        # Dense and sparse towers compare as what they sum to: the dense value.
        shape = dense_shape(g)
        if not shape.is_compatible_with(ref_shape):
            raise ValueError(
                f"variable {n}: tower {k} has shape {shape}, tower 0 has {ref_shape}")


def dense_shape(g):
    """The static shape of a gradient's dense value.

    A ``tf.Tensor``'s shape; for ``tf.IndexedSlices`` its ``dense_shape`` when
    that is a constant, else (rows unknown) x the values' row shape.

    Args:
      g: tf.Tensor or tf.IndexedSlices.

    Returns:
      tf.TensorShape, possibly partly unknown.
    """
    if not isinstance(g, tf.IndexedSlices):
        return g.shape
    rows = tf.TensorShape([None]).concatenate(g.values.shape[1:])
    known = None if g.dense_shape is None else tf.get_static_value(g.dense_shape)
    if known is None:
        return rows
    dense = tf.TensorShape([int(d) for d in known])
    return dense.merge_with(rows) if dense.is_compatible_with(rows) else dense


def check_flag(value, name):
    """Checks a boolean option: only True or False (NumPy's too), not truthy values.

    Raises:
      TypeError: ``value`` is not a bool, e.g. ``average="no"`` or ``[0]``.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


@tf.autograph.experimental.do_not_convert
def split_grad_list(grad_list):
    """Splits K x N (grad, var) pairs into K x N grads and K x N vars.

    This is the layout of ``optimizer.compute_gradients`` per tower, as
    tensorpack's ``split_grad_list`` takes it.

    Args:
      grad_list: list of K lists of N ``(gradient, variable)`` pairs.

    Returns:
      (all_grads, all_vars): two lists of K lists of N.

    Raises:
      TypeError: if an entry is not a pair.
    """
    all_grads, all_vars = [], []
    for k, tower in enumerate(grad_list):
        grads, variables = [], []
        for n, pair in enumerate(tower):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError(
                    f"tower {k}, entry {n}: expected a (gradient, variable) pair, "
                    f"got {type(pair).__name__}")
            grads.append(pair[0])
            variables.append(pair[1])
        all_grads.append(grads)
        all_vars.append(variables)
    return all_grads, all_vars


@tf.autograph.experimental.do_not_convert
def merge_grad_list(all_grads, all_vars):
    """Zips K x N grads and K x N vars back into K x N (grad, var) pairs.

    Args:
      all_grads: list of K lists of N gradients.
      all_vars: list of K lists of N variables.

    Returns:
      list of K lists of N ``(gradient, variable)`` tuples.

    Raises:
      ValueError: if the two lists do not have the same K and N.
    """
    if len(all_grads) != len(all_vars):
        raise ValueError(
            f"all_grads has {len(all_grads)} towers, all_vars has {len(all_vars)}")
    out = []
    for k, (grads, variables) in enumerate(zip(all_grads, all_vars)):
        if len(grads) != len(variables):
            raise ValueError(
                f"tower {k} has {len(grads)} gradients and {len(variables)} variables")
        out.append(list(zip(grads, variables)))
    return out


def tf_variables(all_vars):
    """K lists of N ``tf.Variable``: each Keras 3 variable replaced by the one it holds.

    A Keras 3 variable (``keras.Variable``, what ``model.trainable_variables``
    lists) wraps a ``tf.Variable`` in ``.value`` and has no ``device`` or
    ``read_value``; call ``check_variables`` first.
    """
    return [[v if isinstance(v, tf.Variable) or not isinstance(
        getattr(v, "value", None), tf.Variable) else v.value for v in tower]
        for tower in all_vars]


def check_variables(all_vars, fully_defined=False):
    """Checks K lists of N variables: tower k's copies of the same N variables.

    Args:
      all_vars: list of K lists of N variables (``tf.Variable``, or anything
        with ``assign``, such as a Keras variable); ``all_vars[k][n]`` is
        tower k's copy of variable n.
      fully_defined: bool; also require every shape to be fully defined
        (what a packed copy between workers needs).

    Raises:
      TypeError: all_vars is not a non-empty list of lists, or holds
        something that is not a variable.
      ValueError: towers with different numbers of variables, or a variable
        whose dtype or shape differs from tower 0's (or is not fully defined).
    """
    if isinstance(all_vars, (str, bytes)) or not isinstance(all_vars, (list, tuple)) or (
            not all_vars):
        raise TypeError("all_vars must be a non-empty list of K lists of N "
                        "tf.Variables, all_vars[k][n] tower k's copy of variable n")
    num_vars = len(all_vars[0]) if isinstance(all_vars[0], (list, tuple)) else None
    for k, tower in enumerate(all_vars):
        if not isinstance(tower, (list, tuple)):
            raise TypeError(f"all_vars[{k}] (tower {k}) must be a list of N variables, "
                            f"got {type(tower).__name__}")
        if len(tower) != num_vars:
            raise ValueError(f"tower {k} has {len(tower)} variables, tower 0 has "
                             f"{num_vars}")
        for n, v in enumerate(tower):
            if not hasattr(v, "assign"):
                raise TypeError(f"tower {k}, variable {n}: expected a tf.Variable, "
                                f"got {type(v).__name__}")
            ref = all_vars[0][n]
            # Keras variables give a tuple shape and a dtype name.
            shape, ref_shape = tf.TensorShape(v.shape), tf.TensorShape(ref.shape)
            dtype, ref_dtype = tf.as_dtype(v.dtype), tf.as_dtype(ref.dtype)
            same_shape = (shape == ref_shape and shape.is_fully_defined()
                          if fully_defined else shape.is_compatible_with(ref_shape))
            if dtype != ref_dtype or not same_shape:
                need = "one fully defined shape" if fully_defined else "one shape"
                raise ValueError(
                    f"variable {n} ({ref.name}): tower {k} has {dtype.name} "
                    f"{shape}, tower 0 has {ref_dtype.name} {ref_shape}; copies "
                    f"need {need} and dtype")
