"""DistributedBatches: this process's part of every global batch, for model.fit and evaluate.

With one process per device, every process must feed its own part of each
global batch, and the same number of batches. ``DistributedBatches`` is a
``keras.utils.PyDataset`` with the semantics of PyTorch's
``DistributedSampler``, minus the call users forget:

- each epoch is a permutation of all examples drawn from (seed, epoch), so
  there is no ``set_epoch``: with ``BroadcastGlobalVariablesCallback`` in
  ``fit``'s callbacks (every such script has it) the epoch is ``fit``'s own,
  a resumed run's included; without it, it advances by itself at every
  epoch's start from ``initial_epoch``;
- the permutation is cut into global batches of ``global_batch_size``, the
  same whatever the number of processes, and each global batch is split over
  the processes by tfreduce's shard rule (the first B % size parts one
  example larger; equal parts when B is a multiple of size, which makes the
  mean over processes of their mean losses the global batch's mean);
- the last, short global batch is dropped (``remainder="drop"``) or filled
  up from the start of the permutation (``"pad"``, as DistributedSampler
  does), every padded example weighted 0, so evaluation metrics count each
  example once;
- the batches come in their order whatever ``fit(shuffle=...)`` says: Keras
  would permute the batch indices with each process's own random state, and
  the processes would then take parts of different global batches. Each
  epoch takes them all: do not pass ``fit(steps_per_epoch=...)`` smaller
  than ``len()`` (Keras then keeps the iterator across epochs, and how far
  each process has read ahead differs).

In float64, Keras' PyDataset path differs from its array path by about
1e-8 (relative, measured on a dense model over 3 epochs): for float64 runs
that must match a reference to the last bits, feed arrays.

Source: PyTorch's torch.utils.data.distributed.DistributedSampler.
"""

import keras
import numpy as np

from tfreduce.basis.contract import shard_sizes

__all__ = ["DistributedBatches", "follow_fit_epoch"]

REMAINDERS = ("drop", "pad")

# fit's current epoch, set by BroadcastGlobalVariablesCallback while fit runs.
_FIT_EPOCH = [None]


def follow_fit_epoch(epoch):
    """Tells every DistributedBatches the epoch fit begins (None: no fit running)."""
    _FIT_EPOCH[0] = epoch


class DistributedBatches(keras.utils.PyDataset):
    """This process's part of every global batch of (x, y), reshuffled every epoch.

    Args:
      x: np.ndarray [n, ...] of inputs.
      y: np.ndarray [n, ...] of targets, or None.
      global_batch_size: int B >= size, the examples of one step over all
        processes.
      shuffle: bool, a new permutation every epoch (False: the data's order).
      seed: int, the permutations' seed; the same on every process.
      remainder: "drop" or "pad" (see the module docstring); "pad" yields
        (x, y, sample_weight) batches with weight 0 on padded examples.
      initial_epoch: int, the epoch of the first ``fit`` epoch when no
        BroadcastGlobalVariablesCallback gives fit's.
      rank: int, this process's rank (default: tfreduce.tensorflow.rank()).
      size: int, the number of processes (default: tfreduce.tensorflow.size()).

    Raises:
      ValueError: x and y of other lengths, a global batch smaller than the
        processes or larger than the data, a bad remainder or rank.
    """

    def __init__(self, x, y=None, global_batch_size=32, *, shuffle=True, seed=0,
                 remainder="drop", initial_epoch=0, rank=None, size=None):
        super().__init__()
        if rank is None or size is None:
            from tfreduce.tensorflow.process import rank as own_rank, size as own_size
            rank = own_rank() if rank is None else rank
            size = own_size() if size is None else size
        self.x, self.y = np.asarray(x), None if y is None else np.asarray(y)
        count = len(self.x)
        if self.y is not None and len(self.y) != count:
            raise ValueError(f"x has {count} examples and y {len(self.y)}: they must match")
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in 0..{size - 1}")
        if remainder not in REMAINDERS:
            raise ValueError(f"remainder must be 'drop' or 'pad', got {remainder!r}")
        if remainder == "pad" and self.y is None:
            raise ValueError("remainder='pad' weights the padding 0, which needs targets y: "
                             "Keras would read (x, weights) as (x, y)")
        if not size <= global_batch_size <= count:
            raise ValueError(f"global_batch_size {global_batch_size} must be at least the "
                             f"{size} processes and at most the {count} examples")
        self.global_batch_size, self.shuffle, self.seed = global_batch_size, shuffle, seed
        self.remainder, self.rank, self.size = remainder, rank, size
        self.epoch = initial_epoch - 1  # on_epoch_begin moves it to initial_epoch
        self._position = None  # the next batch once an epoch has begun
        sizes = shard_sizes(global_batch_size, size)
        self._start, self._stop = sum(sizes[:rank]), sum(sizes[:rank + 1])

    def __len__(self):
        """The number of global batches of an epoch, the same on every process."""
        full, rest = divmod(len(self.x), self.global_batch_size)
        return full + (1 if rest and self.remainder == "pad" else 0)

    def on_epoch_begin(self):
        self.epoch = self.epoch + 1 if _FIT_EPOCH[0] is None else _FIT_EPOCH[0]
        self._position = 0

    def order(self, epoch=None):
        """The epoch's order of the examples, np.ndarray [n] (the same on every process)."""
        epoch = max(self.epoch, 0) if epoch is None else epoch
        if not self.shuffle:
            return np.arange(len(self.x))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.x))

    def __getitem__(self, index):
        """Batch `index` before an epoch begins (Keras' look at the shapes), else the next one."""
        if self._position is not None:
            index, self._position = self._position, (self._position + 1) % len(self)
        order = self.order()
        batch = np.arange(index * self.global_batch_size, (index + 1) * self.global_batch_size)
        mine = batch[self._start:self._stop]
        real = mine < len(order)
        rows = order[mine % len(order)]  # padded from the start of the permutation
        parts = [self.x[rows]] + ([] if self.y is None else [self.y[rows]])
        if self.remainder == "pad":
            parts.append(real.astype(np.float32))
        return tuple(parts) if len(parts) > 1 else parts[0]
