"""What an idle client connection holds in a gateway process (``CONNECTION_BYTES`` in
``gateway/http_limits.py``): the gateway's RSS, read from ``/admin/bounds``, before and
after ``--connections`` sockets are opened to its serving port and left silent.

    python -m bench.idle_connections --connections 2000
"""

from __future__ import annotations

import argparse
import socket
import time

import httpx

from bench.gateway_proc import GatewayURL, run_gateway
from bench.polling import wait_for
from bench.sim.launch import sim_fleet


def _bounds(gw: GatewayURL) -> dict:
    return httpx.get(f"{gw.admin}/admin/bounds").json()


def _rss(gw: GatewayURL) -> int:
    time.sleep(1.0)  # let the allocator settle between reads
    return int(_bounds(gw)["process"]["rss_bytes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=2000)
    args = parser.parse_args()
    n = args.connections
    env = {
        "KVGATE_MAX_CLIENT_CONNECTIONS": str(n + 16),
        "KVGATE_TIMEOUTS__CLIENT_HEADERS_S": "600",  # silent connections stay open
    }
    with sim_fleet(1) as (pod,), run_gateway([(pod.name, pod.url)], env=env) as gw:
        port = int(gw.rsplit(":", 1)[1])
        before = _rss(gw)
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]

        def counted() -> bool:
            return _bounds(gw)["structures"]["client_connections"]["size"] == n

        wait_for(counted, 60, what=f"{n} connections counted")
        after = _rss(gw)
        for sock in held:
            sock.close()
    print(f"{n} idle connections: RSS {before / 1e6:.1f} -> {after / 1e6:.1f} MB, "
          f"{(after - before) / n:,.0f} bytes each")  # fmt: skip


if __name__ == "__main__":
    main()
