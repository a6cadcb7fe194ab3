"""The optimizers' state in a checkpoint layout that depends on neither K nor the ZeRO stage.

Every slot of every trainable variable (Adam's momentum and velocity, ...)
is written as one 1-D tensor of the variable's element count, under the key
``trainable<n>_<slot>`` (n: the variable's place among the model's
trainable variables, as in the model's own entries), in slices: at zero_stage 0 tower 0 writes it
whole; with ZeRO each tower writes the range its piece holds
(trainer.zero). TensorFlow's checkpoint format keeps the slices of one
tensor (the slice specs its partitioned variables use) and reads any range
of it back, whichever slices wrote it: a run resumes at any number of towers
and at any stage, each tower reading its own range. The optimizer's other
variables (iteration count, learning rate, loss scale, and any state that
is not one slot per variable) are written whole, from tower 0, under
``<i>_<name>``, and read into every optimizer.

A Keras slot is found by its name: ``add_variable_from_reference`` names it
after the path of the variable it was made for ("/" written "_"), then the
slot's own name ("momentum").
"""

import tensorflow as tf

from tfreduce.collectives import all_gather, broadcast


class OptimizerState(tf.__internal__.tracking.Trackable):
    """The checkpointed state of the towers' optimizers (a tf.train.Checkpoint entry).

    Args:
      optimizers: the optimizers that write and read it (tower 0's alone at
        zero_stage 0, every tower's with ZeRO).
      references: for each of them, the N variables it was built on.
      ranges: for each of them, N (start, length): the elements of each
        flattened variable those references hold.
      variables: the N trainable variables of tower 0 (their element counts).
    """

    def __init__(self, optimizers, references, ranges, variables):
        self._sizes = [int(v.shape.num_elements()) for v in variables]
        self._slots = {}  # key -> [(variable n, slot variable, start)], one per optimizer
        self._scalars = {}  # key -> [the variable on each optimizer]
        self._whole = None  # key -> the whole tensor, while a gathered state is written
        for optimizer, refs, spans in zip(optimizers, references, ranges):
            scalars = 0
            for v in optimizer.variables:
                n, kind = _owner(v, refs)
                if n is None:
                    key = f"{scalars}_{v.name}"
                    scalars += 1
                    self._scalars.setdefault(key, []).append(v)
                    continue
                key = f"trainable{n}_{kind}"
                self._slots.setdefault(key, []).append((n, v, spans[n][0]))

    def _serialize_to_tensors(self):
        # tf.train.Checkpoint's hook for objects that write their own
        # tensors; {key: {slice spec: tensor}} writes slices of one tensor.
        out = {key: tf.convert_to_tensor(found[0]) for key, found in self._scalars.items()}
        if self._whole is not None:
            for key, pieces in self._slots.items():
                size = self._sizes[pieces[0][0]]
                if size:
                    out[key] = {f"{size} 0,{size}": self._whole[key]}
            return out
        for key, pieces in self._slots.items():
            slices = {}
            for n, v, start in pieces:
                length = int(v.shape.num_elements())
                if length:
                    spec = f"{self._sizes[n]} {start},{length}"
                    slices[spec] = tf.reshape(tf.convert_to_tensor(v), [-1])
            if slices:
                out[key] = slices
        return out

    def read(self, prefix, whole=False, entry="optimizer_state"):
        """Reads this run's ranges of the state from checkpoint `prefix`.

        Read with RestoreV2 and the ranges' own slice specs rather than
        through tf.train.Checkpoint, whose restore of an object's tensors
        takes one slice per key: a worker with several pieces of one
        variable reads them all here.

        Args:
          prefix: str, the checkpoint.
          whole: bool, read every slot whole and keep it for ``scatter``
            (rank 0 of a cluster whose other workers hold shards too).
          entry: str, the name this state has in the tf.train.Checkpoint.

        Returns:
          {key: tensor} of every entry, whole, when ``whole``; else None.

        Raises:
          tf.errors.NotFoundError: the checkpoint lacks an entry (another
            optimizer or model).
        """
        names, specs, dtypes, targets = [], [], [], []
        for key, found in self._scalars.items():
            names.append(key)
            specs.append("")
            dtypes.append(tf.as_dtype(found[0].dtype))
            targets.append(found)
        for key, pieces in self._slots.items():
            for n, v, start in pieces[:1] if whole else pieces:
                length = self._sizes[n] if whole else int(v.shape.num_elements())
                if length:
                    names.append(key)
                    specs.append(f"{self._sizes[n]} {0 if whole else start},{length}")
                    dtypes.append(tf.as_dtype(v.dtype))
                    targets.append([v])
        if not names:
            return {} if whole else None
        with tf.device("/device:CPU:0"):
            values = tf.raw_ops.RestoreV2(
                prefix=prefix, tensor_names=[f"{entry}/.ATTRIBUTES/{n}" for n in names],
                shape_and_slices=specs, dtypes=dtypes)
        if whole:
            return dict(zip(names, values))
        for found, value in zip(targets, values):
            for v in found:
                v.assign(tf.reshape(value, v.shape))
        return None

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

    def scatter(self, whole, devices, reduction, cluster):
        """Every tower takes its ranges of rank 0's state (after rank 0 read it whole).

        Call it on every worker: rank 0 with ``read(prefix, whole=True)``'s
        result, the others with None.

        Args:
          whole: {key: tensor} on rank 0, None on the other workers.
          devices, reduction, cluster: as ``gather``.
        """
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


def _owner(variable, references):
    """(n, slot name) of an optimizer variable made for references[n], or (None, None)."""
    best = None
    for n, ref in enumerate(references):
        prefix = ref.path.replace("/", "_") + "_"
        if variable.name.startswith(prefix) and (best is None or len(prefix) > best[1]):
            best = (n, len(prefix))
    if best is None or tuple(variable.shape) != tuple(references[best[0]].shape):
        return None, None  # not a slot of one variable: written whole
    return best[0], variable.name[best[1]:]
