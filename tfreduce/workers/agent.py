"""The launcher as the workers' agent: whom a watchdog named frozen, told over UDP.

A frozen worker cannot end itself, and its peers on other hosts cannot end
it: the process that started it can. ``tfreduce-launch`` opens an
``Agent`` on loopback and gives every worker its address in
``TFREDUCE_AGENT``; a watchdog that names a peer frozen sends one report
(``tell``), and the launcher kills that worker at once instead of letting
it wait out the grace period. Standard library only.
"""

import json
import os
import socket

__all__ = ["AGENT_ENV", "Agent", "tell"]

#: The environment variable with the "host:port" (UDP) where the launcher
#: hears which worker a watchdog named.
AGENT_ENV = "TFREDUCE_AGENT"


def tell(by, worker, why):
    """Reports to the launcher of this process (``AGENT_ENV``) that `worker` was named.

    Args:
      by: str, the naming worker's "host:port" (its address in TF_CONFIG).
      worker: str, the named worker's "host:port".
      why: str, e.g. "frozen".
    """
    where = os.environ.get(AGENT_ENV)
    if not where:
        return  # not started by the launcher
    host, port = where.rsplit(":", 1)
    report = json.dumps({"kind": "named", "why": why, "by": by, "worker": worker}).encode()
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                       socket.SOCK_DGRAM) as sender:
        for _ in range(3):  # datagrams may be lost
            try:
                sender.sendto(report, (host.strip("[]"), int(port)))
            except OSError:
                return


class Agent:
    """The launcher's end: a UDP socket the workers' reports arrive on.

    Args:
      host: str, the address the workers reach the launcher at.

    Attributes:
      address: str, "host:port", the workers' ``AGENT_ENV``.
    """

    def __init__(self, host):
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                     socket.SOCK_DGRAM)
        self._socket.bind((host, 0))
        self._socket.setblocking(False)
        port = self._socket.getsockname()[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def named(self, addresses):
        """{worker index: (index of the worker that named it, why)} reported since the last call.

        Args:
          addresses: list of str, the workers' "host:port" of this start
            (reports of another start's workers are dropped).
        """
        found = {}
        while True:
            try:
                report = json.loads(self._socket.recv(4096).decode())
                worker, by = addresses.index(report["worker"]), addresses.index(report["by"])
            except OSError:  # nothing more now (BlockingIOError), or closed
                return found
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # not one of this start's reports
            if report.get("kind") == "named":
                found.setdefault(worker, (by, str(report.get("why", "frozen"))))

    def close(self):
        self._socket.close()
