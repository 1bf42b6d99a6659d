"""Whether an address's port is free to listen on, and the error a service gives when it is not.

gRPC servers here bind without SO_REUSEPORT (shared.rpc.server), so a second process on a taken port fails instead
of silently sharing the port's connections with the first; `upesi serve` checks every port it will hand out before
it starts anything (services/launcher.py)."""
from __future__ import annotations

import errno
import socket

__all__ = ["ListenError", "in_use"]


class ListenError(OSError):
    """A service cannot listen on its address (the port is taken, or the host is not this machine's)."""


def in_use(address: str) -> bool:
    """True when something on this host already listens on `address` ("host:port", "[v6]:port"); False when the
    port is free, or the host is not one this machine can bind (then the service's own bind reports it)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, ValueError):
        return False
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # closed connections (TIME_WAIT) do not count
            try:
                s.bind(sockaddr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
    return False
