"""Predicts how long a built reduction takes on a machine described by a Topology.

``predict`` reads the same graph as ``analyze_traffic`` (nothing runs) and
simulates it, event by event:

- every op that touches data costs ``launch_cost`` plus the bytes it reads
  and writes over ``memory_bandwidth``, on its device, one op at a time per
  device (a GPU's compute stream), or on the shared lanes of CPU devices
  (a large op on all of them); ops that only rename or alias a tensor
  (Identity, Reshape, NoOp, constants, variable handles and reads, and
  splits TF serves as aligned slices of their input) are free; outputs
  that are mapped afresh every step (``Topology.fresh_memory``) cost their
  page faults on top;
- every cross-device edge (one transfer per tensor and receiving device, as
  TF's partitioner makes) crosses the links of its route: it starts when its
  producer is done and every link of the route is free (each link carries
  one transfer at a time, in the order they were asked for), holds them for
  bytes / the route's narrowest bandwidth, and arrives one latency sum later
  (the alpha-beta model of Thakur, Rabenseifner & Gropp, 2005);
- collective ops (NcclAllReduce, CollectiveReduceV2, CollectiveGatherV2,
  CollectiveBcastSendV2/RecvV2), whose transfers are inside one op, start
  when every member is ready and the links of their ring are free, and take
  NCCL's ring time: 2(G-1) (alpha + S / (G * B)) for an all-reduce of S,
  (G-1) (alpha + S / B) for an all-gather of S per member, (G-1) alpha +
  S / B for a pipelined broadcast; B the narrowest route between ring
  neighbours, over the ring order with the widest such B (NCCL searches its
  rings the same way; one ring, where NCCL may run several side by side).

The prediction is the time the last op ends; ``bus_bandwidth`` is
S * 2(K-1)/K / t, the definition of nccl-tests, with S the bytes one device
reduces.
"""

import collections
import functools
import heapq
import math

import tensorflow as tf

from tfreduce.analysis.graphwalk import as_graph, static_bytes, tensors, walk_back
from tfreduce.analysis.hostprobe import resolve_topology
from tfreduce.analysis.timeline import Slice, Timeline, stage_of
from tfreduce.basis.devices import canonical_or_empty, topology_index
from tfreduce.basis.topology import best_ring, ring_time
from tfreduce.buffers.packing import SLICING_OPS, hands_out_slices

__all__ = ["Prediction", "predict"]

# Ops that move no data of their own: renames, aliases, metadata, handles.
FREE_OPS = frozenset({
    "NoOp", "Identity", "IdentityN", "Const", "Placeholder", "Reshape", "Squeeze", "ExpandDims",
    "VarHandleOp", "ReadVariableOp", "Shape", "ShapeN", "StopGradient", "Size", "Rank",
    "_Arg", "_Retval", "PlaceholderWithDefault"})
# Collective ops -> the ring collective NCCL runs for them (``topology.ring_time``).
RING_KINDS = {"NcclAllReduce": "all_reduce", "CollectiveReduceV2": "all_reduce",
              "CollectiveGatherV2": "all_gather", "CollectiveBcastSendV2": "broadcast",
              "CollectiveBcastRecvV2": "broadcast"}
COLLECTIVE_OPS = frozenset(RING_KINDS)
# Ops whose CPU kernels copy a flat buffer on one thread (TF shards a
# concat over its output's rows, one for a flat buffer): one lane each.
COPY_OPS = SLICING_OPS | {"ConcatV2", "Concat", "Pack"}


class Prediction:
    """What ``predict`` found.

    Attributes:
      seconds: float, predicted time from the first op to the last.
      critical_path: list of (kind, name, start s, end s), the chain of ops
        and transfers that ends last, first to last; kind is "op",
        "transfer" or "collective".
      link_busy: dict link name ("gpu0->gpu1") -> seconds it carried data.
      bytes_per_device: int S, the bytes each device reduces.
      num_devices: int K, the devices holding outputs.
      bus_bandwidth: float bytes/s, S * 2(K-1)/K / seconds (nccl-tests).
      timeline: tfreduce.analysis.timeline.Timeline of the simulation: each op that
        takes time on "tower i" (device i of the topology), each transfer
        on its link's track, with the stages of a measured timeline.
    """

    def __init__(self, seconds, critical_path, link_busy, bytes_per_device, num_devices,
                 timeline=None):
        self.seconds = seconds
        self._timeline = timeline  # a Timeline, or fn() -> Timeline made on first use
        self.critical_path = critical_path
        self.link_busy = link_busy
        self.bytes_per_device = bytes_per_device
        self.num_devices = num_devices
        factor = 2 * (num_devices - 1) / num_devices if num_devices else 0.0
        self.bus_bandwidth = bytes_per_device * factor / seconds if seconds > 0 else math.inf

    @functools.cached_property
    def timeline(self):
        return self._timeline() if callable(self._timeline) else self._timeline

    def __repr__(self):
        return (f"Prediction({self.seconds * 1e3:.3f} ms, bus {self.bus_bandwidth / 1e9:.1f} "
                f"GB/s, {len(self.critical_path)} steps on the critical path)")


def predict(target, topology, inputs=None, devices_per_task=None, trace=None, ready=None):
    """Predicts the time of a built reduction on a machine (see the module docstring).

    Args:
      target: the outputs of a reduction (a K x N list, as for
        ``analyze_traffic``) or a graph (tf.Graph, a concrete function).
      topology: a tfreduce.Topology, or a preset name ("dgx-a100"; see
        ``tfreduce.basis.topology.PRESETS``), or "host": this machine's logical
        CPU devices, measured by a probe (``tfreduce.analysis.hostprobe``).
      inputs: for outputs only; the K x N inputs, where the walk back stops
        (they are ready at time 0), and whose tower 0 gives S.
      devices_per_task: int G for multi-worker device names (task w's
        device k is topology device w*G + k), or None.
      trace: None, or a path: the predicted timeline is written there
        (Chrome trace JSON, or a Gantt chart for ".png"; Timeline.save).
      ready: None, or {tf.Operation: float seconds}: when each input's op
        (of ``inputs``) is ready; the others at 0 (``predict_step`` gives
        the times a backward pass produces each gradient).

    Returns:
      Prediction.

    Raises:
      ValueError: a device index beyond the topology's devices, no tensor,
        or a tensor that crosses devices (or a collective's input) whose
        shape is not fully known: its bytes are unknown, so its time would
        be a guess (named).
      TypeError: target or inputs hold something that is not a tensor.
    """
    ops, outputs, stop = _ops(target, inputs)
    _check_known_sizes(ops)
    used = {topology_index(op.device, devices_per_task) for op in ops} - {None}
    topology = resolve_topology(topology, max(used, default=0) + 1, at_least=False)
    sim = _Simulation(ops, topology, devices_per_task, sources=stop, ready=ready)
    seconds = sim.run()
    # The timeline only when asked for: plan_allreduce predicts many candidates.
    prediction = Prediction(
        seconds, sim.critical_path(), dict(sim.link_busy), _bytes_per_device(outputs, inputs),
        sim.num_output_devices(outputs),
        lambda: Timeline(sim.slices(), f"predicted: {topology.name}", origin=0.0))
    if trace is not None:
        prediction.timeline.save(trace)
    return prediction


def _ops(target, inputs):
    graph = as_graph(target)
    if graph is not None:
        return list(graph.get_operations()), [], set()
    outputs = tensors(target, "target")
    if not outputs:
        raise ValueError("target holds no tensor: pass the outputs of a reduction or a graph")
    stop = {t.op for t in tensors(inputs, "inputs")} if inputs is not None else set()
    walked = walk_back([t.op for t in outputs], stop)
    # The inputs' ops take part as sources, free and ready at time 0, so
    # the transfers out of them are costed.
    read = {t.op for op in walked for t in op.inputs} & stop
    return walked + sorted(read, key=lambda op: op.name), outputs, stop


def _check_known_sizes(ops):
    # Every byte the model moves must be known: a transfer or a collective
    # of unknown size would cost nothing and the prediction be too fast.
    members = set(ops)
    for op in ops:
        moved = [op.inputs[0]] if op.type in COLLECTIVE_OPS and op.inputs and (
            op.type != "CollectiveBcastRecvV2") else [
            t for t in op.inputs if t.op in members and t.op.device and op.device
            and canonical_or_empty(t.op.device) != canonical_or_empty(op.device)]
        for t in moved:
            if t.dtype.is_numeric and static_bytes(t) is None:
                raise ValueError(
                    f"predict costs the bytes of static shapes, but tensor {t.name!r} "
                    f"({t.op.type} on {t.op.device}) has shape {t.shape} and reaches "
                    f"{op.name!r} on {op.device}: build the reduction on gradients of known "
                    f"shapes (tfreduce.plan_allreduce takes the shapes you expect)")


def _bytes_per_device(outputs, inputs):
    # S: tower 0's inputs when given, else the outputs on the first device.
    if inputs is not None and isinstance(inputs, (list, tuple)) and inputs:
        first = inputs[0] if isinstance(inputs[0], (list, tuple)) else inputs
        return sum(static_bytes(t) or 0 for t in tensors(first, "inputs"))
    if not outputs:
        return 0
    device = outputs[0].device
    return sum(static_bytes(t) or 0 for t in outputs if t.device == device)


class _Simulation:
    """The event-driven run of one graph on one topology."""

    def __init__(self, ops, topology, devices_per_task, sources=(), ready=None):
        self.topology = topology
        self.sources = set(sources)
        self.ready = ready or {}
        self.per_task = devices_per_task
        self.ops = ops
        members = set(ops)
        self.device = {op: self._index(op) for op in ops}
        # A source's own inputs are not simulated: it is ready at time 0.
        # Consumers of each op within the analysed set; pending inputs per op.
        self.pending = {op: 0 for op in ops}
        self.consumers = collections.defaultdict(list)  # op -> [(consumer, tensor or None)]
        for op in ops:
            if op in self.sources:
                continue
            for t in op.inputs:
                if t.op in members:
                    self.consumers[t.op].append((op, t))
                    self.pending[op] += 1
            for dep in op.control_inputs:
                if dep in members:
                    self.consumers[dep].append((op, None))
                    self.pending[op] += 1
        self.groups = self._collective_groups(ops)
        self.link_free = collections.defaultdict(float)
        self.link_busy = collections.Counter()
        self.device_free = collections.defaultdict(float)
        self.end = {}
        # op or (tensor name, device) -> (kind, name, start, end, previous cause)
        self.cause = {}

    def _index(self, op):
        index = topology_index(op.device, self.per_task)
        if index is not None and index >= self.topology.num_devices:
            raise ValueError(f"op {op.name!r} is on {op.device}, device {index}, but topology "
                             f"{self.topology.name!r} has {self.topology.num_devices} devices; "
                             f"use a topology of as many devices as the graph (or "
                             f"Topology.cluster), and devices_per_task for multi-worker names")
        return index

    @staticmethod
    def _collective_groups(ops):
        groups = collections.defaultdict(list)
        for op in ops:
            if op.type == "NcclAllReduce":
                groups[("nccl", op.get_attr("shared_name"))].append(op)
            elif op.type in COLLECTIVE_OPS:
                # The instance key: input 3, or 2 for a receive (no data input).
                key = tf.get_static_value(op.inputs[2 if op.type == "CollectiveBcastRecvV2"
                                                    else 3])
                groups[("collective", None if key is None else int(key))].append(op)
        return {op: members for members in groups.values() for op in members}

    def run(self):
        events = []  # (time, order, kind, payload)
        order = 0

        def push(time, kind, payload):
            nonlocal order
            heapq.heappush(events, (time, order, kind, payload))
            order += 1

        for op in self.ops:
            if self.pending[op] == 0:
                push(self.ready.get(op, 0.0), "ready", (op, None))
        waiting = collections.defaultdict(list)  # collective group id -> ready members
        while events:
            now, _, kind, payload = heapq.heappop(events)
            if kind == "ready":
                op, previous = payload
                if op in self.groups:
                    members = self.groups[op]
                    waiting[id(members)].append((op, previous))
                    if len(waiting[id(members)]) == len(members):
                        self._collective(waiting.pop(id(members)), now, push)
                    continue
                self._compute(op, previous, now, push)
            elif kind == "done":
                self._deliver(payload, now, push)
            else:  # "arrive": (consumer, the transfer's key)
                consumer, transfer = payload
                self._input_ready(consumer, transfer, now, push)
        return max(self.end.values(), default=0.0)

    def _compute(self, op, previous, now, push):
        duration, wide = self._cost(op)
        device = self.device[op]
        start = now
        if duration > 0 and device is not None:
            if self.topology.compute_lanes is None:
                lanes = [device]  # one op at a time per device
            elif wide:
                lanes = [("lane", i) for i in range(self.topology.compute_lanes)]
            else:
                lanes = [self._lane()]  # the shared lane free first
            start = max([now] + [self.device_free[lane] for lane in lanes])
            for lane in lanes:
                self.device_free[lane] = start + duration
        self.end[op] = start + duration
        self.cause[op] = ("op", op.name, start, start + duration, previous)
        push(start + duration, "done", op)

    def _lane(self):
        # The shared compute lane that is free first.
        return min((("lane", i) for i in range(self.topology.compute_lanes)),
                   key=lambda lane: self.device_free[lane])

    def _on_lane(self, earliest, seconds):
        # Takes the first free lane for `seconds` from `earliest`; returns the end.
        lane = self._lane()
        start = max(earliest, self.device_free[lane])
        self.device_free[lane] = start + seconds
        return start + seconds

    def _cost(self, op):
        """(seconds, wide): wide ops (large math beyond the cache tier) take every lane."""
        if op.type in FREE_OPS or op in self.sources or hands_out_slices(op):
            # No bytes; on CPUs (shared lanes) the executor still runs the op.
            return (self.topology.launch_cost if self.topology.compute_lanes else 0.0), False
        moved = _moved(op)
        bandwidth = self.topology.memory_bandwidth
        cache = self.topology.cache
        in_cache = cache is not None and moved <= cache[0]
        if in_cache:
            bandwidth = cache[1]
        seconds = self.topology.launch_cost + (moved / bandwidth if math.isfinite(bandwidth)
                                               else 0)
        fresh = self.topology.fresh_memory
        if fresh is not None:
            seconds += sum(size for size in map(static_bytes, op.outputs)
                           if size and size > fresh[0]) / fresh[1]
        return seconds, cache is not None and not in_cache and op.type not in COPY_OPS

    def _collective(self, members, now, push):
        ops = [op for op, _ in members]
        devices = {self.device[op] for op in ops if self.device[op] is not None}
        size = max((static_bytes(op.outputs[0] if op.type == "CollectiveBcastRecvV2" else
                                 op.inputs[0]) or 0) for op in ops)
        ring = best_ring(self.topology, sorted(devices))
        links = [link for a, b in zip(ring, ring[1:] + ring[:1])
                 for link in self.topology.route(a, b)]
        # The ring's links carry 2(G-1)/G of S each: collectives that share
        # links wait for each other, like transfers.
        start = max([now] + [self.link_free[link.name] for link in links])
        seconds, hold = ring_time(self.topology, ring, size, RING_KINDS[ops[0].type])
        for link in links:
            self.link_free[link.name] = start + hold
            self.link_busy[link.name] += hold
        cost = self.topology.collective_cost
        if self.topology.compute_lanes is not None and cost:
            # Each member's work takes a shared lane.
            cost = max(self._on_lane(start, cost) for _ in ops) - start
        end = start + cost + seconds
        previous = members[-1][1]  # the member that arrived last
        for op in ops:
            self.end[op] = end
            self.cause[op] = ("collective", op.name, start, end, previous)
            push(end, "done", op)

    def _deliver(self, producer, now, push):
        sent = {}
        for consumer, tensor in self.consumers[producer]:
            src, dst = self.device[producer], self.device[consumer]
            if tensor is None or src is None or dst is None or src == dst:
                self._input_ready(consumer, producer, now, push)
                continue
            key = (tensor.name, dst)
            if key not in sent:  # one transfer per tensor and receiving device
                sent[key] = self._transfer(tensor, src, dst, now, producer)
            push(sent[key], "arrive", (consumer, key))

    def _transfer(self, tensor, src, dst, now, producer):
        route = self.topology.route(src, dst)
        size = static_bytes(tensor) or 0
        narrowest = min(link.bandwidth for link in route)
        start = max([now] + [self.link_free[link.name] for link in route])
        if self.topology.copy_cost:
            # The send and receive are CPU work, on a shared lane.
            start = self._on_lane(start, self.topology.copy_cost)
        hold = size / narrowest
        for link in route:
            self.link_free[link.name] = start + hold
            self.link_busy[link.name] += hold
        arrival = start + hold + sum(link.latency for link in route)
        self.cause[(tensor.name, dst)] = ("transfer", f"{tensor.name} -> device {dst}", start,
                                          arrival, producer)
        return arrival

    def _input_ready(self, consumer, cause, now, push):
        # cause: the producing op, or the key of the transfer that brought the input.
        self.pending[consumer] -= 1
        if self.pending[consumer] == 0:
            # The last input to arrive decides when the consumer can start.
            push(now, "ready", (consumer, cause))

    def slices(self):
        """timeline.Slice of every op and transfer that took time."""
        out = []
        for key, (kind, name, start, end, previous) in self.cause.items():
            if end <= start:
                continue
            if kind == "transfer":
                src, dst = self.device[previous], key[1]
                out.append(Slice(f"link {src}->{dst}", name, kind, stage_of(previous.name),
                                 start, end - start))
            elif self.device[key] is not None:
                out.append(Slice(f"tower {self.device[key]}", name,
                                 kind if kind == "collective" else key.type, stage_of(name),
                                 start, end - start))
        return out

    def critical_path(self):
        """The chain of causes that ends last, first to last."""
        if not self.end:
            return []
        node = max(self.end, key=self.end.get)
        path = []
        while node is not None and node in self.cause:
            kind, name, start, end, previous = self.cause[node]
            path.append((kind, name, start, end))
            node = previous
        return path[::-1]

    def num_output_devices(self, outputs):
        return len({self.device.get(t.op, topology_index(t.device, self.per_task))
                    for t in outputs} - {None})


def _moved(op):
    # The bytes an op reads and writes.
    return sum(static_bytes(t) or 0 for t in list(op.inputs) + list(op.outputs))
