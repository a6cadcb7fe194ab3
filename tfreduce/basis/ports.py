"""Free TCP ports on this machine for a cluster's workers (their UDP numbers free too).

Standard library only, like the launcher.
"""

import socket

__all__ = ["free_ports"]


def free_ports(count, host="127.0.0.1"):
    """``count`` distinct TCP ports that are free on ``host`` right now, their UDP numbers too.

    All sockets are held open until every port is chosen, so the ports
    differ; they are closed before returning, so another process could take
    one before a worker binds it (the worker then fails with a clear error).

    Args:
      count: int >= 1.
      host: str, the address to probe.

    Returns:
      list of int ports.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    held, ports = [], []
    try:
        while len(ports) < count:
            tcp = socket.socket(family, socket.SOCK_STREAM)
            tcp.bind((host, 0))
            held.append(tcp)  # held to the end: never offered twice
            # The worker's watchdog takes the UDP port of the same number.
            udp = socket.socket(family, socket.SOCK_DGRAM)
            try:
                udp.bind(("", tcp.getsockname()[1]))
            except OSError:
                udp.close()
                continue
            held.append(udp)
            ports.append(tcp.getsockname()[1])
        return ports
    finally:
        for s in held:
            s.close()
