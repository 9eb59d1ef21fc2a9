"""One process per port: a server refuses an address something already listens on.

gRPC sets SO_REUSEPORT by default, which lets a second server bind the same port and the kernel split new
connections between the two: different models, caches and figures behind one address. Our servers turn
it off (SERVER_OPTIONS) and check the port before they bind (`check_free`), so that a busy port is said
in one line, not in gRPC's log.
"""

from __future__ import annotations

import errno
import socket

# gRPC server options: no SO_REUSEPORT, so that a second bind of a port in use fails.
SERVER_OPTIONS = [("grpc.so_reuseport", 0)]


class PortInUse(RuntimeError):
    """Something already listens on the port a server was asked to bind."""

    def __init__(self, port: int):
        super().__init__(f"port {port} is already in use")
        self.port = port


def check_free(host: str, port: int) -> None:
    """Raises PortInUse when binding host:port fails because the address is in use (port 0, a host that
    does not resolve or an address this machine lacks: left to the server's own bind)."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, UnicodeError):
        return
    for family, kind, proto, _, address in addresses:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:
            continue
        with probe:
            # As servers bind: a port whose old connections linger in TIME_WAIT is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise PortInUse(port) from None
