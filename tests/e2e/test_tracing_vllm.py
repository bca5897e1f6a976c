"""One trace through kvgate and a real vLLM: both export OTLP to the same receiver.

vLLM 0.32 (whose own requirements bring the OpenTelemetry SDK and exporters) starts
with ``--otlp-traces-endpoint`` and the HTTP/protobuf protocol; ``kvgate serve``
starts with ``tracing.enabled`` pointed at the same receiver. A client request with a
``traceparent`` must come back as one trace: kvgate's spans under the client's span,
and vLLM's request span under kvgate's ``kvgate.upstream`` span.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from bench.gateway_proc import run_gateway
from bench.vllm_pods import MODEL_NAME, VllmServer
from tests.e2e.prompts import prompt_text
from tests.otlp_receiver import OtlpReceiver

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
FLUSH_FAST = {"OTEL_BSP_SCHEDULE_DELAY": "200"}  # export every 200 ms, not every 5 s


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def traced_pod(
    vllm_venv_python: Path,
    tiny_model_dir: Path,
    receiver: OtlpReceiver,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmServer]:
    """A vLLM of its own: the session's pods were started without tracing. Like the
    LoRA pod it gets a second start if the first dies beside the session's pods on a
    busy machine (the log keeps both)."""
    log = tmp_path_factory.mktemp("vllm-traced") / "vllm-traced.log"
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", **FLUSH_FAST}
    server = VllmServer(vllm_venv_python, tiny_model_dir, log, name="vllm-traced",
                        extra_args=["--otlp-traces-endpoint", receiver.endpoint],
                        extra_env=env)  # fmt: skip
    with server:
        try:
            server.launch()
        except RuntimeError:
            server.stop()
            server.launch()
        yield server


def test_one_trace_holds_the_gateways_spans_and_vllms_under_them(traced_pod, receiver, nonce):
    env = {"KVGATE_TRACING__ENABLED": "true",
           "KVGATE_TRACING__OTLP_ENDPOINT": receiver.endpoint, **FLUSH_FAST}  # fmt: skip
    with run_gateway([("traced", traced_pod.url)], env=env) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        chunks = list(client.chat.completions.create(
            model=MODEL_NAME, max_tokens=4, stream=True,
            messages=[{"role": "user", "content": prompt_text(nonce, 20)}],
            extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
        ))  # fmt: skip
        assert chunks
        receiver.wait_for_spans(TRACE_ID, {"kvgate.request", "kvgate.upstream", "kvgate.stream"})
    kvgate = {s.name: s for s in receiver.trace(TRACE_ID) if s.service == "kvgate"}
    assert kvgate["kvgate.request"].parent_span_id == CLIENT_SPAN
    assert {"kvgate.parse", "kvgate.choose", "kvgate.upstream_connect",
            "kvgate.first_byte"} <= set(kvgate)  # fmt: skip
    upstream = kvgate["kvgate.upstream"]
    assert upstream.attributes["kvgate.pod"] == "traced"
    # vLLM's request span is the child of the attempt kvgate made on it.
    receiver.wait_for_spans(TRACE_ID, {"llm_request"}, timeout=30)
    vllm = [s for s in receiver.trace(TRACE_ID) if s.service != "kvgate"]
    request_spans = [s for s in vllm if s.name == "llm_request"]
    assert len(request_spans) == 1
    assert request_spans[0].parent_span_id == upstream.span_id
    vllm_span = request_spans[0].attributes
    assert vllm_span["gen_ai.usage.completion_tokens"] == 4  # vLLM's own account of it
    assert vllm_span["gen_ai.usage.prompt_tokens"] > 20
