"""The bound on open client connections (``max_client_connections``,
``gateway/http_limits.py``) and the open-files limit raised to fit the connection
bounds (``gateway/server.py``). A real gateway process, raw sockets for the idle
connections a flood leaves open, the official client for the requests."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import openai
import pytest

from bench.gateway_proc import GatewayURL, run_gateway
from bench.polling import wait_for
from bench.sim.launch import sim_fleet

MODEL = "kvgate-tiny-llama"
LIMIT = 5
ENV = {
    "KVGATE_MAX_CLIENT_CONNECTIONS": str(LIMIT),
    "KVGATE_TIMEOUTS__CLIENT_HEADERS_S": "60",  # idle connections stay open for the test
}


def _open(gw: GatewayURL) -> int:
    s = httpx.get(f"{gw.admin}/admin/bounds").json()["structures"]["client_connections"]
    assert s["capacity"] == LIMIT
    return s["size"]


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


@pytest.fixture
def gateway() -> Iterator[GatewayURL]:
    with (
        sim_fleet(1, itl_s=0.001, default_max_tokens=2) as (pod,),
        run_gateway([(pod.name, pod.url)], env=ENV) as gw,
    ):
        yield gw


def test_past_the_limit_a_connection_gets_503_and_is_closed_and_the_rest_keep_serving(gateway):
    gw = gateway
    with ExitStack() as idle:
        held = [idle.enter_context(_connect(gw)) for _ in range(LIMIT)]
        wait_for(lambda: _open(gw) == LIMIT, 10, what=f"{LIMIT} idle connections counted")

        with _connect(gw) as extra:  # sends nothing: refused on arrival, not on a request
            answer = _read_all(extra)  # ... and closed: the read ends
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ")
        assert b"\r\nretry-after: 1\r\n" in head.lower()
        assert json.loads(body)["error"]["code"] == "gateway_at_capacity"
        assert _open(gw) == LIMIT  # the refused one was never counted

        # The admin listener is not counted: it answered every call above while full.
        metrics = httpx.get(f"{gw.admin}/metrics").text
        assert 'kvgate_requests_refused_total{bound="client_connections"} 1.0' in metrics

        held.pop().close()
        wait_for(lambda: _open(gw) == LIMIT - 1, 10, what="a closed connection released")
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content is not None
        client.close()
    wait_for(lambda: _open(gw) == 0, 10, what="every connection released")


def test_an_idle_connection_counted_is_released_by_the_header_deadline():
    env = {**ENV, "KVGATE_TIMEOUTS__CLIENT_HEADERS_S": "1"}
    with sim_fleet(1) as (pod,), run_gateway([(pod.name, pod.url)], env=env) as gw:
        with _connect(gw) as idle:
            wait_for(lambda: _open(gw) == 1, 10, what="the idle connection counted")
            assert _read_all(idle).startswith(b"HTTP/1.1 408 ")
        wait_for(lambda: _open(gw) == 0, 10, what="the timed-out connection released")


RAISE = """
import resource, sys
from gateway.config import Settings
from gateway.server import OTHER_FILES, raise_open_files_limit
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))
s = Settings(max_client_connections=1000, max_upstream_connections=500)
print(raise_open_files_limit(s), resource.getrlimit(resource.RLIMIT_NOFILE)[0],
      1000 + 500 + OTHER_FILES)
"""


def _raised(soft: int, hard: int) -> tuple[list[int], str]:
    # In a child process: lowering the hard limit cannot be undone without privileges.
    done = subprocess.run([sys.executable, "-c", RAISE, str(soft), str(hard)],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return [int(n) for n in done.stdout.split()], done.stderr


def test_the_open_files_limit_is_raised_to_fit_both_connection_bounds():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # raising it needs privileges
    if hard != resource.RLIM_INFINITY and hard < 2000:
        pytest.skip(f"this machine's hard open-files limit ({hard}) is below the test's 2,000")
    (returned, soft, needed), warned = _raised(256, hard)
    assert returned == soft == needed
    assert "open files limited" not in warned


def test_a_hard_limit_below_the_bounds_is_used_and_warned_about():
    (returned, soft, needed), warned = _raised(256, 1200)
    assert needed > 1200
    assert returned == soft == 1200
    assert "open files limited to 1200" in warned
