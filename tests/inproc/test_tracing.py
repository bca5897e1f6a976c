"""OpenTelemetry: the client's W3C trace context reaches the pod; with tracing on, the
gateway's spans (one per phase) go to an OTLP/HTTP receiver and the pod is handed the
context of the attempt's span, so its own spans join the same trace."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.inproc.harness import STREAM_CHAT, inproc_gateway
from tests.inproc.scripted_pod import MODEL, SSE_DONE, delta, sse, stream
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def tracing(receiver: OtlpReceiver, **options: object) -> dict:
    return {"enabled": True, "otlp_endpoint": receiver.endpoint, **options}


def by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    names = [s.name for s in spans]
    assert len(names) == len(set(names)), names
    return {s.name: s for s in spans}


def python_says(script: str) -> str:
    """The last line ``script`` prints, run in a fresh interpreter (nothing imported yet)."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


def sampled(flags: str) -> bool:
    """The W3C sampled bit (0x02, a random trace id, may be set too)."""
    return bool(int(flags, 16) & 0x01)


def traceparent_parts(value: str) -> tuple[str, str, str]:
    version, trace_id, span_id, flags = value.split("-")
    assert version == "00"
    return trace_id, span_id, flags


async def test_with_tracing_off_the_clients_trace_context_goes_to_the_pod_unchanged(pod_a):
    headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}
    async with inproc_gateway(pod_a) as g:
        assert g.gw.proxy.handle == g.gw.proxy._handle  # no tracing wrapper at all
        assert (await g.chat(headers=headers)).status_code == 200
    sent = pod_a.received[0].headers
    assert (sent["traceparent"], sent["tracestate"]) == (TRACEPARENT, "vendor=abc")


def test_with_tracing_off_the_opentelemetry_sdk_is_never_imported():
    # (FastAPI itself imports the OpenTelemetry API; the otel extra's SDK and exporter
    # are what tracing adds.)
    script = (
        "import asyncio, sys\n"
        "from gateway.app import create_app\n"
        "from gateway.config import Settings\n"
        "app = create_app(Settings(pods=['a=http://127.0.0.1:9']))\n"
        "async def main():\n"
        "    async with app.router.lifespan_context(app):\n"
        "        pass\n"
        "asyncio.run(main())\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))\n"
    )
    assert python_says(script) == "[]"


async def test_a_streamed_request_is_one_trace_under_the_clients_span_and_the_pod_joins_it(
    pod_a, receiver
):
    pod_a.script(stream([sse(delta("Hel")), sse(delta("lo")), SSE_DONE]))
    async with inproc_gateway(pod_a, tracing=tracing(receiver)) as g:
        response = await g.client.post("/v1/chat/completions", json=STREAM_CHAT,
                                       headers={"traceparent": TRACEPARENT})  # fmt: skip
        assert response.status_code == 200
    spans = by_name(receiver.trace(TRACE_ID))
    assert set(spans) == {"kvgate.request", "kvgate.parse", "kvgate.choose",
                          "kvgate.upstream", "kvgate.upstream_connect", "kvgate.first_byte",
                          "kvgate.stream"}  # fmt: skip
    root, upstream = spans["kvgate.request"], spans["kvgate.upstream"]
    assert (root.parent_span_id, root.kind, root.service) == (CLIENT_SPAN, SERVER, "kvgate")
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["kvgate.model"] == MODEL
    assert root.attributes["kvgate.strategy"] == "round-robin"
    for name in ("kvgate.parse", "kvgate.choose", "kvgate.upstream"):
        assert spans[name].parent_span_id == root.span_id, name
    for name in ("kvgate.upstream_connect", "kvgate.first_byte", "kvgate.stream"):
        assert spans[name].parent_span_id == upstream.span_id, name
    assert (upstream.kind, upstream.attributes["kvgate.pod"]) == (CLIENT, "pod-a")
    # The pod is handed the attempt's span as its parent, in the client's trace.
    assert traceparent_parts(pod_a.received[0].headers["traceparent"]) == (
        TRACE_ID, upstream.span_id, "01")  # fmt: skip


async def test_tokenize_index_lookup_and_queue_wait_are_spans_of_their_own(pod_a, receiver):
    body = {"model": MODEL, "prompt": list(range(100)), "max_tokens": 1}
    async with inproc_gateway(pod_a, strategy="kv-aware", admission={"enabled": True},
                              tracing=tracing(receiver)) as g:  # fmt: skip
        response = await g.client.post("/v1/completions", json=body,
                                       headers={"traceparent": TRACEPARENT})  # fmt: skip
        assert response.status_code == 200
    spans = by_name(receiver.trace(TRACE_ID))
    assert {"kvgate.tokenize", "kvgate.index_lookup", "kvgate.queue_wait"} <= set(spans)
    assert "kvgate.choose" not in spans  # admission control chose, while it weighed the request
    root = spans["kvgate.request"]
    for name in ("kvgate.tokenize", "kvgate.index_lookup", "kvgate.queue_wait"):
        assert spans[name].parent_span_id == root.span_id, name
    assert root.attributes["kvgate.strategy"] == "kv-aware"
    assert root.attributes["kvgate.predicted_ttft_s"] > 0


async def test_without_a_client_context_the_gateway_starts_the_trace_the_pod_joins(pod_a, receiver):
    async with inproc_gateway(pod_a, tracing=tracing(receiver)) as g:
        assert (await g.chat()).status_code == 200
    trace_id, parent, flags = traceparent_parts(pod_a.received[0].headers["traceparent"])
    spans = by_name(receiver.trace(trace_id))
    assert spans["kvgate.request"].parent_span_id == ""
    assert spans["kvgate.upstream"].span_id == parent
    assert sampled(flags)


async def test_an_error_answer_is_traced_with_its_status(pod_a, receiver):
    headers = {"traceparent": TRACEPARENT}
    async with inproc_gateway(pod_a, tracing=tracing(receiver)) as g:
        response = await g.client.post("/v1/chat/completions", content=b"{not json",
                                       headers=headers)  # fmt: skip
        assert response.status_code == 400
    spans = by_name(receiver.trace(TRACE_ID))
    assert spans["kvgate.request"].attributes["http.response.status_code"] == 400
    assert "kvgate.upstream" not in spans and pod_a.received == []


async def test_unsampled_traces_are_not_exported_but_the_pod_still_gets_the_context(
    pod_a, receiver
):
    async with inproc_gateway(pod_a, tracing=tracing(receiver, sample_ratio=0.0)) as g:
        assert (await g.chat()).status_code == 200
    _, _, flags = traceparent_parts(pod_a.received[0].headers["traceparent"])
    assert not sampled(flags) and receiver.spans == []


def test_tracing_without_the_sdk_fails_at_start_up_and_says_what_to_install():
    script = (
        "import sys\n"
        "sys.modules['opentelemetry.sdk'] = None\n"  # as if the otel extra were missing
        "from gateway.config import TracingSettings\n"
        "from gateway.tracing import Tracing\n"
        "try:\n"
        "    Tracing(TracingSettings(enabled=True))\n"
        "except RuntimeError as exc:\n"
        "    print(exc)\n"
    )
    assert "pip install 'kvgate[otel]'" in python_says(script)
