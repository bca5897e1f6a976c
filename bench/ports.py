"""Free TCP ports for the servers tests and benchmarks start on this machine.

A port the OS hands out for ``bind(0)`` comes from the ephemeral range, which the
kernel also uses for the source ports of outgoing connections: between picking it
and the server binding it, some client (an HTTP pool, a ZMQ socket) can take it.
Ports below that range (Linux: 32768-60999) are only ever taken by an explicit
bind, so picking there makes "address already in use" races rare.
"""

from __future__ import annotations

import contextlib
import random
import socket

PORT_RANGE = (20000, 32000)


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on every interface; all are held until all are chosen."""
    rng = random.Random()
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < n:
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                s.bind(("", rng.randrange(*PORT_RANGE)))
            except OSError:
                continue
            ports.append(s.getsockname()[1])
        return ports


def free_port() -> int:
    return free_ports(1)[0]
