"""The optimizers' state in a checkpoint layout that depends on neither K nor the ZeRO stage.

Every slot of every trainable variable (Adam's momentum and velocity, ...)
is written as one 1-D tensor of the variable's element count, under the key
``trainable<n>_<slot>`` (n: the variable's place among the model's
trainable variables, as in the model's own entries): at zero_stage 0 tower
0's slot, with ZeRO the towers' pieces joined in element order
(trainer.zero). A restore reads each slot whole and hands every tower the
range its piece holds: a run resumes at any number of towers and at any
stage. The optimizer's other variables (iteration count, learning rate,
loss scale, and any state that is not one slot per variable) are written
whole, from tower 0, under ``<i>_<name>``, and read into every optimizer.

Both go through tf.train.Checkpoint (``_serialize_to_tensors`` and
``_restore_from_tensors``), so the checkpoint's object graph accounts for
every value: TensorFlow reports nothing left unrestored (across workers,
rank 0 reads the slots itself, ``read_whole``, and sends each tower its
ranges, ``scatter``). Each key is one
slice, the whole tensor ("<size> 0,<size>"): TensorFlow's restore of an
object's tensors pairs one slice with each key and mislabels the others.
Checkpoints written in pieces (one slice per tower, before) read back
whole all the same.

A Keras slot is found by its name: ``add_variable_from_reference`` names it
after the path of the variable it was made for ("/" written "_"), then the
slot's own name ("momentum").
"""

import tensorflow as tf
from tensorflow.python.training.saving.saveable_object import SaveSpec

from tfreduce.basis import kerases
from tfreduce.doors.collectives import all_gather, broadcast


class OptimizerState(tf.__internal__.tracking.Trackable):
    """The checkpointed state of the towers' optimizers (a tf.train.Checkpoint entry).

    Args:
      optimizers: the optimizers that write and read it (tower 0's alone at
        zero_stage 0, every tower's with ZeRO).
      references: for each of them, the N variables it was built on.
      ranges: for each of them, N (start, length): the elements of each
        flattened variable those references hold.
      variables: the N trainable variables of tower 0 (their element counts).
      across: bool, the optimizers are this worker's share of a cluster's
        (ZeRO across workers): a save writes the slots ``gather`` made; a
        restore reads the scalars, and rank 0 the slots with
        ``read_whole``, for ``scatter``.
    """

    def __init__(self, optimizers, references, ranges, variables, across=False):
        self._sizes = [int(v.shape.num_elements()) for v in variables]
        self.across = across
        self._slots = {}  # key -> [(variable n, slot variable, start)], one per optimizer
        self._scalars = {}  # key -> [the variable on each optimizer]
        self._whole = None  # key -> the whole tensor, while a gathered state is written
        self._received = None  # key -> the whole tensor a restore read, until scatter
        for optimizer, refs, spans in zip(optimizers, references, ranges):
            scalars = 0
            for v in optimizer.variables:
                n, kind = kerases.slot_of(v, refs)
                if n is None:
                    key = f"{scalars}_{v.name}"
                    scalars += 1
                    self._scalars.setdefault(key, []).append(v)
                    continue
                key = f"trainable{n}_{kind}"
                self._slots.setdefault(key, []).append((n, v, spans[n][0]))

    def _serialize_to_tensors(self):
        # tf.train.Checkpoint's hook for objects that write their own
        # tensors, on save and (for the keys, slices and dtypes) on restore.
        # A slot is a SaveSpec whose tensor is made only when a save writes
        # it: a restore builds no whole slot from the pieces.
        out = {key: tf.convert_to_tensor(found[0]) for key, found in self._scalars.items()}
        if self.across and self._whole is None:
            # A restore across workers: rank 0 reads the slots whole for
            # ``scatter`` (read_whole), outside the restore, which may run
            # in a tf.function whose tensors cannot be kept.
            return out
        for key, pieces in self._slots.items():
            size = self._sizes[pieces[0][0]]
            if size:  # a variable of no elements has no entry
                spec = f"{size} 0,{size}"
                # On its variables' task: TensorFlow restores the tensors of one
                # task eagerly, of several inside a tf.function.
                out[key] = {spec: SaveSpec(lambda key=key: self._joined(key), spec, key,
                                           dtype=pieces[0][1].dtype,
                                           device=_device(pieces[0][1]))}
        return out

    def _joined(self, key):
        # The whole slot: gathered across workers, else this process's
        # pieces (every tower's) in element order.
        if self._whole is not None:
            return self._whole[key]
        pieces = sorted(self._slots[key], key=lambda piece: piece[2])
        with tf.device("/device:CPU:0"):
            return tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for _, v, _ in pieces],
                             axis=0)

    def _restore_from_tensors(self, restored_tensors):
        # {key: tensor, or {slice spec: tensor}}: every key this state has,
        # each slot whole (TensorFlow has raised NotFoundError for a missing one).
        values = {key: next(iter(value.values())) if isinstance(value, dict) else value
                  for key, value in restored_tensors.items()}
        for key, found in self._scalars.items():
            for v in found:
                v.assign(tf.reshape(values[key], v.shape))
        for key, pieces in self._slots.items():
            if key not in values:
                continue  # across workers: read_whole and scatter
            for _, v, start in pieces:
                length = int(v.shape.num_elements())
                if length:
                    v.assign(tf.reshape(values[key][start:start + length], v.shape))

    def read_whole(self, prefix, entry="optimizer_state"):
        """Reads every entry whole from checkpoint `prefix` and keeps it for ``scatter``.

        Rank 0 of a cluster whose other workers hold shards too (``across``).

        Args:
          prefix: str, the checkpoint.
          entry: str, the name this state has in the tf.train.Checkpoint.

        Raises:
          tf.errors.NotFoundError: the checkpoint lacks an entry (another
            optimizer or model).
        """
        entries = [(key, dtype, shape) for key, dtype, shape in self._shapes()
                   if shape != [0]]  # a variable of no elements has no entry
        specs = ["" if key in self._scalars else f"{shape[0]} 0,{shape[0]}"
                 for key, _, shape in entries]
        with tf.device("/device:CPU:0"):
            values = tf.raw_ops.RestoreV2(
                prefix=prefix, tensor_names=[f"{entry}/.ATTRIBUTES/{key}" for key, _, _ in entries],
                shape_and_slices=specs, dtypes=[tf.as_dtype(dtype) for _, dtype, _ in entries])
        self._received = {key: value for (key, _, _), value in zip(entries, values)}

    def _shapes(self):
        # (key, dtype, whole shape) of every entry, in one order on every worker.
        out = [(key, found[0].dtype, [1]) for key, found in self._scalars.items()]
        return out + [(key, pieces[0][1].dtype, [self._sizes[pieces[0][0]]])
                      for key, pieces in self._slots.items()]

    def gather(self, devices, reduction, cluster):
        """Every slot whole on this worker, from every tower's pieces (before rank 0 writes).

        ZeRO across workers: each worker holds its own towers' pieces, and
        pieces of one variable in tower order join into the whole slot. Call
        it on every worker; ``_serialize_to_tensors`` then writes the whole
        slots, once, until ``release``.

        Args:
          devices: list of K canonical devices, the optimizers' towers.
          reduction: the uncompressed tfreduce.Reduction of the trainer.
          cluster: the started tfreduce.Cluster.
        """
        rows = []
        for k, device in enumerate(devices):
            with tf.device(device):
                rows.append([tf.reshape(tf.convert_to_tensor(pieces[k][1]), [-1])
                             for pieces in self._slots.values()])
        gathered = all_gather(rows, devices, reduction=reduction, cluster=cluster)
        self._whole = dict(zip(self._slots, gathered[0]))

    def release(self):
        """Drops the whole slots ``gather`` made (after the save)."""
        self._whole = None

    def scatter(self, devices, reduction, cluster):
        """Every tower takes its ranges of rank 0's state (after rank 0's restore read it whole).

        Call it on every worker once a restore has read the checkpoint on
        rank 0 (the others read nothing): rank 0 sends what it read.

        Args:
          devices, reduction, cluster: as ``gather``.
        """
        whole, self._received = self._received, None
        entries = self._shapes()
        rows = []
        for k, device in enumerate(devices):
            with tf.device(device):
                # A variable of no elements has no entry to read.
                rows.append([tf.reshape(whole[key], shape) if k == 0 and key in (whole or {})
                             else tf.zeros(shape, dtype) for key, dtype, shape in entries])
        got = broadcast(rows, devices, root=0, reduction=reduction, cluster=cluster)
        for k, device in enumerate(devices):
            values = dict(zip([key for key, _, _ in entries], got[k]))
            with tf.device(device):
                for key, found in self._scalars.items():
                    found[k].assign(tf.reshape(values[key], found[k].shape))
                for key, pieces in self._slots.items():
                    _, v, start = pieces[k]
                    length = int(v.shape.num_elements())
                    v.assign(values[key][start:start + length])

    def variables_held(self):
        """Every optimizer variable this state writes or reads."""
        found = [v for vs in self._scalars.values() for v in vs]
        return found + [v for pieces in self._slots.values() for _, v, _ in pieces]


def _device(variable):
    """The device of a Keras variable (its TensorFlow variable's)."""
    return kerases.tf_variable(variable).device



