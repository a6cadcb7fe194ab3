"""Packing (tensor fusion): many small gradients into a few flat buffers.

An all-reduce pays a fixed cost per tensor (op launch, a copy's set-up, a
kernel on every device) on top of its bytes. Models have hundreds of small
tensors (biases, BatchNorm scales), so the reduction of N tensors is cheaper
as the reduction of a few large buffers: Horovod's fusion buffer, MegEngine's
param_pack and PyTorch DDP's gradient buckets all do this.

``PackPlan`` groups the dense gradients of one dtype, in variable order, into
buffers of about ``pack_bytes`` bytes; each tower concatenates its flattened
gradients into the buffers on its own device, the buffers are all-reduced, and
each tower splits them back on its own device. Gradients with an unknown
static shape, ``tf.IndexedSlices`` and gradients larger than ``pack_bytes``
pass through unpacked.
"""

import tensorflow as tf

# The default lives with the other command-line choices, known without TensorFlow.
from tfreduce.choices import DEFAULT_PACK_BYTES
from tfreduce.contract import nbytes

__all__ = ["DEFAULT_PACK_BYTES", "PackPlan", "check_pack_bytes"]


def check_pack_bytes(pack_bytes):
    """Checks a ``pack_bytes`` option: an int number of bytes >= 0, or None.

    Raises:
      TypeError: if pack_bytes is not an int (bools included) or None.
      ValueError: if pack_bytes is negative.
    """
    if pack_bytes is not None and (isinstance(pack_bytes, bool)
                                   or not isinstance(pack_bytes, int)):
        raise TypeError(f"pack_bytes must be an int number of bytes or None, "
                        f"got {pack_bytes!r}")
    if pack_bytes is not None and pack_bytes < 0:
        raise ValueError(f"pack_bytes must be >= 0 bytes, got {pack_bytes}")


class PackPlan:
    """How the N gradients of a K x N list map onto M reduction entries.

    Args:
      grads: contract.Gradients, the validated K x N input.
      pack_bytes: int >= 0 or None (checked by the caller,
        ``check_pack_bytes``); buffer size in bytes. None or 0 packs nothing.

    Attributes:
      entries: list of lists of int; entry m holds the variable indices packed
        into buffer m (one index for a gradient passed through).
    """

    def __init__(self, grads, pack_bytes):
        self._grads = grads
        self.entries = []
        open_buffers = {}  # dtype -> (entry index, bytes so far)
        for n in grads.reduced:
            g = grads.grads[0][n]
            size = nbytes(g)
            # Only shapes known on every tower: a flat buffer cut at tower 0's
            # static sizes would silently reshape another tower's gradient.
            packable = (pack_bytes and isinstance(g, tf.Tensor) and grads.static(n)
                        and size < pack_bytes)
            if not packable:
                self.entries.append([n])
                continue
            current = open_buffers.get(g.dtype)
            if current is None or current[1] + size > pack_bytes:
                open_buffers[g.dtype] = (len(self.entries), size)
                self.entries.append([n])
            else:
                m, used = current
                self.entries[m].append(n)
                open_buffers[g.dtype] = (m, used + size)

    def pack(self):
        """Builds the K x M list of buffers, each on its tower's device.

        Returns:
          list of K lists of M tensors (or IndexedSlices passed through).
        """
        g = self._grads
        out = []
        for k in range(g.num_towers):
            row = []
            with tf.device(g.devices[k]):
                for m, members in enumerate(self.entries):
                    if len(members) == 1:
                        row.append(g.grads[k][members[0]])
                        continue
                    # A 1-D gradient (bias, BatchNorm scale: most small
                    # tensors) goes in as it is: no reshape op per tensor.
                    flat = [_flat(g.grads[k][n]) for n in members]
                    row.append(tf.concat(flat, axis=0, name=f"dev{k}_pack{m}"))
            out.append(row)
        return out

    def unpack(self, reduced):
        """Splits the reduced K x M buffers back into K x N gradients.

        Args:
          reduced: list of K lists of M reduced entries, entry [k][m] on
            device k.

        Returns:
          list of K lists of N; None where the input was None on every tower.
        """
        g = self._grads
        out = g.empty_output()
        for k in range(g.num_towers):
            with tf.device(g.devices[k]):
                for m, members in enumerate(self.entries):
                    if len(members) == 1:
                        out[k][members[0]] = reduced[k][m]
                        continue
                    shapes = [g.grads[0][n].shape for n in members]
                    parts = tf.split(reduced[k][m], [s.num_elements() for s in shapes],
                                     name=f"dev{k}_unpack{m}")
                    for n, part, shape in zip(members, parts, shapes):
                        out[k][n] = part if shape.rank == 1 else tf.reshape(part, shape)
        return out


def _flat(tensor):
    return tensor if tensor.shape.rank == 1 else tf.reshape(tensor, [-1])
