"""Sharded optimizer state (ZeRO stages 1 and 2): layout, shard variables, one update.

ZeRO (Rajbhandari et al., SC 2020, arXiv 1910.02054) keeps each optimizer
slot once across the T towers of a run instead of T times. tfreduce's
layout: the trainable variables of each dtype, flattened and joined in the
order of a packed buffer (``packing.buffer_order``), form one flat view of S
elements; tower t (of all T, tower k of rank w is t = w * K + k) owns
elements [start_t, start_t + S_t) of it, with S_t from the one shard rule
(``contract.shard_sizes``: the first S % T towers own one element more).
Shards are therefore balanced to one element. Where tower t's range meets
variable n it holds a *piece*: a 1-D
``keras.Variable`` of that many elements (0 included), named like the
variable, that its optimizer is built on. Optimizer k thus has the same
variables, in the same order, as an unsharded one, each slot 1/T of the size.

One update (stage 1):

1. each tower joins its gradients into its flat views;
2. one ``tfreduce.reduce_scatter`` per step (any algorithm, groups,
   across workers; with compression, 16-bit partial sums as the
   all-reduce's) leaves tower t the sum or mean of its range;
3. one all-reduce of the towers' counts of non-finite elements decides for
   every tower at once: apply, or skip;
4. optimizer k applies its shard to its pieces (every listed optimizer's
   update is elementwise, so this equals the unsharded update of the same
   elements);
5. one ``tfreduce.all_gather`` of the updated pieces (uncompressed: they are
   weights) rebuilds the full flat views, and every tower assigns them to
   its model's variables.

Stage 2 also shards the accumulation buffers (``accumulate_steps > 1``):
every micro-batch is reduce-scattered and each tower adds its range into a
buffer of S_t elements, DeepSpeed's trade of a reduce-scatter per
micro-batch for 1/T of the buffers. With ``accumulate_steps == 1`` stage 2
is stage 1.

The wire bytes per step are those of a ring all-reduce of the gradients:
a reduce-scatter and an all-gather of S elements, 2 (T-1)/T S per tower
with algorithm="ring".
"""

import dataclasses

import keras
import tensorflow as tf

from tfreduce.basis import kerases
from tfreduce.basis.contract import shard_sizes
from tfreduce.buffers.packing import buffer_order
from tfreduce.doors.collectives import all_gather, reduce_scatter
from tfreduce.trainer.optimizer_state import OptimizerState
from tfreduce.trainer.update import locate_nonfinite, scales_loss

ZERO_STAGES = (0, 1, 2)

# Keras optimizers whose update of an element reads only that element's
# gradient, weight and slots: their update of a piece equals the unsharded one.
ELEMENTWISE = (keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW,
               keras.optimizers.Adamax, keras.optimizers.Nadam, keras.optimizers.RMSprop,
               keras.optimizers.Adagrad, keras.optimizers.Adadelta, keras.optimizers.Lion,
               keras.optimizers.Ftrl)

# Options that need a variable's whole gradient, or all of them (or the
# whole weights): what each does, and what to use instead.
_CLIPVALUE = "use clipvalue (it clips each element), or zero_stage=0"
_WHOLE_VARIABLE_OPTIONS = {
    "clipnorm": ("clips each variable's gradient by its own norm", _CLIPVALUE),
    "global_clipnorm": ("clips by the norm of all gradients together", _CLIPVALUE),
    "use_ema": ("keeps a moving average of the weights it updates, here the pieces",
                "use zero_stage=0, or use_ema=False"),
}


def check_zero_stage(zero_stage, powersgd):
    """Raises ValueError/TypeError for a bad zero_stage, or one PowerSGD cannot share."""
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, int):
        raise TypeError(f"zero_stage must be an int in {ZERO_STAGES}, got {zero_stage!r}")
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be 0 (no sharding), 1 (optimizer state) or 2 "
                         f"(and accumulation buffers), got {zero_stage}")
    if zero_stage and powersgd is not None:
        raise ValueError(f"zero_stage={zero_stage} cannot be combined with powersgd: PowerSGD "
                         f"all-reduces low-rank factors, ZeRO reduce-scatters the gradients")


def check_zero_across(zero_stage, cluster, reduction):
    """Raises ValueError for ZeRO with wire compression across workers.

    The cross-worker reduce-scatter moves the gradients in their own dtype.
    """
    compression = reduction.compression
    if zero_stage and not cluster.is_local and reduction.deterministic:
        raise ValueError(f"zero_stage={zero_stage} with deterministic=True across workers: the "
                         f"reduce-scatter across workers sums in TF's order; use zero_stage=0")
    if zero_stage and not cluster.is_local and compression.compresses:
        raise ValueError(
            f"zero_stage={zero_stage} with compression={compression.name!r} across workers: "
            f"the reduce-scatter across workers moves the gradients in their own dtype; drop "
            f"compression, or use zero_stage=0")


def check_optimizer(optimizer, k, zero_stage):
    """Raises ValueError unless tower k's optimizer can update pieces of variables (stage > 0).

    Args:
      optimizer: a Keras optimizer, or a LossScaleOptimizer around one.
      k: int, the tower (for the message).
      zero_stage: int; at 0 every optimizer updates whole variables.
    """
    if not zero_stage:
        return
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if kerases.is_keras2(inner):
        raise ValueError(
            f"zero_stage > 0: tower {k}'s optimizer is a tf_keras (Keras 2) "
            f"{type(inner).__name__}, whose slots are made and updated whole, one per "
            f"variable; ZeRO updates shards with Keras 3's optimizers: use zero_stage=0, or "
            f"keras.optimizers.{type(inner).__name__}")
    if not isinstance(inner, ELEMENTWISE):
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise ValueError(
            f"zero_stage > 0: tower {k}'s optimizer {type(inner).__name__} is not one whose "
            f"update is elementwise ({names}); its update of a shard would differ from the "
            f"whole variable's; use zero_stage=0")
    for option, (why, instead) in _WHOLE_VARIABLE_OPTIONS.items():
        value = getattr(inner, option, None)
        if value:
            raise ValueError(
                f"zero_stage > 0: tower {k}'s optimizer has {option}={value!r}, which {why}; "
                f"a tower holds a shard only: {instead}")


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Which elements of which variables each of this worker's towers owns (``build``).

    Attributes:
      dtypes: list of D tf.DTypes, the flat views, in order of first variable.
      members: D lists of variable indices, each view's variables in the
        order of a packed buffer (``packing.buffer_order`` of the reversed
        model order).
      sizes: list of N ints, each variable's element count.
      pieces: K x N list of (start, length): tower k's piece of variable n,
        as a range of its flattened elements (length 0: none).
      shard_lengths: K x D list of ints, tower k's element count of view d.
    """

    dtypes: list
    members: list
    sizes: list
    pieces: list
    shard_lengths: list

    @classmethod
    def build(cls, variables, total_towers, first_tower, num_towers):
        """The layout of the one shard rule over each dtype's flat view.

        Args:
          variables: list of N trainable variables (tower 0's), the gradients' order.
          total_towers: int T, the towers of all workers.
          first_tower: int, the index among the T of this worker's tower 0 (rank * K).
          num_towers: int K, this worker's towers.

        Returns:
          ShardLayout.
        """
        sizes = [int(v.shape.num_elements()) for v in variables]
        dtypes, members = [], []
        for n, v in enumerate(variables):
            dtype = tf.as_dtype(v.dtype)
            if dtype not in dtypes:
                dtypes.append(dtype)
                members.append([])
            members[dtypes.index(dtype)].append(n)
        # The order of a packed buffer (backward, 64-byte multiples first), so
        # that the reduce-scatter sums each element as stage 0's all-reduce
        # of one buffer does.
        members = [buffer_order(group[::-1], lambda n: sizes[n] * tf.as_dtype(
            variables[n].dtype).size) for group in members]
        pieces = [[(0, 0)] * len(variables) for _ in range(num_towers)]
        shard_lengths = [[0] * len(dtypes) for _ in range(num_towers)]
        for d, group in enumerate(members):
            lengths = shard_sizes(sum(sizes[n] for n in group), total_towers)
            starts = [sum(lengths[:t]) for t in range(total_towers)]
            for k in range(num_towers):
                t = first_tower + k
                low, high = starts[t], starts[t] + lengths[t]
                shard_lengths[k][d] = lengths[t]
                offset = 0
                for n in group:
                    a, b = max(low, offset), min(high, offset + sizes[n])
                    pieces[k][n] = (a - offset, max(b - a, 0)) if b > a else (0, 0)
                    offset += sizes[n]
        return cls(dtypes, members, sizes, pieces, shard_lengths)

    def flat_views(self, row):
        """D flat tensors: one tower's N tensors (None: zeros) joined per dtype."""
        return [tf.concat([tf.zeros([self.sizes[n]], self.dtypes[d]) if row[n] is None
                           else tf.reshape(tf.convert_to_tensor(row[n]), [-1]) for n in group], 0)
                for d, group in enumerate(self.members)]

    def held_views(self, k, pieces):
        """D 1-D tensors: tower k's pieces of each dtype joined, the empty ones left out."""
        out = []
        for d, group in enumerate(self.members):
            held = [tf.convert_to_tensor(pieces[n]) for n in group if self.pieces[k][n][1]]
            out.append(tf.concat(held, 0) if held else tf.zeros([0], self.dtypes[d]))
        return out

    def split_views(self, views, shapes):
        """N tensors of the given shapes from D full flat views (flat_views' inverse)."""
        out = [None] * len(self.sizes)
        for view, group in zip(views, self.members):
            for n, part in zip(group, tf.split(view, [self.sizes[n] for n in group])):
                out[n] = tf.reshape(part, shapes[n])
        return out

    def split_shard(self, k, shards):
        """N 1-D tensors: tower k's D shards cut into its pieces."""
        out = [None] * len(self.sizes)
        for shard, group in zip(shards, self.members):
            parts = tf.split(shard, [self.pieces[k][n][1] for n in group])
            for n, part in zip(group, parts):
                out[n] = part
        return out


class ZeroState:
    """The pieces of the variables each tower owns, and what updates them.

    Args:
      stage: int, 1 or 2.
      trainable: K x N list of the towers' trainable variables.
      devices: list of K canonical device names.
      total_towers: int T.
      first_tower: int, this worker's tower 0 among the T.

    Attributes:
      stage: int, 1 or 2.
      layout: ShardLayout.
      pieces: K x N list of 1-D keras.Variables on devices[k], tower k's
        piece of variable n (the optimizers are built on them).
    """

    def __init__(self, stage, trainable, devices, total_towers, first_tower):
        self.stage = stage
        self.devices = devices
        self.layout = ShardLayout.build(trainable[0], total_towers, first_tower, len(devices))
        self.pieces = []
        for k, (row, device) in enumerate(zip(trainable, devices)):
            with tf.device(device):
                self.pieces.append([self._piece(k, n, v) for n, v in enumerate(row)])

    def _piece(self, k, n, variable):
        start, length = self.layout.pieces[k][n]
        # Named like the variable (a weight decay excluded by name stays
        # excluded); the scope makes every piece's slot names unique.
        with keras.name_scope(f"tfreduce_zero_t{k}v{n}"):
            return keras.Variable(tf.reshape(variable, [-1])[start:start + length],
                                  dtype=variable.dtype, name=variable.name)

    def check_loss_scaling(self, optimizers):
        """Raises ValueError if a tower holds no element and the optimizers scale the loss.

        A LossScaleOptimizer learns of a skip from NaN gradients (``_apply``),
        which a tower without elements cannot be given.
        """
        empty = [k for k, row in enumerate(self.layout.shard_lengths) if not any(row)]
        if empty and scales_loss(optimizers[0]):
            raise ValueError(
                f"zero_stage with a LossScaleOptimizer (mixed_float16): tower {empty[0]} "
                f"would hold no element of the model's {sum(self.layout.sizes)}, fewer than "
                f"the towers of the run; use fewer towers or zero_stage=0")

    def targets(self, k):
        """The variables tower k's optimizer updates: its pieces."""
        return self.pieces[k]

    def shared_variables(self, optimizer):
        """[]: sharded optimizers differ per tower, neither broadcast nor compared."""
        return []

    def sum_specs(self):
        """K lists of (shape, dtype): the sharded accumulation buffers of stage 2; None at 1."""
        if self.stage == 1:
            return None
        return [[([length], dtype) for length, dtype in zip(row, self.layout.dtypes)]
                for row in self.layout.shard_lengths]

    def optimizer_state(self, optimizers, trainable, cluster):
        """The checkpoint's OptimizerState: every tower's pieces (across workers: gathered)."""
        return OptimizerState(optimizers, self.pieces, self.layout.pieces, trainable[0],
                              across=not cluster.is_local)

    def whole_optimizer(self, optimizers):
        """None: no checkpoint stored a sharded optimizer whole."""
        return None

    def load_pieces(self, trainable):
        """Assigns each piece its range of the towers' weights (after a broadcast or restore)."""
        for k, (row, device) in enumerate(zip(trainable, self.devices)):
            with tf.device(device):
                for n, (piece, v) in enumerate(zip(self.pieces[k], row)):
                    start, length = self.layout.pieces[k][n]
                    piece.assign(tf.reshape(v, [-1])[start:start + length])

    def reduce_scatter(self, all_grads, options):
        """K x D shards: tower k's range of the sum (or mean) of every tower's flat views.

        Args:
          all_grads: K x N gradients (None where a variable has none).
          options: StepOptions (devices, reduction with its compression,
            cluster, average).
        """
        views = []
        for k, (row, device) in enumerate(zip(all_grads, self.devices)):
            with tf.device(device), tf.name_scope(f"zero_views_tower{k}"):
                views.append(self.layout.flat_views(row))
        return reduce_scatter(views, self.devices, options.average, reduction=options.reduction,
                              cluster=options.cluster)

    def finite(self, shards, options):
        """bool scalar per tower (K): no shard of any tower of any worker holds NaN or Inf."""
        counts = []
        for row, device in zip(shards, self.devices):
            with tf.device(device), tf.name_scope("zero_nonfinite_count"):
                bad = [tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(s)), tf.float32))
                       for s in row]
                counts.append([tf.reshape(tf.add_n(bad) if bad else tf.zeros([]), [1])])
        totals = options.allreduce_exact(counts, False)
        out = []
        for row, device in zip(totals, self.devices):
            with tf.device(device):
                out.append(tf.equal(row[0][0], 0.0))
        return out

    def update(self, step, all_grads, batch, losses_finite, after):
        """The update of a step with sharded state; returns what ReplicatedState.update returns.

        Args:
          step: step.StepGraph, built with this state; its TowerState's sums
            are full at stage 1, shards at 2.
          all_grads: K x N, this step's gradients.
          batch: int32 scalar, the global batch.
          losses_finite: bool scalar, every loss of the update cycle is finite.
          after: tensors the reduce-scatter runs after.

        Returns:
          (finite bool scalar, pending: K empty lists, report int32 [K + 1, N],
          the tensors a later collective must run after).
        """
        towers, options, state = step.towers, step.options, step.state
        if self.stage == 2:
            with tf.control_dependencies(after):
                shards = state.take(self.reduce_scatter(all_grads, options), batch)
            grads = all_grads
        else:
            grads = state.take(all_grads, batch)
            with tf.control_dependencies(after):
                shards = self.reduce_scatter(grads, options)
        finite = self.finite(shards, options)
        pieces = []
        for k, device in enumerate(self.devices):
            with tf.device(device):
                pieces.append(self.layout.split_shard(k, shards[k]))
        report = locate_nonfinite(finite[0], grads, [list(col) for col in zip(*pieces)],
                                  self.devices, step.host)
        lso = scales_loss(towers.optimizers[0])
        present = [g is not None for g in all_grads[0]]
        self._apply(towers.optimizers, pieces, finite, losses_finite, present)
        full = self.gather(towers.trainable, options)
        applied = tf.logical_and(finite[0], losses_finite) if lso else finite[0]
        after = options.cluster.order_after(full[0])
        return applied, [[] for _ in self.devices], report, after

    def accumulate(self, step, all_grads, batch, after):
        """A step between updates: stage 1 sums each tower's gradients, stage 2 its shards.

        Returns:
          the tensors a later collective must run after.
        """
        state, options = step.state, step.options
        if self.stage == 1:
            state.accumulate(all_grads, batch)
            return after
        with tf.control_dependencies(after):
            shards = self.reduce_scatter(all_grads, options)
        state.accumulate(shards, batch)
        return options.cluster.order_after(shards[0])

    def _apply(self, optimizers, pieces, finite, losses_finite, present):
        """Each optimizer applies its tower's pieces of the gradients, on every tower or none.

        Args:
          optimizers: K Keras optimizers, built on ``self.pieces``.
          pieces: K x N reduced gradient pieces.
          finite: K bool scalars, the same value: every shard is finite.
          losses_finite: bool scalar, every loss of the update cycle is finite.
          present: list of N bools, variable n has a gradient.

        LossScaleOptimizers see the global decision as NaN gradients when it
        is a skip.
        """
        lso = scales_loss(optimizers[0])
        for k, (optimizer, device) in enumerate(zip(optimizers, self.devices)):
            with tf.device(device), tf.name_scope(f"tower{k}_apply"):
                # Only the pieces this tower holds: most of a tower's N pieces are
                # empty, and an optimizer may update a subset of its variables.
                pairs = [(g, v) for g, v, p, (_, length) in
                         zip(pieces[k], self.pieces[k], present, self.layout.pieces[k])
                         if p and length]
                # A tower that holds nothing still counts the step (Keras skips
                # an empty list), so every tower's optimizer counts alike.
                pairs = pairs or [(pieces[k][0], self.pieces[k][0])]
                if lso:
                    # Its own shard could be finite where another's is not.
                    pairs = [(tf.where(finite[k], g, tf.constant(float("nan"), g.dtype)), v)
                             for g, v in pairs]

                def step(optimizer=optimizer, pairs=pairs):
                    optimizer.apply_gradients(pairs)

                tf.cond(losses_finite if lso else finite[k], step, lambda: None)

    def gather(self, trainable, options):
        """All-gathers the updated pieces and assigns every tower's weights.

        Returns:
          the gathered K x D flat views (for later collectives to run after).
        """
        views = []
        for k, device in enumerate(self.devices):
            with tf.device(device), tf.name_scope(f"zero_pieces_tower{k}"):
                views.append(self.layout.held_views(k, self.pieces[k]))
        full = all_gather(views, self.devices, reduction=options.exact_reduction,
                          cluster=options.cluster)
        shapes = [v.shape for v in trainable[0]]
        for k, (row, device) in enumerate(zip(trainable, self.devices)):
            with tf.device(device), tf.name_scope(f"zero_assign_tower{k}"):
                for v, value in zip(row, self.layout.split_views(full[k], shapes)):
                    v.assign(value)
        return full

    def variables(self, k):
        """Tower k's pieces (its master copy of the weights it owns)."""
        return list(self.pieces[k])
