"""Traffic analysis: which bytes a built reduction moves between devices.

A TensorFlow graph moves data between devices wherever an op placed on
device B reads a tensor produced on device A: the runtime inserts one
Send/Recv pair per (tensor, receiving device), shared by every op on B that
reads it. ``analyze_traffic`` counts exactly those transfers in a built
graph, without running it, so the cost model of an algorithm (bytes per link,
length of the critical path) can be read off and tested:

- flat, K devices, gradients in K equal buffers of S/K bytes: each ordered
  pair of devices carries 2/K * S, each device sends 2(K-1)/K * S;
- hierarchical, K=8, two groups of four, 8 equal buffers: each device sends
  and receives 1.75 * S, S/2 to each device of its group and S/4 to its
  partner in the other group, nothing to the other three;
- ring: 2(K-1)/K * S from each device to its successor and nothing else.

The other collectives (``tfreduce.doors.collectives``) count the same way: a ring
reduce-scatter or all-gather sends (K-1)/K S per device to its successor, a
flat broadcast or reduce moves S over each link of the root. Engines that
move data inside one op (``NcclAllReduce``, ``CollectiveReduceV2``,
``CollectiveGatherV2``) have no cross-device edges in the graph: their
traffic is invisible here and reported as zero bytes. ``bus_bandwidth``
turns a time into nccl-tests' bus bandwidth.
"""

import collections

from tfreduce.analysis.graphwalk import as_graph, static_bytes, tensors, walk_back
from tfreduce.basis.devices import canonical_or_empty

__all__ = ["Traffic", "analyze_traffic", "BUS_FACTORS", "bus_bandwidth"]

#: nccl-tests' bus-bandwidth factors (its PERFORMANCE.md): bus bandwidth is
#: the algorithm bandwidth S / t times this factor of the K ranks, so that it
#: compares with the link speed whatever the collective. S is each rank's
#: buffer: the input of an all-reduce, reduce-scatter (the whole tensor
#: before the scatter), broadcast and reduce, the output of an all-gather,
#: each rank's send buffer of an all-to-all.
BUS_FACTORS = {
    "all_reduce": lambda k: 2 * (k - 1) / k,
    "reduce_scatter": lambda k: (k - 1) / k,
    "all_gather": lambda k: (k - 1) / k,
    "all_to_all": lambda k: (k - 1) / k,
    "broadcast": lambda k: 1.0,
    "reduce": lambda k: 1.0,
}


def bus_bandwidth(collective, size_bytes, seconds, num_ranks):
    """The bus bandwidth of a collective as nccl-tests reports it.

    Args:
      collective: str, a key of ``BUS_FACTORS`` ("all_reduce", "reduce_scatter",
        "all_gather", "all_to_all", "broadcast", "reduce").
      size_bytes: int S, as ``BUS_FACTORS`` defines it.
      seconds: float, the time of one collective.
      num_ranks: int K.

    Returns:
      float bytes/s: S / seconds * the collective's factor of K.

    Raises:
      ValueError: an unknown collective, or seconds <= 0.
    """
    if collective not in BUS_FACTORS:
        raise ValueError(f"unknown collective {collective!r}; choose one of "
                         f"{sorted(BUS_FACTORS)}")
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    return size_bytes / seconds * BUS_FACTORS[collective](num_ranks)


class Traffic:
    """Cross-device transfers of a built reduction (see ``analyze_traffic``).

    Attributes:
      pair_bytes: dict ``(src, dst) -> int``, bytes sent from device src to
        device dst (canonical device strings), counting transfers of static
        size only.
      pair_transfers: dict ``(src, dst) -> int``, number of tensors sent.
      unsized_transfers: int, transfers whose size is not known statically
        (counted in ``pair_transfers``, not in ``pair_bytes``).
      num_ops: int, ops in the reduction.
      ops_per_device: dict ``device -> int``; unplaced ops under ``""``.
      op_types: dict ``op type -> int``.
      longest_hop_chain: int, the largest number of cross-device transfers
        on any path through the graph (2 for flat, 4 for hierarchical,
        2(K-1) for ring).
    """

    def __init__(self, pair_bytes, pair_transfers, unsized_transfers, num_ops,
                 ops_per_device, op_types, longest_hop_chain):
        self.pair_bytes = pair_bytes
        self.pair_transfers = pair_transfers
        self.unsized_transfers = unsized_transfers
        self.num_ops = num_ops
        self.ops_per_device = ops_per_device
        self.op_types = op_types
        self.longest_hop_chain = longest_hop_chain

    @property
    def devices(self):
        """Sorted list of the placed devices that hold ops or move bytes."""
        names = {d for d in self.ops_per_device if d}
        for src, dst in self.pair_transfers:
            names.update((src, dst))
        return sorted(names)

    @property
    def total_bytes(self):
        """int, bytes over all device pairs."""
        return sum(self.pair_bytes.values())

    def sent(self, device):
        """Bytes sent by ``device`` (canonical string) to all others."""
        return sum(b for (src, _), b in self.pair_bytes.items() if src == device)

    def received(self, device):
        """Bytes received by ``device`` (canonical string) from all others."""
        return sum(b for (_, dst), b in self.pair_bytes.items() if dst == device)

    def as_dict(self):
        """A JSON-serialisable summary (pairs as ``"src -> dst"`` keys)."""
        return {
            "num_ops": self.num_ops,
            "total_bytes": self.total_bytes,
            "longest_hop_chain": self.longest_hop_chain,
            "unsized_transfers": self.unsized_transfers,
            "sent": {d: self.sent(d) for d in self.devices},
            "received": {d: self.received(d) for d in self.devices},
            "pair_bytes": {f"{s} -> {d}": b for (s, d), b in sorted(self.pair_bytes.items())},
            "ops_per_device": dict(sorted(self.ops_per_device.items())),
        }

    def __repr__(self):
        return (f"Traffic(num_ops={self.num_ops}, total_bytes={self.total_bytes}, "
                f"pairs={len(self.pair_bytes)}, longest_hop_chain={self.longest_hop_chain})")


def analyze_traffic(target, inputs=None):
    """Counts the bytes a built reduction sends between each pair of devices.

    Works on the graph alone (nothing runs). An edge from an op on device A
    to an op on device B is a transfer A -> B of the tensor's static size;
    a tensor read by several ops on B is sent to B once, as TF's graph
    partitioner does. Control edges carry no data and are not counted.

    Example, flat sum of K=2 towers and one float32 gradient of 4 elements
    (root device 0)::

        out = tfreduce.allreduce_grads_flat(grads, ["/gpu:0", "/gpu:1"])
        t = analyze_traffic(out, inputs=grads)
        t.pair_bytes  # {("/device:GPU:1", "/device:GPU:0"): 16,
                      #  ("/device:GPU:0", "/device:GPU:1"): 16}
        t.longest_hop_chain  # 2: in to the root, out to device 1

    Args:
      target: what to analyse; either the outputs of a reduction (a tensor,
        ``tf.IndexedSlices`` or nested lists/tuples of them, such as the K x N
        result; None entries are ignored), whose ops are found by walking back
        from them, or a whole graph (``tf.Graph``, a ``tf.function``'s
        concrete function or its ``.graph``), all of whose ops count.
      inputs: for outputs only; tensors (nested lists allowed, e.g. the K x N
        input gradients) at which the backward walk stops. Their producing
        ops are not counted as ops of the reduction, but transfers out of
        them are. None walks back to the graph's sources.

    Returns:
      Traffic.

    Raises:
      TypeError: if ``target`` or ``inputs`` holds something that is not a
        tensor, IndexedSlices or None.
      ValueError: if ``target`` holds no tensor.
    """
    graph = as_graph(target)
    if graph is not None:
        if inputs is not None:
            raise ValueError("inputs= applies to outputs; a whole graph is analysed as is")
        ops = list(graph.get_operations())
        stop = set()
    else:
        outputs = tensors(target, "target")
        if not outputs:
            raise ValueError("target holds no tensor: pass the outputs of a reduction "
                             "or a graph")
        stop = {t.op for t in tensors(inputs, "inputs")} if inputs is not None else set()
        ops = walk_back([t.op for t in outputs], stop)

    devices = {}

    def device_of(op):
        if op not in devices:
            devices[op] = canonical_or_empty(op.device)
        return devices[op]

    pair_bytes = collections.Counter()
    pair_transfers = collections.Counter()
    unsized = 0
    seen = set()
    for op in ops:
        dst = device_of(op)
        for t in op.inputs:
            src = device_of(t.op)
            if not src or not dst or src == dst or (t.name, dst) in seen:
                continue
            seen.add((t.name, dst))
            pair_transfers[(src, dst)] += 1
            size = static_bytes(t)
            if size is None:
                unsized += 1
            else:
                pair_bytes[(src, dst)] += size

    return Traffic(
        pair_bytes=dict(pair_bytes),
        pair_transfers=dict(pair_transfers),
        unsized_transfers=unsized,
        num_ops=len(ops),
        ops_per_device=dict(collections.Counter(device_of(op) for op in ops)),
        op_types=dict(collections.Counter(op.type for op in ops)),
        longest_hop_chain=_longest_chain(ops, device_of))


def _longest_chain(ops, device_of):
    # hops[op] = most cross-device transfers on a path ending at op; inputs
    # from outside the analysed ops start at 0. Iterative post-order DFS,
    # since reductions can be thousands of ops deep (ring, large K).
    members = set(ops)
    hops = {}
    visiting = set()
    for root in ops:
        if root in hops:
            continue
        stack = [(root, False)]
        while stack:
            op, expanded = stack.pop()
            if op in hops:
                continue
            if not expanded:
                visiting.add(op)
                stack.append((op, True))
                # A loop's back edge (NextIteration) points at an op still
                # being visited; skipping it keeps the walk acyclic.
                stack.extend((t.op, False) for t in op.inputs
                             if t.op in members and t.op not in hops
                             and t.op not in visiting)
                continue
            best = 0
            for t in op.inputs:
                src = t.op
                crossing = bool(device_of(src) and device_of(op)
                                and device_of(src) != device_of(op))
                best = max(best, hops.get(src, 0) + crossing)
            hops[op] = best
            visiting.discard(op)
    return max(hops.values(), default=0)
