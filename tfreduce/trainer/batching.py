"""Global batches: checking them, cutting arrays into them, a worker's part.

A global batch is what one step trains on, split over the T = W * K towers
of all W workers. Inputs and targets take any structure Keras' ``fit``
takes: an array (or tensor), or a dict, list or tuple of them, nested (a
model with several inputs, e.g. keras-hub's dict of token ids, segment ids
and padding mask); sample weights travel with the targets (``Weighted``).
Every leaf is split along its axis 0. Arrays are cut into global batches
here; a tf.data.Dataset or a keras.utils.PyDataset yields them, as (x, y)
or (x, y, sample_weight). In a cluster every worker is given the same
global batch and keeps its own part (tfreduce.Cluster.batch_slice), which
its K towers split again by the same rule (tfreduce.basis.contract.shard_sizes).
"""

import collections
import os
import types

import keras
import numpy as np
import tensorflow as tf

from tfreduce.basis.contract import shard_sizes


class Weighted(collections.namedtuple("Weighted", "y sample_weight")):
    """Targets with their sample weights: what the trainer passes where the targets go.

    Fields:
      y: the targets (any structure).
      sample_weight: [batch] or [batch, ...] weights of each example's loss
        (broadcast against the loss's trailing axes, as Keras does).
    """


def with_weights(y, sample_weight):
    """y, or Weighted(y, sample_weight) when weights are given."""
    return y if sample_weight is None else Weighted(y, sample_weight)


def split_weights(y):
    """(targets, sample weights or None) of what with_weights made."""
    return (y.y, y.sample_weight) if isinstance(y, Weighted) else (y, None)


def leaves(structure, root):
    """[(path, leaf)] of a nested structure in tf.nest's order, e.g. ("x['token_ids']", array).

    Weighted targets name their parts "y..." and "sample_weight..."."""
    if isinstance(structure, Weighted):
        return leaves(structure.y, "y") + leaves(structure.sample_weight, "sample_weight")
    if isinstance(structure, dict):  # tf.nest sorts the keys too
        return [pair for key in sorted(structure) for pair in
                leaves(structure[key], f"{root}[{key!r}]")]
    if isinstance(structure, (list, tuple)) and _is_structure(structure):
        return [pair for i, item in enumerate(structure) for pair in leaves(item, f"{root}[{i}]")]
    return [(root, structure)]


def _is_structure(value):
    """A list or tuple of inputs (Keras' multi-input), not one array written as a list."""
    return any(isinstance(v, (np.ndarray, tf.Tensor, dict, list, tuple)) or tf.is_tensor(v)
               for v in value) and not all(isinstance(v, (int, float)) for v in value)


def as_arrays(structure):
    """The structure with every leaf a NumPy array (a list of numbers is one array)."""
    if isinstance(structure, Weighted):
        return Weighted(as_arrays(structure.y), as_arrays(structure.sample_weight))
    if isinstance(structure, (list, tuple)) and not _is_structure(structure):
        return np.asarray(structure)
    return tf.nest.map_structure(np.asarray, structure)


def batch_size_of(x):
    """int, the examples of a batch: the length of its first leaf."""
    first = tf.nest.flatten(x)[0]
    return int(first.shape[0]) if hasattr(first, "shape") else len(first)


def is_dataset(x):
    """True for a tf.data.Dataset, False for arrays."""
    return isinstance(x, tf.data.Dataset)


def is_batches(x):
    """True for what yields global batches itself: a tf.data.Dataset or a keras.utils.PyDataset."""
    return is_dataset(x) or isinstance(x, keras.utils.PyDataset)


def check_batch(x, y, what):
    """Converts a global batch's leaves to tensors and checks it can be split.

    Raises:
      ValueError: a leaf has no batch axis, or two leaves differ in batch
        size (naming both, e.g. "x['segment_ids'] has 3 examples but y has 24").
    """
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y = tf.nest.map_structure(tf.convert_to_tensor, y)
    named = leaves(x, "x") + leaves(y, "y")
    for path, t in named:
        if t.shape.rank == 0:
            raise ValueError(f"{what}: {path} needs a batch axis, got a scalar")
    first_path, first = named[0][0], named[0][1].shape[0]
    for path, t in named[1:]:
        if t.shape[0] != first:
            raise ValueError(f"{what}: {first_path} has {first} examples but {path} has "
                             f"{t.shape[0]}")
    return x, y


def worker_batch(x, y, cluster, num_devices, total_towers, class_indices=False,
                 shards_per_worker=None):
    """This worker's part of a checked global batch, for one training step.

    Args:
      x, y: structures of tf.Tensor or np.ndarray [batch, ...], the global
        batch (y: the targets, Weighted with sample weights).
      cluster: the started tfreduce.Cluster, or a LocalCluster.
      num_devices: int K, the towers of each worker.
      total_towers: int T = W * K, the towers of all workers.
      class_indices: bool, y must hold class indices (whole numbers).
      shards_per_worker: int, the shards of the global batch each worker
        takes (``Cluster.batch_slice``); None: its K towers' (a
        deterministic step: its micro-batches).

    Returns:
      (x, y, B): tensors [b, ...] of this worker's examples (all B of them
      in a single process) and the int size B of the global batch.

    Raises:
      ValueError: the leaves disagree on the batch size, B is smaller than
        the T = W * K towers, or y holds fractional class indices.
    """
    x, y = check_batch(x, y, "train_step")
    targets, _ = split_weights(y)
    for path, t in leaves(targets, "y") if class_indices else ():
        if t.dtype.is_floating:
            values = t.numpy()
            fractional = values[values != np.round(values)]
            if fractional.size:
                raise ValueError(
                    f"train_step: the loss takes class indices, but {path} holds "
                    f"{float(fractional.flat[0]):g}; give whole-number labels, or a loss for "
                    f"soft labels such as keras.losses.CategoricalCrossentropy")
    batch = batch_size_of(x)
    total = total_towers
    if batch < total:
        raise ValueError(
            f"train_step: the global batch has {batch} examples but there are "
            f"{cluster.describe_towers(num_devices)}; every tower needs at least one "
            f"example, so use a batch of at least {total}"
        )
    # Every worker is given the same global batch and takes its part (one
    # process: all of it).
    start, stop = cluster.batch_slice(batch, shards_per_worker or num_devices)
    if (start, stop) != (0, batch):
        x, y = (tf.nest.map_structure(lambda t: t[start:stop], s) for s in (x, y))
    return x, y, batch


def check_arrays(x, y, what):
    """Raises ValueError unless every leaf of x and y is an array of one, nonzero length."""
    if y is None:
        raise ValueError(
            f"{what}: y is missing; give x and y arrays, or a dataset of (x, y) batches as x"
        )
    named = leaves(x, "x") + leaves(y, "y")
    for path, leaf in named:
        if np.ndim(leaf) == 0:
            raise ValueError(f"{what}: {path} needs an axis of examples, got a scalar")
    first_path, first = named[0][0], len(named[0][1])
    for path, leaf in named[1:]:
        if len(leaf) != first:
            raise ValueError(f"{what}: {first_path} has {first} examples but {path} has "
                             f"{len(leaf)}")
    if first == 0:
        raise ValueError(f"{what}: no examples ({first_path} is empty)")


def _arrays(x, y, sample_weight, what):
    """(x, targets with weights) as checked arrays (``check_arrays``)."""
    if y is None:
        check_arrays(x, None, what)  # raises: y is missing
    x, y = as_arrays(x), as_arrays(with_weights(y, sample_weight))
    check_arrays(x, y, what)
    return x, y


def numpy_batches(x, y, batch_size, order, skip, total_towers, drop_small):
    """Yields (x, y) batches of the examples in `order`, from batch `skip` on.

    With drop_small, a batch of fewer than total_towers examples ends the
    iteration (it could not give every tower an example).
    """
    count = len(order)
    for start in range(skip * batch_size, count, batch_size):
        index = order[start : start + batch_size]
        if drop_small and len(index) < total_towers:
            return
        yield tuple(tf.nest.map_structure(lambda a: a[index], s) for s in (x, y))


def split_shards(structures, num_towers, host, sizes=None):
    """Splits every [batch, ...] leaf of each structure into K contiguous shards on `host`.

    Args:
      structures: list of nested structures (inputs, targets) whose leaves
        share axis 0.
      num_towers: int K.
      host: str, the device where the batch is split.
      sizes: int32 [K] shard sizes, or None for the shard rule's of the batch.

    Returns:
      (sizes int32 [K], one list of K structures per given structure: shard
      k of every leaf, in the structure's shape).
    """
    with tf.device(host):
        if sizes is None:
            sizes = shard_sizes(tf.shape(tf.nest.flatten(structures[0])[0])[0], num_towers)
        out = []
        for structure in structures:
            parts = [tf.split(t, sizes, num=num_towers) for t in tf.nest.flatten(structure)]
            out.append([tf.nest.pack_sequence_as(structure, [p[k] for p in parts])
                        for k in range(num_towers)])
        return sizes, out


def dataset_batches(x, skip=0):
    """The (x, y) global batches of a tf.data.Dataset or keras.utils.PyDataset, from batch `skip`.

    Elements (x, y, sample_weight) come as (x, Weighted(y, sample_weight))."""
    if is_dataset(x):
        elements = iter(x.skip(skip))
    else:
        elements = (x[i] for i in range(skip, len(x)))
    for element in elements:
        inputs, targets, *weights = element
        yield inputs, with_weights(targets, weights[0] if weights else None)


def steps_per_epoch(x, batch_size, total_towers):
    """Training steps in one epoch; a last batch smaller than T is skipped.

    Raises:
      ValueError: x is an infinite dataset.
    """
    if isinstance(x, keras.utils.PyDataset):
        return len(x)
    if is_dataset(x):
        cardinality = int(x.cardinality())
        if cardinality == tf.data.INFINITE_CARDINALITY:
            raise ValueError(
                "fit: the dataset is infinite; give a finite dataset of global batches (one epoch)"
            )
        if cardinality == tf.data.UNKNOWN_CARDINALITY:
            # Counting once is the only way to know where an epoch ends,
            # which a resume needs to find its place.
            cardinality = sum(1 for _ in x)
        return cardinality
    full, rest = divmod(batch_size_of(x), batch_size)
    return full + (1 if rest >= total_towers else 0)


def _check_no_y(y, what, dataset=None, sample_weight=None):
    """Raises ValueError when y or sample weights are given beside a dataset, or its elements
    are not (x, y) or (x, y, sample_weight)."""
    if y is not None or sample_weight is not None:
        kind = "tf.data.Dataset" if is_dataset(dataset) else type(dataset).__name__
        raise ValueError(f"{what}: y and sample_weight must be None when x is a {kind} of "
                         f"(x, y) or (x, y, sample_weight) batches")
    spec = getattr(dataset, "element_spec", None)
    if not isinstance(spec, tuple) or len(spec) not in (2, 3):
        held = f"{len(spec)} items" if isinstance(spec, tuple) else type(spec).__name__
        if is_dataset(dataset):
            raise ValueError(f"{what}: the dataset's elements are {held}; give (x, y) or "
                             f"(x, y, sample_weight) global batches")


def _check_source(x, what):
    """Raises ValueError for input fit cannot read again each epoch: a generator or an iterator."""
    if isinstance(x, types.GeneratorType) or (hasattr(x, "__next__") and not is_batches(x)):
        raise ValueError(f"{what}: x is a {type(x).__name__}, which can be read only once; give "
                         f"a keras.utils.PyDataset (a length and batches by index) or a "
                         f"tf.data.Dataset (tf.data.Dataset.from_generator(...)) of global "
                         f"batches")


def fit_data(x, y, batch_size, total_towers, sample_weight=None):
    """Checks fit's training data; returns (x, y, steps per epoch).

    Arrays come back as np.ndarray leaves, y with the sample weights
    (``Weighted``); a dataset or PyDataset as given, with y None.

    Raises:
      ValueError: bad arrays or dataset, batch_size smaller than T, no
        batch of T examples, an infinite dataset, or a generator.
    """
    _check_source(x, "fit")
    if is_batches(x):
        _check_no_y(y, "fit", x, sample_weight)
    else:
        x, y = _arrays(x, y, sample_weight, "fit")
        if batch_size < total_towers:
            raise ValueError(
                f"fit: batch_size={batch_size} is smaller than the {total_towers} towers; "
                "every tower needs at "
                f"least one example, so use a batch_size of at least {total_towers}"
            )
    steps = steps_per_epoch(x, batch_size, total_towers)
    if steps == 0:
        raise ValueError(
            f"fit: no batch of at least {total_towers} examples (one per tower) in the "
            "training data"
        )
    return x, y, steps


def check_fit_arguments(epochs, validation_data, checkpoint_dir, verbose, logdir=None):
    """Checks what fit would otherwise find wrong only after an epoch of work.

    Raises:
      ValueError: epochs is not an int >= 1; validation_data is neither a
        dataset nor (x, y) arrays of one nonzero length; checkpoint_dir
        cannot be created (e.g. a file is in the way); logdir is a file;
        verbose is not 0, 1 or 2.
    """
    if isinstance(verbose, bool) or verbose not in (0, 1, 2):
        raise ValueError(f"fit: verbose must be 0 (silent), 1 (a progress bar) or 2 (one "
                         f"line per epoch), got {verbose!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"fit: epochs must be an int >= 1 (the epoch to train up to, "
                         f"counting restored ones), got {epochs!r}")
    if is_batches(validation_data):
        _check_no_y(None, "fit: validation_data", validation_data)
    elif validation_data is not None:
        if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
            raise ValueError("fit: validation_data must be (x, y) or (x, y, sample_weight) "
                             "arrays, or a tf.data.Dataset of such batches, got "
                             f"{type(validation_data).__name__}")
        x, y, *weights = validation_data
        check_arrays(as_arrays(x), as_arrays(with_weights(y, weights[0] if weights else None)),
                     "fit: validation_data")
    # Only a local file in the way is checked: TensorBoard's writer also
    # takes remote paths (gs://) that os.path cannot see.
    if logdir is not None and os.path.isfile(logdir):
        raise ValueError(f"fit: logdir {logdir!r} is a file: TensorBoard's summaries (and "
                         f"a profile's timeline) are written in a directory")
    if checkpoint_dir is not None:
        try:
            os.makedirs(checkpoint_dir, exist_ok=True)
        except OSError as error:
            raise ValueError(f"fit: checkpoint_dir {checkpoint_dir!r} cannot be created: "
                             f"{error.strerror or error}") from None


def eval_batches(x, y, batch_size, what, sample_weight=None):
    """(x, y) batches of a dataset, a PyDataset or of arrays in order, for evaluate.

    Raises:
      ValueError: y or weights given with a dataset, bad arrays, a generator.
    """
    _check_source(x, what)
    if is_batches(x):
        _check_no_y(y, what, x, sample_weight)
        return dataset_batches(x)
    x, y = _arrays(x, y, sample_weight, what)
    return numpy_batches(x, y, batch_size, np.arange(batch_size_of(x)), 0, 0, drop_small=False)


def input_batches(x, batch_size):
    """Input batches for predict: of arrays in order, or a dataset's (its y dropped)."""
    _check_source(x, "predict")
    if is_batches(x):
        elements = iter(x) if is_dataset(x) else (x[i] for i in range(len(x)))
        return (b[0] if isinstance(b, tuple) else b for b in elements)
    x = as_arrays(x)
    return (tf.nest.map_structure(lambda a: a[i:i + batch_size], x)
            for i in range(0, batch_size_of(x), batch_size))
