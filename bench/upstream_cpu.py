"""CPU per request of the forwarding client, against aiohttp's, in front of the zero pod.

    python -m bench.upstream_cpu [--requests 8000] [--concurrency 8] [--rounds 3]

Each round sends the same ~8 KB chat body ``--requests`` times over ``--concurrency``
keep-alive connections with ``gateway.upstream.Upstream`` and, when aiohttp is
installed (the test extra), with an ``aiohttp.ClientSession`` set up as the gateway's
was (no cookies, no decompression, no automatic headers), one after the other. It
prints each client's CPU per request (this process: the client and the event loop),
the zero pod's CPU per request and the wall time per request. Both clients read every
body whole, as the proxy does for a non-streaming answer. (docs/performance.md, "A
forwarding client of its own".)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop

from bench.ports import free_ports
from bench.zero_pod import MODEL
from gateway.upstream import Upstream

PATH = "/v1/chat/completions"
HEADERS = {"content-type": "application/json", "x-request-id": "bench"}
Send = Callable[[str, bytes], Awaitable[bytes]]


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


async def _ours() -> tuple[Send, Callable[[], Awaitable[None]]]:
    up = Upstream(256, 2.0)
    await up.start()

    async def send(url: str, body: bytes) -> bytes:
        return await (await up.open(url, body, HEADERS)).read()

    return send, up.close


async def _aiohttp() -> tuple[Send, Callable[[], Awaitable[None]]] | None:
    try:
        import aiohttp
    except ImportError:
        return None
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=256),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )

    async def send(url: str, body: bytes) -> bytes:
        resp = await session.post(url, data=body, headers=HEADERS)
        data = await resp.read()
        resp.release()
        return data

    return send, session.close


async def _drive(send: Send, url: str, body: bytes, requests: int, concurrency: int) -> None:
    async def one_connection(n: int) -> None:
        for _ in range(n):
            await send(url, body)

    await asyncio.gather(*(one_connection(requests // concurrency) for _ in range(concurrency)))


async def run(requests: int, concurrency: int, rounds: int) -> None:
    port = free_ports(1)[0]
    pod = subprocess.Popen([sys.executable, "-m", "bench.zero_pod", "--port", str(port)])
    url = f"http://127.0.0.1:{port}{PATH}"
    content = "The quick brown fox jumps over the lazy dog. " * 180  # ~8 KB
    body = json.dumps({"model": MODEL, "max_tokens": 1,
                       "messages": [{"role": "user", "content": content}]}).encode()  # fmt: skip
    hz = os.sysconf("SC_CLK_TCK")
    clients: list[tuple[str, Any]] = [("kvgate", await _ours())]
    other = await _aiohttp()
    if other is None:
        print("aiohttp is not installed (pip install aiohttp): only kvgate's client is measured")
    else:
        clients.append(("aiohttp", other))
    try:
        await asyncio.sleep(1.0)
        for _name, (send, _) in clients:  # warm up: connections, caches
            await _drive(send, url, body, 400, concurrency)
        for r in range(rounds):
            for name, (send, _) in clients:
                cpu0, pod0, wall0 = time.process_time(), _cpu_ticks(pod.pid), time.perf_counter()
                await _drive(send, url, body, requests, concurrency)
                n = requests // concurrency * concurrency
                cpu = (time.process_time() - cpu0) / n * 1e6
                pod_cpu = (_cpu_ticks(pod.pid) - pod0) / hz / n * 1e6
                wall = (time.perf_counter() - wall0) / n * 1e6
                print(f"round {r + 1} {name:8s} client CPU {cpu:6.1f} µs/req   "
                      f"zero pod CPU {pod_cpu:5.1f} µs/req   wall {wall:6.1f} µs/req")  # fmt: skip
    finally:
        for _, (_, close) in clients:
            await close()
        pod.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    uvloop.run(run(args.requests, args.concurrency, args.rounds))


if __name__ == "__main__":
    main()
