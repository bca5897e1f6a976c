"""What the registry makes of a pod's probe answers when the pod misbehaves: garbage in
``/metrics`` or ``/v1/models``, answers dripped a byte at a time, oversized bodies and
cards. A failed probe, never an exception out of the registry; values routing can use.

The pod is a raw HTTP/1.1 server on loopback whose answer to each probe path the test
sets; the registry is the gateway's own, with the gateway's httpx client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.config import HealthSettings, PodConfig
from gateway.metrics import GatewayMetrics
from gateway.pods import MAX_SCRAPED_VALUE, MODEL_CARD_BYTES, PodRegistry, parse_engine_load
from routing.strategy_registry import build_strategy
from routing.types import PodView, RouteRequest

PROBE_TIMEOUT_S = 0.5
IDLE_METRICS = b'vllm:num_requests_waiting{model_name="m"} 0.0\n'
MODELS = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()

Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]


def whole(body: bytes, status: int = 200) -> Answer:
    async def write(w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body))
        await w.drain()

    return write


def dripped(body: bytes, every_s: float) -> Answer:
    """A chunked answer, one byte every ``every_s``: each read well within any timeout."""

    async def write(w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for byte in body:
            w.write(b"1\r\n%c\r\n" % byte)
            await w.drain()
            await asyncio.sleep(every_s)
        w.write(b"0\r\n\r\n")

    return write


class Pod:
    def __init__(self) -> None:
        self.answers: dict[str, Answer] = {
            "/health": whole(b""), "/v1/models": whole(MODELS), "/metrics": whole(IDLE_METRICS)
        }  # fmt: skip
        self.port = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while head := await reader.readuntil(b"\r\n\r\n"):
                path = head.split(b" ", 2)[1].decode()
                await self.answers[path](writer)
        writer.close()


@contextlib.asynccontextmanager
async def registry_for(pod: Pod) -> AsyncIterator[tuple[PodRegistry, PodConfig]]:
    server = await asyncio.start_server(pod.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = PodConfig(name="p", url=f"http://127.0.0.1:{port}")
    health = HealthSettings(probe_timeout_s=PROBE_TIMEOUT_S, eject_after_failed_probes=1)
    async with httpx.AsyncClient() as client:
        registry = PodRegistry([cfg], client, health, GatewayMetrics(CollectorRegistry()))
        try:
            yield registry, cfg
        finally:
            server.close()


GARBAGE_METRICS = [
    b"vllm:num_requests_waiting +Inf\n",
    b'vllm:num_requests_waiting{engine="0"} 1e308\nvllm:num_requests_waiting{engine="1"} 1e308\n',
    b"vllm:num_requests_running NaN\nvllm:kv_cache_usage_perc NaN\n",
    b"vllm:num_requests_waiting -5\n",
    b'vllm:cache_config_info{num_gpu_blocks="' + b"9" * 400 + b'"} 1.0\n',
]


@pytest.mark.parametrize("metrics", GARBAGE_METRICS)
async def test_garbage_gauges_give_a_finite_clamped_load(metrics):
    pod = Pod()
    pod.answers["/metrics"] = whole(metrics)
    async with registry_for(pod) as (registry, cfg):
        await registry.start()  # must not raise
        probed = registry.get("p")
        engine = probed.engine
        values = (engine.waiting, engine.running, engine.kv_usage, engine.kv_capacity_blocks)
        assert all(math.isfinite(v) and 0 <= v <= MAX_SCRAPED_VALUE for v in values), values
        assert probed.healthy  # the pod answered; only its gauges were garbage
        await registry.stop()


def test_parse_engine_load_skips_what_is_not_finite_and_clamps_the_rest():
    text = "vllm:num_requests_waiting +Inf\nvllm:num_requests_running 1e300\n"
    text += "vllm:kv_cache_usage_perc -0.5\n"
    assert parse_engine_load(text) == {"running": MAX_SCRAPED_VALUE, "kv_usage": 0.0}


async def test_models_json_nested_past_the_parsers_limit_is_a_failed_probe():
    pod = Pod()
    pod.answers["/v1/models"] = whole(b"[" * 100_000)
    async with registry_for(pod) as (registry, _):
        await registry.start()  # must not raise
        probed = registry.get("p")
        assert not probed.healthy and probed.failed_probes == 1
        await registry.refresh_models()  # the re-read a request may trigger: no raise either


async def test_a_pod_dripping_its_answer_fails_its_probe_within_the_timeout():
    pod = Pod()
    pod.answers["/metrics"] = dripped(IDLE_METRICS * 10, every_s=0.1)  # ~46 s in all
    async with registry_for(pod) as (registry, _):
        started = time.monotonic()
        await registry.start()
        assert time.monotonic() - started < 3 * PROBE_TIMEOUT_S  # not the pod's pace
        assert registry.get("p").failed_probes == 1


async def test_an_oversized_answer_is_a_failed_probe():
    pod = Pod()
    pod.answers["/metrics"] = whole(IDLE_METRICS * 500_000)  # ~23 MB
    async with registry_for(pod) as (registry, _):
        await registry.start()
        assert registry.get("p").failed_probes == 1


async def test_a_model_card_is_kept_at_its_bounded_size_whatever_the_pod_adds():
    junk = "x" * 1_000_000
    card = {"id": "m", "object": "model", "owned_by": "vllm", "parent": None,
            "max_model_len": 4096, "permission": [{"junk": junk}], "extra": junk,
            "root": junk}  # fmt: skip
    pod = Pod()
    pod.answers["/v1/models"] = whole(json.dumps({"data": [card]}).encode())
    async with registry_for(pod) as (registry, _):
        tracemalloc.start()
        await registry.start()
        kept = registry.get("p").model_cards
        size = sum(tracemalloc.get_traced_memory()[:1])
        tracemalloc.stop()
    assert kept == {"m": {"id": "m", "object": "model", "owned_by": "vllm", "parent": None,
                          "max_model_len": 4096}}  # fmt: skip
    assert size < 100 * MODEL_CARD_BYTES  # not the megabytes the pod sent


async def test_huge_queue_gauges_do_not_break_kv_aware_for_the_other_pods():
    pod = Pod()
    pod.answers["/metrics"] = whole(b"vllm:num_requests_waiting 1e306\n")
    async with registry_for(pod) as (registry, _):
        await registry.start()
        flooded = registry.get("p").engine
    strategy = build_strategy("kv-aware")
    views = [PodView(id="bad", waiting=flooded.waiting, running=flooded.running),
             PodView(id="good")]  # fmt: skip
    decision = strategy.choose(RouteRequest(model="m", prompt_tokens=100), views, None, 0.0)
    assert decision.pod == "good"
