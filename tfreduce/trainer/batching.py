"""Global batches: checking them, cutting arrays into them, a worker's part.

A global batch is what one step trains on, split over the T = W * K towers
of all W workers. Arrays are cut into global batches here; a tf.data.Dataset
must yield them. In a cluster every worker is given the same global batch
and keeps its own part (tfreduce.Cluster.batch_slice), which its K towers
split again by the same rule (tfreduce.basis.contract.shard_sizes).
"""

import os

import numpy as np
import tensorflow as tf


def is_dataset(x):
    """True for a tf.data.Dataset, False for arrays."""
    return isinstance(x, tf.data.Dataset)


def check_batch(x, y, what):
    """Converts a global batch to tensors and checks it can be split.

    Raises:
      ValueError: x or y has no batch axis, or they differ in batch size.
    """
    x = tf.convert_to_tensor(x)
    y = tf.convert_to_tensor(y)
    if x.shape.rank == 0 or y.shape.rank == 0:
        raise ValueError(f"{what}: x and y need a batch axis, got x {x.shape} and y {y.shape}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{what}: x has {x.shape[0]} examples but y has {y.shape[0]}")
    return x, y


def worker_batch(x, y, cluster, num_devices, total_towers, class_indices=False,
                 shards_per_worker=None):
    """This worker's part of a checked global batch, for one training step.

    Args:
      x, y: tf.Tensor or np.ndarray [batch, ...], the global batch.
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
      ValueError: x and y disagree on the batch size, B is smaller than the
        T = W * K towers, or y holds fractional class indices.
    """
    x, y = check_batch(x, y, "train_step")
    if class_indices and y.dtype.is_floating:
        values = y.numpy()
        fractional = values[values != np.round(values)]
        if fractional.size:
            raise ValueError(
                f"train_step: the loss takes class indices, but y holds "
                f"{float(fractional.flat[0]):g}; give whole-number labels, or a loss for "
                f"soft labels such as keras.losses.CategoricalCrossentropy")
    batch = int(x.shape[0])
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
        x, y = x[start:stop], y[start:stop]
    return x, y, batch


def check_arrays(x, y, what):
    """Raises ValueError unless x and y are arrays of the same, nonzero length."""
    if y is None:
        raise ValueError(
            f"{what}: y is missing; give x and y arrays, or a dataset of (x, y) batches as x"
        )
    if len(x) != len(y):
        raise ValueError(f"{what}: x has {len(x)} examples but y has {len(y)}")
    if len(x) == 0:
        raise ValueError(f"{what}: no examples (x is empty)")


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
        yield x[index], y[index]


def steps_per_epoch(x, batch_size, total_towers):
    """Training steps in one epoch; a last batch smaller than T is skipped.

    Raises:
      ValueError: x is an infinite dataset.
    """
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
    full, rest = divmod(len(x), batch_size)
    return full + (1 if rest >= total_towers else 0)


def _check_no_y(y, what, dataset=None):
    """Raises ValueError when y is given beside a dataset x, or its elements are not (x, y)."""
    if y is not None:
        raise ValueError(f"{what}: y must be None when x is a tf.data.Dataset of (x, y) batches")
    spec = getattr(dataset, "element_spec", None)
    if isinstance(spec, tuple) and len(spec) != 2:
        raise ValueError(
            f"{what}: the dataset's elements hold {len(spec)} items (Keras' (x, y, "
            f"sample_weight)?); ReplicatedTrainer takes (x, y) batches and no sample weights: "
            f"weigh the examples in the loss, or drop the third: "
            f"dataset.map(lambda x, y, w: (x, y))")


def fit_data(x, y, batch_size, total_towers):
    """Checks fit's training data; returns (x, y, steps per epoch).

    Arrays come back as np.ndarray; a dataset as given, with y None.

    Raises:
      ValueError: bad arrays or dataset, batch_size smaller than T, no
        batch of T examples, or an infinite dataset.
    """
    if is_dataset(x):
        _check_no_y(y, "fit", x)
    else:
        check_arrays(x, y, "fit")
        x, y = np.asarray(x), np.asarray(y)
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
    if is_dataset(validation_data):
        _check_no_y(None, "fit: validation_data", validation_data)
    elif validation_data is not None:
        if not isinstance(validation_data, (tuple, list)) or len(validation_data) != 2:
            raise ValueError("fit: validation_data must be (x, y) arrays or a "
                             "tf.data.Dataset of (x, y) batches, got "
                             f"{type(validation_data).__name__}")
        check_arrays(*validation_data, "fit: validation_data")
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


def eval_batches(x, y, batch_size, what):
    """(x, y) batches of a dataset or of arrays in order, for evaluate.

    Raises:
      ValueError: y given with a dataset, or bad arrays.
    """
    if is_dataset(x):
        _check_no_y(y, what, x)
        return iter(x)
    check_arrays(x, y, what)
    return numpy_batches(x, y, batch_size, np.arange(len(x)), 0, 0, drop_small=False)


def input_batches(x, batch_size):
    """Input batches for predict: of arrays in order, or a dataset's (its y dropped)."""
    if is_dataset(x):
        return (b[0] if isinstance(b, tuple) else b for b in x)
    x = np.asarray(x)
    return (x[i : i + batch_size] for i in range(0, len(x), batch_size))
