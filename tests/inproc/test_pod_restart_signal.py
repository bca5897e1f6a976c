"""How the registry tells a restarted pod from one that kept its process: the
``process_start_time_seconds`` its ``/metrics`` exports (vLLM 0.32's API server, from
prometheus_client's process collector) moving later between two probes.

The pod is a raw HTTP/1.1 server on loopback whose ``/metrics`` and ``/v1/models`` the
test sets; the registry is the gateway's own, and its admit listener counts the
notices the KV index would act on (``KvIndex.pod_admitted``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.config import HealthSettings, PodConfig
from gateway.metrics import GatewayMetrics
from gateway.pods import Pod, PodRegistry, parse_process_start

STARTED = 1_796_330_166.68  # what vLLM exported in a measured run


def models_body(model: str) -> bytes:
    return json.dumps({"object": "list", "data": [{"id": model, "object": "model"}]}).encode()


def metrics_body(started: float | None) -> bytes:
    body = b'vllm:num_requests_waiting{model_name="m"} 0.0\n'
    if started is not None:
        body += b"# TYPE process_start_time_seconds gauge\n"
        body += b"process_start_time_seconds %s\n" % repr(started).encode()
    return body


class FakePod:
    def __init__(self) -> None:
        self.bodies = {"/health": b"", "/v1/models": models_body("m"),
                       "/metrics": metrics_body(STARTED)}  # fmt: skip

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while head := await reader.readuntil(b"\r\n\r\n"):
                body = self.bodies[head.split(b" ", 2)[1].decode()]
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        writer.close()


@contextlib.asynccontextmanager
async def probed(pod: FakePod) -> AsyncIterator[tuple[PodRegistry, Pod, list[int]]]:
    """A registry in front of ``pod``, started (so admitted); and the ``Pod.restarts``
    seen by each admit notice after the first."""
    server = await asyncio.start_server(pod.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = PodConfig(name="p", url=f"http://127.0.0.1:{port}")
    notices: list[int] = []
    try:
        async with httpx.AsyncClient() as client:  # closed first: the pod's reads end
            metrics = GatewayMetrics(CollectorRegistry())
            registry = PodRegistry([cfg], client, HealthSettings(), metrics)
            await registry.probe_all()
            probed_pod = registry.get("p")
            assert probed_pod is not None and probed_pod.healthy
            registry.on_admit(lambda p: notices.append(p.restarts))
            yield registry, probed_pod, notices
    finally:
        server.close()
        await server.wait_closed()


async def test_the_same_process_probe_after_probe_is_no_restart():
    async with probed(FakePod()) as (registry, pod, notices):
        for _ in range(3):
            await registry.probe_all()
        assert (pod.process_start, pod.restarts, notices) == (STARTED, 0, [])


async def test_a_later_process_start_is_one_restart_notice():
    fake = FakePod()
    async with probed(fake) as (registry, pod, notices):
        fake.bodies["/metrics"] = metrics_body(STARTED + 66.6)
        await registry.probe_all()
        await registry.probe_all()
        assert (pod.restarts, notices) == (1, [1])


async def test_an_earlier_start_is_no_restart_and_alternating_processes_count_once():
    """A URL that reaches two processes in turn (a Service in front of two replicas, a
    misconfiguration): the later one counts once; going back and forth, never again."""
    fake = FakePod()
    async with probed(fake) as (registry, pod, notices):
        for started in (STARTED - 10, STARTED + 5, STARTED, STARTED + 5, STARTED):
            fake.bodies["/metrics"] = metrics_body(started)
            await registry.probe_all()
        assert (pod.process_start, pod.restarts, notices) == (STARTED + 5, 1, [1])


@pytest.mark.parametrize(
    "line",
    [b"", b"process_start_time_seconds NaN\n", b"process_start_time_seconds +Inf\n",
     b"process_start_time_seconds -5\n", b'process_start_time_seconds{x="1"} 1e12\n',
     b"process_start_time_seconds " + b"9" * 400 + b"\n",
     b"process_start_time_seconds 1.2.3\n", b"process_start_time_seconds e+\n"],
)  # fmt: skip
async def test_no_usable_start_time_is_never_a_restart(line):
    fake = FakePod()
    async with probed(fake) as (registry, pod, notices):
        fake.bodies["/metrics"] = metrics_body(None) + line
        await registry.probe_all()
        assert (pod.process_start, pod.restarts, notices) == (STARTED, 0, [])
        assert pod.failed_probes == 0  # a garbled line is ignored, not a failed probe


async def test_a_restart_seen_while_ejected_is_left_to_the_readmission():
    """An ejected pod's index entries are already gone and its events are followed anew
    when it is readmitted: its restart is counted, with no notice of its own."""
    fake = FakePod()
    async with probed(fake) as (registry, pod, notices):
        for _ in range(HealthSettings().eject_after_failed_requests):
            await registry.request_failed(pod)
        assert not pod.healthy
        fake.bodies["/metrics"] = metrics_body(STARTED + 30)
        await registry.probe(pod)  # one good probe: not readmitted yet
        assert (pod.healthy, pod.restarts, notices) == (False, 1, [])
        await registry.probe(pod)  # readmitted: the one notice
        assert (pod.healthy, pod.restarts, notices) == (True, 1, [1])


async def test_a_restart_under_another_model_is_one_notice():
    fake = FakePod()
    async with probed(fake) as (registry, pod, notices):
        fake.bodies["/metrics"] = metrics_body(STARTED + 30)
        fake.bodies["/v1/models"] = models_body("other")
        await registry.probe_all()
        assert (pod.engine_model, pod.restarts, notices) == ("other", 1, [1])


async def test_a_model_change_alone_is_still_one_notice():
    fake = FakePod()
    async with probed(fake) as (registry, pod, notices):
        fake.bodies["/v1/models"] = models_body("other")
        await registry.probe_all()
        assert (pod.engine_model, pod.restarts, notices) == ("other", 0, [0])


def test_parse_process_start_reads_the_unlabelled_sample_only():
    labelled = b'process_start_time_seconds{pid="7"} 5e9\n'
    text = labelled + b"process_start_time_seconds 1.79633023326e+09\n"
    assert parse_process_start(text) == 1.79633023326e09
    assert parse_process_start(b"process_start_time_seconds 12\r\n") == 12.0
    assert parse_process_start(b"# process_start_time_seconds 12\n") is None
