"""OpenTelemetry traces of the gateway (``tracing.enabled``): W3C trace context in and
out, a span per phase of a request, OTLP/HTTP export.

One trace per request, the child of the client's ``traceparent`` when it sends one:

    kvgate.request (server)
      kvgate.parse                     body read and parsed, model resolved
      kvgate.tokenize                  the prompt rendered to token ids (index strategies)
      kvgate.index_lookup              the KV index asked who holds the prefix
      kvgate.queue_wait                admission control (admission.enabled)
      kvgate.choose                    the strategy picks a pod
      kvgate.upstream (client)         one attempt on one pod; its context goes upstream
        kvgate.upstream_connect        connection, request sent, response headers back
        kvgate.first_byte              until the first body chunk (a buffered answer: all)
        kvgate.stream                  the rest of a streamed answer

The pod receives ``traceparent`` (and ``tracestate``) naming ``kvgate.upstream``, so a
vLLM started with ``--otlp-traces-endpoint`` puts its own spans in the same trace.

Off by default and free when off: the OpenTelemetry SDK is imported only when tracing
is enabled (``pip install 'kvgate[otel]'``), the proxy's hot path checks one attribute,
and ``span`` (used below the proxy, e.g. by the index) reads one context variable and
returns a shared no-op. With tracing off the client's own ``traceparent`` and
``tracestate`` still go upstream unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any

from gateway.asgi import Message, Send
from gateway.config import TracingSettings

_NULL = contextlib.nullcontext()
# The tracer of the request being served, set only while a traced request runs.
_tracer: contextvars.ContextVar[Any] = contextvars.ContextVar("kvgate_tracer", default=None)

PROPAGATED = ("traceparent", "tracestate")


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A child span of the current request's trace; a shared no-op when it has none."""
    tracer = _tracer.get()
    if tracer is None:
        return _NULL
    return tracer.start_as_current_span(name, attributes=attributes or None)


def forward_client_context(headers: Mapping[str, str], upstream: dict[str, str]) -> None:
    """The client's W3C trace context, as it sent it, for the pod (tracing off)."""
    for name in PROPAGATED:
        value = headers.get(name)
        if value is not None:
            upstream[name] = value


class Tracing:
    """The gateway's tracer provider, its OTLP exporter and the W3C propagator."""

    def __init__(self, settings: TracingSettings) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:
            raise RuntimeError(
                "tracing.enabled needs the OpenTelemetry SDK: pip install 'kvgate[otel]'"
            ) from exc
        self._trace = trace
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name}),
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
        )
        exporter = OTLPSpanExporter(endpoint=settings.otlp_endpoint, headers=settings.headers,
                                    timeout=settings.timeout_s)  # fmt: skip
        self._provider.add_span_processor(
            BatchSpanProcessor(exporter, max_queue_size=settings.max_queued_spans)
        )
        self.tracer = self._provider.get_tracer("kvgate")
        self._propagator = TraceContextTextMapPropagator()

    @contextlib.contextmanager
    def request(self, headers: Mapping[str, str], path: str, send: Send) -> Iterator[Send]:
        """The request's root span around the block (the client's trace context as its
        parent); yields ``send`` wrapped to record the response status on it."""
        parent = self._propagator.extract(headers)
        kind = self._trace.SpanKind.SERVER
        attributes = {"http.request.method": "POST", "url.path": path}
        token = _tracer.set(self.tracer)
        try:
            with self.tracer.start_as_current_span("kvgate.request", context=parent, kind=kind,
                                                   attributes=attributes) as root:  # fmt: skip

                async def recording(message: Message) -> None:
                    if message["type"] == "http.response.start":
                        root.set_attribute("http.response.status_code", message["status"])
                    await send(message)

                yield recording
        finally:
            _tracer.reset(token)

    def upstream(self, pod: str, url: str) -> contextlib.AbstractContextManager[Any]:
        """One attempt's client span; ``inject`` inside it hands the pod its context."""
        return self.tracer.start_as_current_span(
            "kvgate.upstream", kind=self._trace.SpanKind.CLIENT,
            attributes={"kvgate.pod": pod, "url.full": url},
        )  # fmt: skip

    def inject(self, upstream: dict[str, str]) -> None:
        """The current span's W3C trace context into the pod's request headers."""
        self._propagator.inject(upstream)

    def annotate(self, **attributes: Any) -> None:
        """Attributes on the current span (e.g. the model, the chosen pod)."""
        current = self._trace.get_current_span()
        for key, value in attributes.items():
            if value is not None:
                current.set_attribute(key, value)

    def shutdown(self) -> None:
        """Export what is buffered, then stop."""
        self._provider.shutdown()
