"""The contract of a stage: one algorithm over packed dense buffers.

An algorithm is a ``Stage``: it only reduces packed dense buffers; the frame
(``tfreduce.algorithms.frame``) checks, packs, densifies and unpacks around it, so all
algorithms behave the same. The stage contract, tower-major like the public
API::

    buffers[k][m]   entry m as tower k holds it: a dense tf.Tensor on
                    devices[k]; an entry has one shape and dtype on every tower
    out = stage.reduce(buffers, ctx)
    out[k][m]       the sum (or mean) of entry m over the stage's towers,
                    placed on devices[k], of dtype ctx.dtypes[m]

The other collectives (``tfreduce.doors.collectives``) are methods of the same
stage, on unpacked dense tensors of one group of towers, K x M in the same
orientation: ``reduce_scatter``, ``all_gather``, ``broadcast``,
``reduce_to_root`` and ``all_to_all``. An algorithm lists the ones it builds
in ``collectives``; a door refuses the others with a ValueError that names
the algorithms that can. All-to-all is point to point (each piece one copy from
its tower to its destination) unless a stage builds it otherwise.
"""

import tensorflow as tf

from tfreduce.blocks.primitives import concat_rows, finish_sum

__all__ = ["Stage", "ReduceContext"]


class Stage:
    """One reduction algorithm over packed dense buffers (see the module docstring).

    Subclasses set their options once, in the constructor (which checks
    them), and implement ``reduce``.

    Attributes:
      name: str, the algorithm's name; ``allreduce_<name>`` is its name scope.
      collective: bool, the K ops of one entry wait for each other (NCCL, TF
        collective ops): every one of them must run.
      needs_function: bool, eagerly the frame builds and runs the whole call
        in one tf.function (TF collective ops).
    """

    name = None
    collective = False
    needs_function = False

    #: dtypes the stage's engine can sum, or None for every floating-point
    #: and integer dtype (add_n's).
    dtypes = None

    @classmethod
    def plan_options(cls, num_devices):
        """The option sets ``algorithm="auto"`` with a topology costs for K devices.

        The planner (planner.py) builds this stage once per option set, and
        per pack size, on the devices of the call; a set that ``bind``
        refuses there (NCCL off GPUs) is left out.

        Args:
          num_devices: int K >= 1.

        Returns:
          list of dicts of the constructor's options; [{}] (the defaults)
          unless a stage has options worth comparing.
        """
        return [{}]

    def bind(self, devices):
        """Checks the options against the K canonical devices, before any op is built.

        Returns:
          Stage, the one to run (self, or a copy with options resolved for K).

        Raises:
          ValueError: devices this stage cannot use, or options that do not
            fit K.
        """
        return self

    def gather(self, slices, device, average, m):
        """The later stage of a composition: gathers a ``tf.IndexedSlices`` further.

        The frame gathers the K towers' rows of a sparse entry on one device;
        a later stage (across workers) gathers those further and scales them.

        Args:
          slices: tf.IndexedSlices on ``device``, the rows of this stage's
            members gathered so far.
          device: str.
          average: bool, scale the values by 1/T of all towers.
          m: int, the entry, for op names.

        Returns:
          tf.IndexedSlices on ``device``.
        """
        raise NotImplementedError(f"stage {self.name!r} cannot follow another stage")

    def reduce(self, buffers, ctx):
        """Reduces K x M dense buffers.

        Args:
          buffers: list of K lists of M tf.Tensor, ``buffers[k][m]`` on
            ``ctx.devices[k]``.
          ctx: ReduceContext.

        Returns:
          list of K lists of M tf.Tensor, ``out[k][m]`` on ``ctx.devices[k]``.
        """
        raise NotImplementedError

    #: The collectives besides all-reduce this stage builds (names of
    #: ``tfreduce.doors.collectives.COLLECTIVES``); a door refuses the others.
    collectives = ()

    #: all_gather takes ``tf.IndexedSlices`` as rows (each tower's indices
    #: shifted by the rows before it), which needs every tower's row count.
    gathers_slices = True

    def pieces_per_tower(self, group_size):
        """The pieces each tower's rows are split into for an all-to-all: one per tower."""
        return group_size

    def reduce_scatter(self, buffers, ctx):
        """Sums K x M tensors and leaves shard k of each sum on device k.

        Args:
          buffers: list of K lists of M dense tf.Tensor of rank >= 1,
            ``buffers[k][m]`` on ``ctx.devices[k]``, one shape per entry.
          ctx: ReduceContext.

        Returns:
          list of K lists of M, ``out[k][m]`` the rows of shard k
          (``contract.shard_sizes`` of the rows over K) of the sum (mean) of
          entry m, of dtype ``ctx.dtypes[m]``, on ``ctx.devices[k]``.
        """
        raise NotImplementedError

    def all_gather(self, buffers, ctx):
        """Concatenates the K towers' tensors along axis 0 on every device.

        Args:
          buffers: list of K lists of M dense tf.Tensor of rank >= 1; the
            towers' row counts may differ, the other axes agree.
          ctx: ReduceContext.

        Returns:
          list of K lists of M, ``out[k][m]`` the concatenation of
          ``buffers[0..K-1][m]`` in tower order, on ``ctx.devices[k]``.
        """
        raise NotImplementedError

    def broadcast(self, row, ctx):
        """Copies the root tower's M tensors to every device.

        Args:
          row: list of M dense tf.Tensor on ``ctx.devices[ctx.root]``.
          ctx: ReduceContext.

        Returns:
          list of K lists of M, ``out[k][m]`` equal to ``row[m]``, on
          ``ctx.devices[k]``.
        """
        raise NotImplementedError

    def reduce_to_root(self, buffers, ctx):
        """Sums K x M tensors on the root device.

        Args:
          buffers: list of K lists of M dense tf.Tensor, one shape per entry.
          ctx: ReduceContext.

        Returns:
          list of M tf.Tensor, the sums (means) of dtype ``ctx.dtypes[m]``
          on ``ctx.devices[ctx.root]``.
        """
        raise NotImplementedError

    def all_to_all(self, pieces, ctx):
        """Sends piece k of every tower's tensors to device k (point to point).

        Args:
          pieces: list of K lists of M lists of K dense tf.Tensor;
            ``pieces[j][m][k]`` is on ``ctx.devices[j]`` and goes to device k.
          ctx: ReduceContext.

        Returns:
          list of K lists of M, ``out[k][m]`` the concatenation along axis 0
          of ``pieces[0..K-1][m][k]``, on ``ctx.devices[k]``.
        """
        out = []
        for k, device in enumerate(ctx.devices):
            with tf.device(device):
                out.append([concat_rows([row[m][k] for row in pieces],
                                        name=f"entry{m}_dev{k}_out")
                            for m in range(len(pieces[0]))])
        return out


class ReduceContext:
    """What a stage needs to know of the call it is part of.

    Args:
      devices: list of K canonical device strings.
      average: bool, the stage scales the sum by 1/T where it completes it.
      dtypes: list of M tf.DType, the dtype each entry's result must have.
      upstream_collective: bool, the input comes from a collective stage: a
        stage that reads only some towers' copies must still make the others
        run (see ``Stage.collective``).
      root: int, the root tower's index among the devices (broadcast and
        reduce).
      wire_sum: bool, the call compresses (``compression=``): partial sums
        of 16-bit entries cross devices in 16 bits too (hierarchical group
        sums, ring hops, the collective's sum) instead of going up to
        float32 first; when averaging, the frame has prescaled the inputs
        by 1/K and asks the stages for a sum (``average`` False), so no
        partial sum of a mean overflows.
    """

    def __init__(self, devices, average, dtypes, upstream_collective=False, wire_sum=False,
                 root=0):
        self.devices = devices
        self.root = root
        self.average = average
        self.dtypes = dtypes
        self.upstream_collective = upstream_collective
        self.wire_sum = wire_sum

    def finish(self, total, m, num_replicas, device, name):
        """Scales a completed sum of entry m by 1/T (if averaging) and casts it back.

        Args:
          total: tf.Tensor, the sum over T = ``num_replicas`` towers, in the
            accumulation dtype, on ``device``.
          m: int, the entry.
          num_replicas: int T.
          device: str.
          name: str, the result op's name.

        Returns:
          tf.Tensor of ``dtypes[m]`` on ``device``.
        """
        return finish_sum(total, self.dtypes[m], num_replicas, self.average, device, name)
