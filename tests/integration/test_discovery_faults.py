"""Discovery against a Kubernetes API that misbehaves: malformed pod objects, watches
that expire or end at once, a discovered pod named like a configured one.

A fake pods API (aiohttp on loopback, in the test's event loop) answers the real
``kubernetes_asyncio`` client that ``PodDiscovery`` builds from a kubeconfig, as in
``test_discovery.py``; lists answer the test's pods, and each watch is played by a
function the test picks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from bench.gateway_proc import free_port
from gateway.config import DiscoverySettings, HealthSettings, PodConfig
from gateway.discovery import DiscoveryMetrics, PodDiscovery, PodSink, RegistrySink
from gateway.metrics import GatewayMetrics
from gateway.pods import PodRegistry
from tests.integration.test_discovery import kubeconfig
from tests.integration.test_discovery_pods import ready_pod

Watch = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FakePodsApi:
    """The pods resource of a fake API server: lists answer ``pods``, watches ``watch``."""

    def __init__(self, pods: list[Any], watch: Watch) -> None:
        self.pods = pods
        self.watch = watch
        self.lists = 0
        self.watches = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch", "").lower() in ("true", "1"):
            self.watches += 1
            return await self.watch(request)
        self.lists += 1
        version = {"resourceVersion": str(100 * self.lists)}
        return web.json_response({"kind": "PodList", "metadata": version, "items": self.pods})


def events_then_hang(*events: dict[str, Any], after: asyncio.Event | None = None) -> Watch:
    """A healthy watch: these events (once ``after`` is set), then the stream stays open."""

    async def play(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if after is not None:
            await after.wait()
        for event in events:
            await resp.write(json.dumps(event).encode() + b"\n")
        await asyncio.Event().wait()  # until discovery stops and the server shuts down
        return resp

    return play


GONE = {
    "kind": "Status",
    "status": "Failure",
    "message": "too old resource version: 100 (200)",
    "reason": "Expired",
    "code": 410,
}


async def gone_status(request: web.Request) -> web.StreamResponse:
    return web.json_response(GONE, status=410)


async def gone_event(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    await resp.write(json.dumps({"type": "ERROR", "object": GONE}).encode() + b"\n")
    return resp


async def closed_at_once(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    return resp


class ListSink:
    """Discovered pods as a dict (no registry, no probes), for tests that only count."""

    def __init__(self) -> None:
        self.pods: dict[str, PodConfig] = {}

    async def upsert(self, cfg: PodConfig) -> None:
        self.pods[cfg.name] = cfg

    async def remove(self, name: str) -> None:
        self.pods.pop(name, None)

    def owned_elsewhere(self, name: str) -> bool:
        return False


@asynccontextmanager
async def discovering(
    api: FakePodsApi, sink: PodSink, tmp_path: Path, backoff_initial_s: float = 0.1
) -> AsyncIterator[tuple[PodDiscovery, CollectorRegistry]]:
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/{namespace}/pods", api.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    settings = DiscoverySettings(
        enabled=True,
        kubeconfig=str(kubeconfig(tmp_path, port)),
        namespace="inference",
        backoff_initial_s=backoff_initial_s,
    )
    prometheus = CollectorRegistry()
    discovery = PodDiscovery(settings, sink, DiscoveryMetrics(prometheus))
    await discovery.start()
    try:
        yield discovery, prometheus
    finally:
        await discovery.stop()
        await runner.cleanup()


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def errors(prometheus: CollectorRegistry, cause: str) -> float:
    value = prometheus.get_sample_value("kvgate_discovery_errors_total", {"cause": cause})
    return value or 0.0


def pod(name: str, ip: str = "10.0.12.34") -> dict[str, Any]:
    """The recorded Ready pod under another name (and IP)."""
    obj = ready_pod()
    obj["metadata"]["name"] = name
    obj["status"]["podIP"] = ip
    return obj


def malformed(change: Callable[[dict[str, Any]], Any]) -> Callable[[str], Any]:
    """A named pod with ``change`` made to it; a ``change`` that returns a value
    replaces the whole item with it."""

    def build(name: str) -> Any:
        obj = pod(name)
        replaced = change(obj)
        return obj if replaced is None else replaced

    return build


def http_port(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["containers"][0]["ports"][0]


MALFORMED = {
    "annotations a list": malformed(lambda o: o["metadata"].update(annotations=["x"])),
    "labels a list": malformed(lambda o: o["metadata"].update(labels=["x"])),
    "metadata a string": malformed(lambda o: o.update(metadata="vllm")),
    "pod a string": malformed(lambda o: "vllm"),
    "a condition a string": malformed(lambda o: o["status"]["conditions"].append("Ready")),
    "a container a string": malformed(lambda o: o["spec"].update(containers=["vllm"])),
    "ports a string": malformed(lambda o: o["spec"]["containers"][0].update(ports="http")),
    "podIP a host and path": malformed(lambda o: o["status"].update(podIP="evil.example.com/x#")),
    "containerPort 99999": malformed(lambda o: http_port(o).update(containerPort=99999)),
}


@pytest.mark.parametrize("bad", MALFORMED.values(), ids=MALFORMED.keys())
async def test_a_malformed_pod_is_counted_and_skipped_and_the_rest_applied(bad, tmp_path):
    """In a list and in a watch: the good pods around it join; nothing is retried."""
    watch = events_then_hang(
        {"type": "ADDED", "object": bad("bad-watched")},
        {"type": "ADDED", "object": pod("good-watched", "10.0.12.36")},
    )
    api = FakePodsApi([pod("good-listed"), bad("bad-listed")], watch)
    sink = ListSink()
    async with discovering(api, sink, tmp_path) as (discovery, prometheus):
        await until(lambda: "good-watched" in sink.pods, "the watched good pod")
        assert set(discovery.members) == set(sink.pods) == {"good-listed", "good-watched"}
        assert errors(prometheus, "bad_object") == 2
        assert (api.lists, api.watches) == (1, 1)  # the bad pods broke neither
        assert errors(prometheus, "other") == 0


@pytest.mark.parametrize(
    "watch", [gone_status, gone_event, closed_at_once], ids=["410", "410 event", "closed"]
)
async def test_a_watch_that_always_expires_or_ends_at_once_backs_off(watch, tmp_path):
    """An API server or proxy that 410s every watch, or closes it at once, gets a
    growing pause between tries (0.1 s doubling here), not lists back to back."""
    api = FakePodsApi([pod("vllm-0")], watch)
    async with discovering(api, ListSink(), tmp_path, backoff_initial_s=0.1) as (_, prometheus):
        await asyncio.sleep(2.0)
        assert 2 <= api.watches <= 8, (api.lists, api.watches)
        assert api.lists <= 8, (api.lists, api.watches)
        if watch is closed_at_once:
            assert api.lists == 1  # nothing expired: the watch resumes, after a pause
            short = errors(prometheus, "short_watch")
            assert api.watches - 1 <= short <= api.watches  # the last may be in flight


def unreachable(name: str) -> dict[str, Any]:
    """A Ready pod on a loopback port nobody listens on: the registry's probe of it
    fails at once, which these tests do not mind."""
    obj = pod(name, "127.0.0.1")
    obj["metadata"]["annotations"]["kvgate.io/port"] = str(free_port())
    return obj


STATIC = PodConfig(
    name="vllm-0",
    url=f"http://127.0.0.1:{free_port()}",
    api_key="sk-static-upstream",
    events_key="ek-static-vllm-0",
)


async def test_discovery_never_replaces_or_removes_a_statically_configured_pod(tmp_path, caplog):
    """A discovered pod named like the configured vllm-0 is listed, updated, deleted:
    vllm-0 keeps its own URL and keys and stays registered; the conflict is counted
    each time and logged once."""
    discovered = unreachable("vllm-0")
    watch = events_then_hang(
        {"type": "MODIFIED", "object": discovered},
        {"type": "DELETED", "object": discovered},
        {"type": "ADDED", "object": unreachable("vllm-1")},
    )
    api = FakePodsApi([discovered], watch)
    async with httpx.AsyncClient() as client:
        health = HealthSettings(probe_timeout_s=0.5)
        registry = PodRegistry([STATIC], client, health, GatewayMetrics(CollectorRegistry()))
        static_pod = registry.get("vllm-0")
        with caplog.at_level(logging.WARNING, logger="kvgate.discovery"):
            sink = RegistrySink(registry)
            async with discovering(api, sink, tmp_path) as (discovery, prometheus):
                await until(lambda: registry.get("vllm-1") is not None, "vllm-1 registered")
                assert registry.get("vllm-0") is static_pod
                assert static_pod is not None and static_pod.config == STATIC
                assert set(discovery.members) == {"vllm-1"}
                assert errors(prometheus, "name_conflict") == 2  # the list and the update
        conflicts = [r for r in caplog.records if "named like a configured pod" in r.message]
        assert len(conflicts) == 1


async def test_a_discovered_pod_that_a_reload_made_static_is_left_to_the_config(tmp_path):
    """Discovery added vllm-0; a reload then configured vllm-0 (replacing it, as
    ``Gateway._apply_pods`` does): discovery's later update and deletion of vllm-0
    leave the configured pod alone."""
    discovered = unreachable("vllm-0")
    reloaded = asyncio.Event()
    watch = events_then_hang(
        {"type": "MODIFIED", "object": discovered},
        {"type": "DELETED", "object": discovered},
        {"type": "ADDED", "object": unreachable("vllm-1")},
        after=reloaded,
    )
    api = FakePodsApi([discovered], watch)
    async with httpx.AsyncClient() as client:
        health = HealthSettings(probe_timeout_s=0.5)
        registry = PodRegistry([], client, health, GatewayMetrics(CollectorRegistry()))
        async with discovering(api, RegistrySink(registry), tmp_path) as (discovery, prometheus):
            await until(lambda: registry.get("vllm-0") is not None, "vllm-0 discovered")
            await RegistrySink(registry).upsert(STATIC)  # the reload's own sink
            reloaded.set()
            await until(lambda: registry.get("vllm-1") is not None, "vllm-1 registered")
            configured = registry.get("vllm-0")
            assert configured is not None and configured.config == STATIC
            assert set(discovery.members) == {"vllm-1"}
            assert errors(prometheus, "name_conflict") == 1  # the update; the deletion: nothing
