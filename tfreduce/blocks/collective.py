"""TF collective ops: the one place tfreduce builds them.

TF's collective ops (``CollectiveReduceV2``, ``CollectiveBcastSendV2`` /
``RecvV2``) are groups of ops, one per member device, that meet in TF's
collective runtime: a ring on CPUs, ring or NCCL on GPUs, over TF's gRPC
cluster between hosts. They are the engine of MultiWorkerMirroredStrategy.
Everything tfreduce builds from them goes through this module:

- ``CollectiveOptions``: the communication hint and the timeout, checked by
  one rule (``check_timeout``);
- ``CollectiveKeys``: group and instance keys, owned by the caller;
- ``CollectiveChain``: all-reduces chained per device, in build order, with
  one ordering token per device;
- ``all_reduce``, ``all_gather``, ``broadcast_send``, ``broadcast_recv``:
  one op each;
- ``in_function``: eagerly, the group is built and run in one tf.function.

The K ops of a collective wait for each other, so the whole group must run:
a ``tf.function`` runs all its stateful ops; in a ``tf.compat.v1.Session``
fetch (or depend on) every member. Launching many independent collectives
on a few CPU threads can deadlock, which the per-device chain prevents.
"""

import contextlib
import zlib

import tensorflow as tf

__all__ = ["COMMUNICATIONS", "CollectiveOptions", "CollectiveKeys", "CollectiveChain",
           "check_timeout", "check_keys", "all_reduce", "all_gather", "broadcast_send",
           "broadcast_recv", "check_broadcast_shape", "in_function"]

#: TF's communication hints for collective ops.
COMMUNICATIONS = ("auto", "ring", "nccl")


def check_timeout(timeout, none_means=None):
    """The one rule for a collective's timeout: seconds > 0, or None for the default.

    TF's own ops take 0 as "wait forever", which would hide a lost peer
    behind a hang; tfreduce refuses 0 and lets None stand for the default
    (``none_means`` says which: "wait forever" for collectives of one
    process, the cluster's timeout between workers).

    Args:
      timeout: int or float seconds > 0, or None when ``none_means`` is given.
      none_means: str describing what None means, or None if None is not
        accepted.

    Returns:
      float seconds, or None.

    Raises:
      ValueError: anything else (0, a negative number, a bool, a string).
    """
    if timeout is None and none_means is not None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        allowed = f" or None ({none_means})" if none_means is not None else ""
        raise ValueError(f"timeout must be a number of seconds > 0{allowed}, got {timeout!r}")
    return float(timeout)


class CollectiveOptions:
    """The options of a group of collectives, checked once (TF's collective_util.Options).

    Args:
      communication: "auto", "ring" or "nccl", TF's communication hint.
      timeout: float seconds > 0 a collective waits for its peers before it
        fails with DeadlineExceededError, or None (see ``check_timeout``).
      none_means: str, what a None timeout means, for the error message.

    Attributes:
      communication: str.
      timeout: float seconds or None.

    Raises:
      ValueError: an unknown communication or a bad timeout.
    """

    def __init__(self, communication="auto", timeout=None, none_means="wait forever"):
        if communication not in COMMUNICATIONS:
            raise ValueError(
                f"communication must be one of {COMMUNICATIONS}, got {communication!r}")
        self.communication = communication
        self.timeout = check_timeout(timeout, none_means)

    def with_timeout(self, timeout):
        """A copy whose None timeout is replaced by ``timeout`` seconds."""
        return CollectiveOptions(self.communication,
                                 timeout if self.timeout is None else self.timeout)

    @property
    def timeout_seconds(self):
        """float, the ops' ``timeout_seconds`` attribute (0: TF waits forever)."""
        return self.timeout or 0.0


class CollectiveKeys:
    """Group and instance keys of TF collective ops, owned by the caller.

    Every collective op carries a group key (which devices take part) and an
    instance key (which of the group's reductions this is); the K ops of one
    reduction share both. TF's runtime remembers each instance key's shape
    and dtype for the life of the process, and two reductions with one key in
    the same step would meet each other, so a program that builds several
    collective reductions passes one ``CollectiveKeys`` to all of them (a
    cluster owns one for the cross-worker ones) and gets keys unique for the
    process. Group keys are
    derived from the device list, so the same devices always get the same
    group.

    Args:
      first_instance_key: int >= 1, the first instance key handed out.
    """

    def __init__(self, first_instance_key=1):
        if first_instance_key < 1:
            raise ValueError(f"first_instance_key must be >= 1, got {first_instance_key}")
        self._next = first_instance_key

    @staticmethod
    def group_key(devices):
        """A positive int32 key determined by the ordered device list."""
        return zlib.crc32("|".join(devices).encode()) & 0x3FFFFFFF or 1

    @classmethod
    def for_call(cls, text):
        """Keys for one call made without a ``CollectiveKeys``.

        The first key is a hash of ``text`` (the graph, scope, devices and
        entry shapes of a call whose members are all in this process), so
        calls that differ in any of those draw their keys from unrelated
        places in a 2**30 range (two calls of M keys collide with probability
        about 2M / 2**30).
        """
        return cls(first_instance_key=(zlib.crc32(text.encode()) & 0x3FFFFFFF) + 1)

    def instance_key(self):
        """A new instance key."""
        key = self._next
        self._next += 1
        return key

    # One counter per program: a copy handing out the same instance keys
    # again would pair two reductions' ops (a Reduction copied with its
    # keys keeps sharing them). Pickled, it is a new counter: another
    # process has its own instance keys.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def check_keys(keys, none_means=None):
    """The one check of a ``keys=`` argument: a CollectiveKeys, or None.

    Args:
      keys: what was given.
      none_means: str, what None stands for (for the message), or None.

    Returns:
      keys.

    Raises:
      TypeError: anything else.
    """
    if keys is not None and not isinstance(keys, CollectiveKeys):
        meaning = f" ({none_means})" if none_means else ""
        raise TypeError(f"keys must be a tfreduce.CollectiveKeys or None{meaning}, got "
                        f"{type(keys).__name__} {keys!r}")
    return keys


def all_reduce(x, group_size, group_key, instance_key, options, ordering_token=None,
               name="all_reduce", merge_op="Add"):
    """One member of an all-reduce (``CollectiveReduceV2``), on the current device.

    Args:
      x: tf.Tensor, this member's input; every member has its shape and dtype.
      group_size: int, the number of members.
      group_key: int, the group's key (``CollectiveKeys.group_key``).
      instance_key: int, this reduction's key, the same on every member.
      options: CollectiveOptions.
      ordering_token: resource tensor that orders this device's collectives
        in a tf.function (``CollectiveChain``), or None.
      name: str, the op's name.
      merge_op: str, how members combine: "Add" (a sum), "Min", "Max" or "Mul".

    Returns:
      tf.Tensor, the sum (min, max, product) over the members, of x's shape
      and dtype.
    """
    return tf.raw_ops.CollectiveReduceV2(
        input=x, group_size=group_size, group_key=group_key, instance_key=instance_key,
        ordering_token=[] if ordering_token is None else [ordering_token],
        merge_op=merge_op, final_op="Id", communication_hint=options.communication,
        timeout_seconds=options.timeout_seconds, name=name)


def all_gather(x, group_size, group_key, instance_key, options, ordering_token=None,
               name="all_gather"):
    """One member of an all-gather (``CollectiveGatherV2``), on the current device.

    Every member's x must have one shape (see ``CollectiveChain.all_gather_rows``
    for row counts that differ).

    Returns:
      tf.Tensor, the members' x concatenated along axis 0, in group order
      (rank order for a group of one device per worker).
    """
    return tf.raw_ops.CollectiveGatherV2(
        input=x, group_size=group_size, group_key=group_key, instance_key=instance_key,
        ordering_token=[] if ordering_token is None else [ordering_token],
        communication_hint=options.communication,
        timeout_seconds=options.timeout_seconds, name=name)


def broadcast_send(x, group_size, group_key, instance_key, options, name="send"):
    """The root's member of a broadcast (``CollectiveBcastSendV2``); returns x."""
    return tf.raw_ops.CollectiveBcastSendV2(
        input=x, group_size=group_size, group_key=group_key, instance_key=instance_key,
        communication_hint=options.communication, timeout_seconds=options.timeout_seconds,
        name=name)


def check_broadcast_shape(t, m, remedy):
    """Raises ValueError unless tensor m's shape is known when built (the receivers' ``shape``).

    Args:
      t: the root's tensor m of a collective broadcast.
      m: int, its place in the row (for the message).
      remedy: str, what to do instead, ending the message.
    """
    if not t.shape.is_fully_defined():
        raise ValueError(f"broadcast: tensor {m}'s shape {t.shape} is not known when built; "
                         f"{remedy}")


def broadcast_recv(shape, dtype, group_size, group_key, instance_key, options, name="recv"):
    """A receiving member of a broadcast (``CollectiveBcastRecvV2``); returns the value."""
    return tf.raw_ops.CollectiveBcastRecvV2(
        group_size=group_size, group_key=group_key, instance_key=instance_key, shape=shape,
        T=dtype, communication_hint=options.communication,
        timeout_seconds=options.timeout_seconds, name=name)


class CollectiveChain:
    """Builds all-reduces so that each device launches its collectives in build order.

    Every device gets one ordering token, a resource handle: in a
    tf.function, automatic control dependencies then order the collectives
    per device, not across devices (which would serialise the group and
    deadlock). On top, each collective has a control dependency on the
    previous one of its device, which orders them in a tf.compat.v1 graph
    too. Every member device builds its collectives in the same order, so all
    devices launch them in the same order and hundreds of them cannot
    deadlock on a few CPU threads.

    Args:
      options: CollectiveOptions of every collective of the chain.
    """

    def __init__(self, options):
        self.options = options
        self._tokens = {}
        self._previous = {}

    def token(self, device, shared_name, name):
        """The ordering token of ``device``, created (a VarHandleOp) on first use.

        Args:
          device: str, a device string.
          shared_name: str, unique to this device and group.
          name: str, the op's name.
        """
        if device not in self._tokens:
            with tf.device(device):
                self._tokens[device] = tf.raw_ops.VarHandleOp(
                    dtype=tf.float32, shape=[], shared_name=shared_name, name=name)
        return self._tokens[device]

    def _after(self, device):
        return [self._previous[device]] if device in self._previous else []

    def _chained(self, device, build):
        # Each collective depends on the previous one of its device itself,
        # so a chain stays ordered in a tf.compat.v1 graph too, and passes
        # the device's ordering token for tf.function's ordering.
        with tf.control_dependencies(self._after(device)):
            out = build(self._tokens[device])
        self._previous[device] = out
        return out

    @contextlib.contextmanager
    def after_previous(self, device, extra=()):
        """Places ops on ``device`` after its previous collective and ``extra`` ops."""
        deps = list(extra)
        if device in self._previous:
            deps.insert(0, self._previous[device])
        with tf.device(device), tf.control_dependencies(deps):
            yield

    def all_gather(self, x, device, group_size, group_key, instance_key, name):
        """An all-gather member on ``device`` (one shape on every member), chained.

        Call it inside ``after_previous(device)``, after ``token(device, ...)``.
        """
        return self._chained(device, lambda token: all_gather(
            x, group_size, group_key, instance_key, self.options, token, name))

    def broadcast(self, x, device, group_size, group_key, instance_key, name, shape=None,
                  dtype=None):
        """A broadcast member on ``device``, chained: the root sends x, the others receive.

        Call it inside ``after_previous(device)``, after ``token(device, ...)``.

        Args:
          x: tf.Tensor on the root; None on a receiving member.
          device, group_size, group_key, instance_key: as ``all_reduce``.
          name: str, the op's name.
          shape: the root's static shape (receivers).
          dtype: the root's tf.DType (receivers).

        Returns:
          tf.Tensor, the root's value.
        """
        if x is not None:
            return self._chained(device, lambda token: broadcast_send(
                x, group_size, group_key, instance_key, self.options, name))
        return self._chained(device, lambda token: broadcast_recv(
            shape, dtype, group_size, group_key, instance_key, self.options, name))

    def all_gather_rows(self, x, device, group_size, group_key, keys, name):
        """All-gathers x [rows, ...] whose row count differs between members.

        Two collectives, chained: the row counts, then x padded to the
        largest count, whose padding is then dropped (TF's gather needs one
        shape on every member; MultiWorkerMirroredStrategy gathers
        IndexedSlices the same way).

        Args:
          x: tf.Tensor [rows, ...] of rank >= 1; the same trailing shape on
            every member.
          device, group_size, group_key: as ``all_reduce``.
          keys: CollectiveKeys, the source of the two instance keys.
          name: str, prefix of the op names.

        Returns:
          tf.Tensor [sum of rows, ...], every member's rows in group order.
        """
        return _gather_rows(self, x, device, group_size, group_key, keys, name)

    def all_reduce(self, x, device, group_size, group_key, instance_key, name, merge_op="Add"):
        """An all-reduce member on ``device``, chained after the previous one.

        Call it inside ``after_previous(device)``, after ``token(device, ...)``;
        the arguments are those of ``all_reduce``. Empty tensors never reach
        TF's kernel (it crashes on them): a statically empty x is its own
        sum, and x of a shape known only at run time is reduced with one
        element appended and removed.

        Returns:
          tf.Tensor, the sum (merge_op) over the group.
        """
        size = x.shape.num_elements()
        if size == 0:
            # TF's collective kernels crash the process on an empty tensor
            # (SIGSEGV): the sum of empty tensors is the empty tensor.
            return tf.identity(x, name=name)
        if size is None:
            # Possibly empty when the graph runs: one extra element keeps the
            # kernel's input non-empty, and is cut off again.
            padded = tf.concat([tf.reshape(x, [-1]), tf.zeros([1], x.dtype)], axis=0)
            out = self._chained(device, lambda token: all_reduce(
                padded, group_size, group_key, instance_key, self.options, token, name,
                merge_op))
            return tf.reshape(out[:-1], tf.shape(x))
        return self._chained(device, lambda token: all_reduce(
            x, group_size, group_key, instance_key, self.options, token, name, merge_op))


def _gather_rows(chain, x, device, group_size, group_key, keys, name):
    # Members' row counts differ: gather the counts, pad every x to the
    # largest (at least one row: an empty tensor crashes TF's kernels),
    # gather, and keep each member's real rows.
    rows = tf.shape(x)[:1]
    counts = chain.all_gather(rows, device, group_size, group_key, keys.instance_key(),
                              name=f"{name}_rows")
    longest = tf.maximum(tf.reduce_max(counts), 1)
    padding = [[0, longest - rows[0]]] + [[0, 0]] * (x.shape.rank - 1)
    gathered = chain.all_gather(tf.pad(x, padding), device, group_size, group_key,
                                keys.instance_key(), name=name)
    return tf.boolean_mask(gathered, tf.reshape(tf.sequence_mask(counts, longest), [-1]))


def in_function(build):
    """Runs ``build()``: directly in a graph, inside a tf.function when eager.

    Eagerly, the collective op of the first member would block before the
    next member's op is even issued; inside a tf.function the whole group is
    launched together.
    """
    if tf.executing_eagerly():
        return tf.function(build, autograph=False)()
    return build()
