"""Machines as data: devices, links, routes, memory bandwidth and per-op cost.

A ``Topology`` is what ``tfreduce.predict`` costs a built reduction on. Its
nodes are the K devices (indices 0..K-1, "/gpu:k" is device k) and, for
routing only, switches, CPU sockets and NICs. Each link is directed, with a
bandwidth in bytes/s and a latency in seconds; a physical link is two of
them, one per direction. A transfer between two devices follows the widest
route (largest bottleneck bandwidth, then fewest hops) that passes through
no other device: a copy between two GPUs without NVLink goes over PCIe and
the CPUs, never through a third GPU.

Standard library only: presets answer without TensorFlow.

Link figures of the presets are those of NCCL's topology model
(``src/graph/topo.h``: usable GB/s per NVLink of SM60 18, SM70 20, SM80 20,
SM90 20.6; PCIe gen3 x16 12; Broadwell QPI 6, Skylake UPI 10; 12 per 100
Gb/s of network) and NVIDIA's documents for the layouts (DGX-1: hybrid
cube-mesh, P100 with 4 NVLinks and V100 with 6, some pairs doubled; DGX
A100/H100: 12/18 NVLinks per GPU into NVSwitches). HBM bandwidths are the
data-sheet figures (P100 732, V100 900, A100 1555, H100 SXM 3350 GB/s).
Latencies (1 us per NVLink or PCIe hop, 5 us per network hop) and the
per-op launch cost (5 us) are round estimates, stated as such.
"""

import functools
import heapq
import itertools
import math

__all__ = ["Link", "Topology", "PRESETS", "best_ring", "check_topology", "ring_time"]

GB = 1e9
US = 1e-6
_NVLINK_LATENCY = 1e-6
_PCIE_LATENCY = 1e-6
_NET_LATENCY = 5e-6
_LAUNCH = 5e-6

# DGX-1 with V100 (nvidia-smi topo -m): NVLinks between each pair, 0 = none.
_DGX1V_LINKS = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2,
                (2, 3): 2, (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2,
                (5, 7): 1, (6, 7): 2}
# DGX-1 with P100: each quad fully connected, plus i <-> i+4; one NVLink each.
_DGX1P_LINKS = {**{(a, b): 1 for q in (0, 4) for a in range(q, q + 4)
                   for b in range(a + 1, q + 4)}, **{(i, i + 4): 1 for i in range(4)}}


class Link:
    """One direction of a link: ``bandwidth`` bytes/s, ``latency`` seconds.

    Attributes:
      src, dst: node names ("gpu3", "pcie0", "cpu1", "nic0", "net").
      bandwidth: float, bytes per second in this direction.
      latency: float, seconds.
      name: str, "src->dst".
    """

    def __init__(self, src, dst, bandwidth, latency):
        if not bandwidth > 0 or not latency >= 0:
            raise ValueError(f"link {src}->{dst}: bandwidth must be > 0 bytes/s and latency "
                             f">= 0 s, got {bandwidth!r} and {latency!r}")
        self.src, self.dst = src, dst
        self.bandwidth = float(bandwidth)
        self.latency = float(latency)
        self.name = f"{src}->{dst}"

    def __repr__(self):
        return f"Link({self.name}, {self.bandwidth / GB:g} GB/s, {self.latency / US:g} us)"


class Topology:
    """Devices and the links between them, with each device's compute costs.

    Args:
      num_devices: int K >= 1; the devices are nodes "gpu0".."gpu{K-1}".
      links: list of (a, b, bandwidth bytes/s, latency s): a physical link
        between nodes a and b, the same figures in each direction (nodes
        that are not devices are switches, sockets or NICs).
      memory_bandwidth: float bytes/s each device reads and writes its own
        memory at (math.inf: compute is free).
      launch_cost: float seconds each op that touches data costs on top.
      name: str.
      compute_lanes: None (each device computes on its own, as GPUs do) or
        int: the devices share this many lanes, each running one op at a
        time (logical CPU devices sharing a machine's cores and memory).
        With a cache tier, an op beyond it takes every lane at once (TF
        splits a large math op over the cores), one within it a single
        lane; concats and copying splits (one thread each) take one lane.
      cache: None, or (bytes, bandwidth bytes/s): an op that moves at most
        that many bytes runs at that bandwidth instead (a CPU's caches).
      fresh_memory: None, or (bytes, bandwidth bytes/s): an op output of
        more than that many bytes is memory mapped afresh at every step,
        and faulting its pages in costs its size / bandwidth on top
        (glibc's malloc maps allocations above 32 MiB with mmap and unmaps
        them when freed: M_MMAP_THRESHOLD, mallopt(3)).
      collective_cost: float seconds each collective op (NCCL, TF
        collective) costs on top of its transfers; with compute_lanes, the
        work of each member, on a lane.
      collective_bandwidth: float bytes/s, a ceiling on a collective
        op's ring (a CPU collective copies through memory); default no
        ceiling.
      copy_cost: float seconds of a compute lane each cross-device transfer
        takes (with compute_lanes: on CPUs the runtime's send and receive
        are work of the cores; GPUs copy with DMA engines, 0).

    Raises:
      ValueError: K < 1, a bad link, or two devices with no route between them.
    """

    def __init__(self, num_devices, links, memory_bandwidth=math.inf, launch_cost=0.0,
                 name="custom", compute_lanes=None, cache=None, collective_cost=0.0,
                 copy_cost=0.0, collective_bandwidth=math.inf, fresh_memory=None):
        if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
            raise ValueError(f"num_devices must be an int >= 1, got {num_devices!r}")
        if not memory_bandwidth > 0 or not launch_cost >= 0:
            raise ValueError(f"memory_bandwidth must be > 0 bytes/s and launch_cost >= 0 s, "
                             f"got {memory_bandwidth!r} and {launch_cost!r}")
        self.num_devices = num_devices
        self.name = name
        self.memory_bandwidth = float(memory_bandwidth)
        self.launch_cost = float(launch_cost)
        if compute_lanes is not None and (isinstance(compute_lanes, bool) or not isinstance(
                compute_lanes, int) or compute_lanes < 1):
            raise ValueError(f"compute_lanes must be None or an int >= 1, got {compute_lanes!r}")
        self.compute_lanes = compute_lanes
        if cache is not None and not (len(cache) == 2 and cache[0] >= 0 and cache[1] > 0):
            raise ValueError(f"cache must be None or (bytes >= 0, bandwidth > 0), got {cache!r}")
        self.cache = None if cache is None else (int(cache[0]), float(cache[1]))
        if fresh_memory is not None and not (len(fresh_memory) == 2 and fresh_memory[0] >= 0
                                             and fresh_memory[1] > 0):
            raise ValueError(f"fresh_memory must be None or (bytes >= 0, bandwidth > 0), got "
                             f"{fresh_memory!r}")
        self.fresh_memory = (None if fresh_memory is None
                             else (int(fresh_memory[0]), float(fresh_memory[1])))
        if not collective_cost >= 0:
            raise ValueError(f"collective_cost must be >= 0 seconds, got {collective_cost!r}")
        self.collective_cost = float(collective_cost)
        if not copy_cost >= 0 or (copy_cost and compute_lanes is None):
            raise ValueError(f"copy_cost must be >= 0 seconds, and needs compute_lanes, got "
                             f"{copy_cost!r} with compute_lanes={compute_lanes!r}")
        self.copy_cost = float(copy_cost)
        if not collective_bandwidth > 0:
            raise ValueError(f"collective_bandwidth must be > 0 bytes/s, got "
                             f"{collective_bandwidth!r}")
        self.collective_bandwidth = float(collective_bandwidth)
        self.links = []
        for a, b, bandwidth, latency in links:
            self.links += [Link(a, b, bandwidth, latency), Link(b, a, bandwidth, latency)]
        self._out = {}
        for i, link in enumerate(self.links):
            self._out.setdefault(link.src, []).append(i)
        self._routes = {}
        for k in range(num_devices):
            self._routes.update(self._widest_routes(k))

    def __repr__(self):
        return (f"Topology({self.name!r}, {self.num_devices} devices, "
                f"{len(self.links) // 2} links)")

    # A value (a Reduction's topology= among them): copies, deep copies and
    # unpickled ones equal the original and hash alike.
    def _value(self):
        links = tuple((link.src, link.dst, link.bandwidth, link.latency) for link in self.links)
        return (self.name, self.num_devices, links, self.memory_bandwidth, self.launch_cost,
                self.compute_lanes, self.cache, self.fresh_memory, self.collective_cost,
                self.copy_cost, self.collective_bandwidth)

    def __eq__(self, other):
        return type(other) is type(self) and other._value() == self._value()

    def __hash__(self):
        return hash(self._value())

    @staticmethod
    def device_node(k):
        """The node name of device k."""
        return f"gpu{k}"

    def route(self, src, dst):
        """The links (list of Link) a transfer from device src to device dst crosses.

        A device's route to itself crosses none (K=1 included).

        Raises:
          ValueError: src or dst is not a device index of this topology.
        """
        for k in (src, dst):
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < self.num_devices:
                raise ValueError(f"topology {self.name!r} has devices 0..{self.num_devices - 1}, "
                                 f"no device {k!r}")
        if src == dst:
            return []
        return [self.links[i] for i in self._routes[(src, dst)]]

    def _widest_routes(self, src):
        # Dijkstra on (-bottleneck bandwidth, hops) from device src, never
        # passing through another device.
        start = self.device_node(src)
        best = {start: (-math.inf, 0, [])}
        heap = [(-math.inf, 0, start, [])]
        while heap:
            neg_bw, hops, node, path = heapq.heappop(heap)
            if (neg_bw, hops) > best[node][:2]:
                continue
            if node != start and node.startswith("gpu"):
                continue  # a device ends a route, it does not forward
            for i in self._out.get(node, []):
                link = self.links[i]
                key = (max(neg_bw, -link.bandwidth), hops + 1)
                if link.dst not in best or key < best[link.dst][:2]:
                    best[link.dst] = (*key, path + [i])
                    heapq.heappush(heap, (*key, link.dst, path + [i]))
        routes = {}
        for k in range(self.num_devices):
            if k == src:
                continue
            node = self.device_node(k)
            if node not in best:
                raise ValueError(f"topology {self.name!r}: no route from device {src} to "
                                 f"device {k}")
            routes[(src, k)] = best[node][2]
        return routes

    # ---------------------------------------------------------------- builders

    @classmethod
    def fully_connected(cls, num_devices, bandwidth, latency=0.0, **compute):
        """K devices, a direct link of ``bandwidth`` bytes/s and ``latency`` s between
        every pair: the textbook alpha-beta machine.

        Args:
          num_devices: int K >= 1.
          bandwidth: float bytes/s of each link, per direction.
          latency: float seconds of each link.
          **compute: memory_bandwidth, launch_cost, compute_lanes, cache,
            collective_cost, copy_cost, collective_bandwidth, fresh_memory,
            name (see Topology); by default compute is free.
        """
        links = [(cls.device_node(a), cls.device_node(b), bandwidth, latency)
                 for a in range(num_devices) for b in range(a + 1, num_devices)]
        compute.setdefault("name", f"fully_connected({num_devices})")
        return cls(num_devices, links, **compute)

    @classmethod
    def preset(cls, name):
        """The topology of a named machine (see ``PRESETS``).

        Raises:
          ValueError: an unknown name; the message lists the presets.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown topology preset {name!r}; choose one of "
                             f"{sorted(PRESETS)} or 'host' "
                             f"(tfreduce.analysis.costmodel.host_topology)")
        return PRESETS[name]()

    @classmethod
    def cluster(cls, preset, nodes, nic_bandwidth=12 * GB, latency=_NET_LATENCY):
        """W machines of one preset, one NIC each, joined by a network switch.

        Device w*G + k is GPU k of machine w (G GPUs per machine), so
        "/job:worker/task:w/device:GPU:k" maps to it. Each NIC hangs off
        its machine's first PCIe switch; traffic between machines crosses
        nic{w} -> net -> nic{v}.

        Args:
          preset: str, a name in PRESETS, or a Topology of one machine.
          nodes: int W >= 1.
          nic_bandwidth: float bytes/s per NIC per direction (NCCL counts
            12e9 usable per 100 Gb/s; 24e9 for 200, 48e9 for 400 Gb/s).
          latency: float seconds per network hop.
        """
        one = cls.preset(preset) if isinstance(preset, str) else preset
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes must be an int >= 1, got {nodes!r}")
        per = one.num_devices
        # The NIC's place in each machine: its first PCIe switch, else GPU 0.
        attach = "pcie0" if any(link.src == "pcie0" for link in one.links) else "gpu0"
        links = []
        for w in range(nodes):
            def rename(node, w=w):
                return (cls.device_node(w * per + int(node[3:])) if node.startswith("gpu")
                        else f"m{w}.{node}")
            seen = set()
            for link in one.links:
                pair = tuple(sorted((link.src, link.dst)))
                if pair in seen:
                    continue
                seen.add(pair)
                links.append((rename(link.src), rename(link.dst), link.bandwidth, link.latency))
            links.append((f"m{w}.nic", rename(attach), nic_bandwidth, _PCIE_LATENCY))
            links.append((f"m{w}.nic", "net", nic_bandwidth, latency))
        return cls(nodes * per, links, one.memory_bandwidth, one.launch_cost,
                   name=f"{nodes} x {one.name}")


def _device_links(pairs, per_link, latency):
    return [(Topology.device_node(a), Topology.device_node(b), count * per_link, latency)
            for (a, b), count in pairs.items()]


def _pcie_tree(num_devices, per_switch, bandwidth, socket_link):
    # GPUs behind PCIe switches, switches under two CPU sockets, sockets
    # joined by QPI/UPI (socket_link bytes/s).
    switches = num_devices // per_switch
    links = [(Topology.device_node(k), f"pcie{k // per_switch}", bandwidth, _PCIE_LATENCY)
             for k in range(num_devices)]
    links += [(f"pcie{s}", f"cpu{s * 2 // switches}", bandwidth, _PCIE_LATENCY)
              for s in range(switches)]
    links.append(("cpu0", "cpu1", socket_link, _PCIE_LATENCY))
    return links


def _dgx1(name, links, nvlink_bw, hbm):
    return lambda: Topology(
        8, _device_links(links, nvlink_bw, _NVLINK_LATENCY) + _pcie_tree(8, 2, 12 * GB, 6 * GB),
        memory_bandwidth=hbm, launch_cost=_LAUNCH, name=name)


def _nvswitch(name, links_per_gpu, nvlink_bw, hbm):
    return lambda: Topology(
        8, [(Topology.device_node(k), "nvswitch", links_per_gpu * nvlink_bw, _NVLINK_LATENCY)
            for k in range(8)] + _pcie_tree(8, 2, 24 * GB, 10 * GB),
        memory_bandwidth=hbm, launch_cost=_LAUNCH, name=name)


def _pcie(name, bandwidth, socket_link, hbm):
    return lambda: Topology(8, _pcie_tree(8, 4, bandwidth, socket_link), memory_bandwidth=hbm,
                            launch_cost=_LAUNCH, name=name)


#: Preset name -> function () -> Topology. dgx1-p100 / dgx1-v100: hybrid
#: cube-mesh NVLink (18 / 20 GB/s per link, V100's doubled pairs at 40),
#: other pairs over PCIe gen3 (12 GB/s) and Broadwell QPI (6 GB/s);
#: dgx-a100 / dgx-h100: 12 / 18 NVLinks per GPU into NVSwitch (240 / 371
#: GB/s per GPU per direction); pcie3x8 / pcie4x8: 8 GPUs, 4 per PCIe switch
#: (gen3 12 / gen4 24 GB/s), two sockets (UPI 10 / 22 GB/s).
PRESETS = {
    "dgx1-p100": _dgx1("dgx1-p100", _DGX1P_LINKS, 18 * GB, 732 * GB),
    "dgx1-v100": _dgx1("dgx1-v100", _DGX1V_LINKS, 20 * GB, 900 * GB),
    "dgx-a100": _nvswitch("dgx-a100", 12, 20 * GB, 1555 * GB),
    "dgx-h100": _nvswitch("dgx-h100", 18, 20.6 * GB, 3350 * GB),
    "pcie3x8": _pcie("pcie3x8", 12 * GB, 10 * GB, 900 * GB),
    "pcie4x8": _pcie("pcie4x8", 24 * GB, 22 * GB, 1555 * GB),
}


def check_topology(topology, num_devices=None):
    """Checks a ``topology=`` argument without probing "host".

    Args:
      topology: a tfreduce.Topology, a preset name, or "host".
      num_devices: int K the plan is for, or None (not known yet).

    Returns:
      the Topology, or "host".

    Raises:
      TypeError: topology is neither a Topology nor a str.
      ValueError: an unknown preset, or fewer devices than K.
    """
    if isinstance(topology, str):
        if topology == "host":
            return topology
        topology = Topology.preset(topology)
    elif not isinstance(topology, Topology):
        raise TypeError(f"topology must be a tfreduce.Topology, a preset name or \"host\", "
                        f"got {type(topology).__name__} {topology!r}")
    if num_devices is not None and topology.num_devices < num_devices:
        raise ValueError(f"topology {topology.name!r} has {topology.num_devices} devices, "
                         f"fewer than the {num_devices} given")
    return topology


def ring_time(topology, ring, size, kind="all_reduce"):
    """(seconds, seconds each ring link carries data) of NCCL's ring collective.

    2(G-1) steps for an all-reduce of S (each link carries 2(G-1)/G S),
    G-1 for an all-gather of S per member, a pipelined broadcast of S; the
    narrowest link of the ring sets the bandwidth (costmodel's docstring).
    """
    count = len(ring)
    if count < 2:
        return 0.0, 0.0
    routes = [topology.route(a, b) for a, b in zip(ring, ring[1:] + ring[:1])]
    bandwidth = min([link.bandwidth for route in routes for link in route]
                    + [topology.collective_bandwidth])
    latency = max(sum(link.latency for link in route) for route in routes)
    steps, carried = {"all_reduce": (2 * (count - 1), 2 * (count - 1) * size / count),
                      "all_gather": (count - 1, (count - 1) * size),
                      "broadcast": (count - 1, size)}[kind]
    hold = carried / bandwidth
    return steps * latency + hold, hold


def best_ring(topology, devices):
    """The ring order (a list) of ``devices`` with the widest narrowest link.

    As NCCL searches for its rings: every order for up to 8 devices (5,040
    orders at 8), the given order beyond. Cached per topology and device
    list: the planner's cost model asks again for each candidate it times.
    """
    return list(_best_ring(topology, tuple(devices)))


@functools.lru_cache(maxsize=1024)
def _best_ring(topology, devices):
    def narrowest(order):
        return min(min(link.bandwidth for link in topology.route(a, b))
                   for a, b in zip(order, order[1:] + order[:1]))
    devices = list(devices)
    # One member (a collective over one device) has no ring to search.
    if len(devices) < 2:
        return tuple(devices)
    orders = ([devices[:1] + list(rest) for rest in itertools.permutations(devices[1:])]
              if len(devices) <= 8 else [devices])
    return tuple(max(orders, key=narrowest))
