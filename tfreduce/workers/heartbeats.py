"""The UDP heartbeats of one worker with its peers: who was heard, when, and who has gone.

``tfreduce.workers.watchdog`` judges by them. Each worker listens on the UDP
port of its gRPC server's number (UDP and TCP ports are separate spaces),
or on any port when another program holds that one: a peer's heartbeats
are answered where they come from. A peer's first heartbeat is answered at
once, so two workers hear each other within a round trip of the later
one's start, and ``wait_for_peers`` ends then. Datagrams of another
cluster that reuses a port are told apart by a hash of the cluster spec.
Standard library only (the launcher imports the watchdog without
TensorFlow).
"""

import hashlib
import json
import socket
import sys
import threading
import time

__all__ = ["Heartbeats", "address_of"]

# Bytes of one heartbeat, at most.
_DATAGRAM = 4096


class Heartbeats:
    """This worker's UDP socket and what its peers' heartbeats told.

    Args:
      cluster: tfreduce.Cluster, this worker's (rank, addresses, spec).

    Attributes:
      run: str, the hash of the cluster spec every heartbeat carries.
      port: int, the UDP port this worker listens on.
      heard: dict rank -> (monotonic time, the peer's last heartbeat, a dict).
      gone: set of ranks that said goodbye ("bye" or "failed").
      failed: dict rank -> the error line of a peer that an error ended.

    Raises:
      OSError: no UDP port can be opened.
    """

    def __init__(self, cluster):
        self.cluster = cluster
        # Where each peer listens: its server's port number, until its own
        # heartbeats come from elsewhere.
        self._peers = {r: address_of(cluster.address(r)) for r in range(cluster.num_workers)
                       if r != cluster.rank}
        self.run = hashlib.sha256(json.dumps(cluster.cluster_spec, sort_keys=True)
                                  .encode()).hexdigest()[:16]
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self._socket.bind(("", address_of(cluster.address())[1]))
        except OSError:
            self._socket.bind(("", 0))  # another program holds it: any port will do
        self.port = self._socket.getsockname()[1]
        self.heard, self.gone, self.failed = {}, set(), {}
        self._all_heard = threading.Event()

    @property
    def peers(self):
        """list of int, the peers' ranks."""
        return sorted(self._peers)

    def set_timeout(self, seconds):
        """How long ``receive`` waits for a datagram."""
        self._socket.settimeout(seconds)

    def send(self, beat, to=None):
        """Sends `beat` (a dict; the run and this rank are added) to every peer, or to rank `to`."""
        data = json.dumps({"run": self.run, "rank": self.cluster.rank, **beat}).encode()
        for rank, where in list(self._peers.items()):
            if to is None or rank == to:
                self.send_to(data, where)

    def send_to(self, data, where):
        """Sends bytes to (host, port); a host unreachable now is left to its silence."""
        try:
            self._socket.sendto(data, where)
        except OSError:
            pass

    def receive(self):
        """Waits (up to the timeout) for one heartbeat of this run and records it.

        Returns:
          (rank, its first heartbeat?) of the peer heard, or None (nothing
          came, or a datagram of another run).
        """
        try:
            data, source = self._socket.recvfrom(_DATAGRAM)
            beat = json.loads(data.decode())
            rank = int(beat["rank"])
        except (socket.timeout, OSError, ValueError, KeyError, TypeError):
            return None
        if rank not in self._peers or beat.get("run") != self.run:
            return None
        first = rank not in self.heard
        self._peers[rank] = source  # answered where it sends from
        if beat.get("kind") in ("bye", "failed"):
            self.gone.add(rank)
        if beat.get("kind") == "failed":
            self.failed[rank] = beat.get("error") or "an error"
        self.heard[rank] = (time.monotonic(), beat)
        if len(self.heard) == len(self._peers):
            self._all_heard.set()
        return rank, first

    def unheard(self):
        """list of int, the peers never heard."""
        return sorted(set(self._peers) - set(self.heard))

    def wait_for_peers(self, bound, slow):
        """Waits until every peer was heard, at most `bound` seconds (another thread receives).

        After `slow` seconds it says once on stderr whom it waits for.

        Returns:
          list of int, the ranks not heard within `bound` (empty: all were).
        """
        start, told = time.monotonic(), False
        while not self._all_heard.wait(0.2):
            waited = time.monotonic() - start
            if waited >= bound:
                return self.unheard()
            if not told and waited >= slow:
                told = True
                names = ", ".join(self.cluster.describe(r) for r in self.unheard())
                print(f"tfreduce watchdog: {self.cluster.describe(self.cluster.rank)}: no "
                      f"heartbeat yet from {names} after {waited:.0f} s (still starting?); "
                      f"waiting up to the collectives' timeout ({bound:g} s)",
                      file=sys.stderr, flush=True)
        return []

    def close(self):
        self._socket.close()


def address_of(host_port):
    """("host", port) of "host:port" or "[v6]:port"."""
    host, port = host_port.rsplit(":", 1)
    return host.strip("[]"), int(port)
