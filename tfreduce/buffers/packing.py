"""Packing (tensor fusion): many small gradients into a few flat buffers.

An all-reduce pays a fixed cost per tensor (op launch, a copy's set-up, a
kernel on every device) on top of its bytes. Models have hundreds of small
tensors (biases, BatchNorm scales), so the reduction of N tensors is cheaper
as the reduction of a few large buffers: Horovod's fusion buffer, MegEngine's
param_pack and PyTorch DDP's gradient buckets all do this.

``PackPlan`` groups the dense gradients of one dtype into buffers
("buckets") of about ``pack_bytes`` bytes, in backward order: the reverse
of the variables' order, which is the order a backward pass produces
them (the last layer's first), as DDP forms its buckets (Li et al., 2020,
arXiv 2006.15704). Each buffer's reduction depends only on its own
gradients, so the first buffers are reduced while the backward pass still
computes the gradients of the earlier layers. Each tower concatenates its
flattened gradients into the buffers on its own device, the buffers are
all-reduced, and each tower splits them back on its own device. Gradients
with an unknown static shape, ``tf.IndexedSlices`` and gradients larger
than ``pack_bytes`` pass through unpacked, as buffers of their own.

Unpacking is free where TensorFlow allows: a split or slice along the
first axis hands out pieces of its input without a copy when every piece
starts and ends on a multiple of ``ALIGN_BYTES`` (EIGEN_MAX_ALIGN_BYTES; one
other piece makes a whole split copy). So a buffer holds first the
gradients whose size is a multiple of 64 bytes, each then at a 64-byte
offset, then the others (``buffer_order``): a slice and a split hand out the
aligned ones free, and only the others, which no layout could hand out
free, are copied (a slice of the tail and its split).
"""

import itertools

import tensorflow as tf

# The default lives with the other command-line choices, known without TensorFlow.
from tfreduce.basis.choices import DEFAULT_PACK_BYTES
from tfreduce.basis.contract import nbytes

__all__ = ["ALIGN_BYTES", "DEFAULT_PACK_BYTES", "PackPlan", "buffer_order", "check_pack_bytes",
           "hands_out_slices"]

#: Bytes of the alignment TensorFlow's split and slice kernels need to hand
#: out a piece of their input without a copy (EIGEN_MAX_ALIGN_BYTES in TF's
#: builds; IsDim0SliceAligned, tensorflow/core/framework/ops_util.h).
ALIGN_BYTES = 64


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


def buffer_order(members, nbytes_of):
    """The order of gradients in one flat buffer: 64-byte multiples first, each part in order.

    Args:
      members: list of variable indices, in the order they are added.
      nbytes_of: fn(n) -> int bytes of variable n's gradient.

    Returns:
      list of the same indices.
    """
    return sorted(members, key=lambda n: not _aligned(nbytes_of(n)))


def _aligned(size):
    # A piece of ``size`` bytes keeps the next one at a 64-byte offset.
    return size % ALIGN_BYTES == 0


class PackPlan:
    """How the N gradients of a K x N list map onto M reduction entries.

    Args:
      grads: contract.Gradients, the validated K x N input.
      pack_bytes: int >= 0 or None (checked by the caller,
        ``check_pack_bytes``); buffer size in bytes, counting the gradients'
        bytes (not the padding). None or 0 packs nothing.

    Attributes:
      entries: list of lists of int; entry m holds the variable indices packed
        into buffer m, in their order in the buffer (one index for a gradient
        passed through). Entries are in backward order: entry 0 holds the
        last variables.
    """

    def __init__(self, grads, pack_bytes):
        self._grads = grads
        self.entries = []
        open_buffers = {}  # dtype -> (entry index, bytes so far)
        for n in reversed(grads.reduced):
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
        self.entries = [buffer_order(members, lambda n: nbytes(grads.grads[0][n]))
                        for members in self.entries]

    def _layout(self, members):
        # (element counts of the aligned members, of the others).
        g0 = self._grads.grads[0]
        counts = [(g0[n].shape.num_elements(), _aligned(nbytes(g0[n]))) for n in members]
        return [c for c, aligned in counts if aligned], [c for c, aligned in counts if not aligned]

    def pack(self):
        """Builds the K x M list of buffers, each on its tower's device.

        Returns:
          list of K lists of M tensors (or IndexedSlices passed through);
          a packed buffer is 1-D, its gradients flattened in entry order.
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
                    parts = self._split(reduced[k][m], members, f"dev{k}_unpack{m}")
                    for n, part in zip(members, parts):
                        shape = g.grads[0][n].shape
                        out[k][n] = part if shape.rank == 1 else tf.reshape(part, shape)
        return out

    def _split(self, buffer, members, name):
        # The flat pieces of one buffer: the aligned head sliced and split
        # without a copy, the tail sliced and split with one.
        aligned, others = self._layout(members)
        if not aligned or not others:
            return tf.split(buffer, aligned + others, name=name)
        head = sum(aligned)
        parts = tf.split(tf.slice(buffer, [0], [head], name=f"{name}_head"), aligned, name=name)
        tail = tf.slice(buffer, [head], [sum(others)], name=f"{name}_tail_slice")
        return parts + tf.split(tail, others, name=f"{name}_tail")


# Split and SplitV into one piece forward their input; splits (and slices)
# along the first axis hand out slices of the input buffer without copying
# when every piece starts and ends on a multiple of EIGEN_MAX_ALIGN_BYTES (64
# in TF's builds); otherwise they copy (split_v_op.cc, slice_op.cc;
# IsDim0SliceAligned and IsInnerDimsSizeAligned, ops_util.h).
SLICING_OPS = frozenset({"Split", "SplitV", "Unpack", "Slice"})


def hands_out_slices(op):
    """True for a split along axis 0 whose pieces TF hands out as aligned slices."""
    if op.type not in SLICING_OPS:
        return False
    if op.type == "Slice":
        return _slice_is_aligned(op)
    if op.type != "Unpack" and len(op.outputs) == 1:
        return True  # a split into one piece forwards its input
    if op.type == "Unpack":
        value, axis = op.inputs[0], op.get_attr("axis")
    else:
        value = op.inputs[1] if op.type == "Split" else op.inputs[0]
        axis = tf.get_static_value(op.inputs[0] if op.type == "Split" else op.inputs[2])
    shape = value.shape
    if axis is None or shape.rank is None or not shape.is_fully_defined() or shape.rank == 0:
        return False
    if int(axis) % shape.rank != 0 or shape[0] == 0:
        return False
    itemsize = value.dtype.size
    if shape.rank > 1 or op.type == "Unpack":
        return shape.num_elements() // shape[0] * itemsize % ALIGN_BYTES == 0
    sizes = [t.shape.num_elements() for t in op.outputs]
    if None in sizes:
        return False
    return all(start * itemsize % ALIGN_BYTES == 0 for start in itertools.accumulate([0] + sizes))


def _flat(tensor):
    return tensor if tensor.shape.rank == 1 else tf.reshape(tensor, [-1])


def _slice_is_aligned(op):
    # A slice of a 1-D buffer starting and ending at 64-byte multiples (as
    # PackPlan's head), which TF's SliceOp hands out without a copy.
    value = op.inputs[0]
    begin, size = (tf.get_static_value(t) for t in op.inputs[1:3])
    if value.shape.rank != 1 or begin is None or size is None:
        return False
    itemsize = value.dtype.size
    return all(int(x[0]) * itemsize % ALIGN_BYTES == 0 for x in (begin, size))
