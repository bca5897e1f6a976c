"""Forwarding OpenAI requests to the chosen pod: retries, streaming, accounting.

Rules (DESIGN.md, request lifecycle):
- load is counted at dispatch and released in ``finally``;
- a connect error, a 5xx or a dropped connection before the first body byte is
  retried on another pod (bounded attempts, exponential backoff); after the first
  byte reached the client, a failure becomes one SSE error event and the stream
  closes;
- the client's bytes go upstream untouched and the pod's bytes come back chunk by
  chunk; a client that disconnects cancels the upstream request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway.config import Settings
from gateway.errors import GatewayError, sse_error_event
from gateway.metrics import GatewayMetrics
from gateway.openai_body import Kind, ParsedRequest, parse_body
from gateway.pods import Pod, PodRegistry
from gateway.router import Router
from routing.core import Routed
from routing.types import Outcome

log = logging.getLogger("kvgate.proxy")

_PASS_RESPONSE_HEADERS = ("content-type",)
_USAGE_TAIL_BYTES = 16 * 1024


class _Retryable(Exception):
    def __init__(self, error: GatewayError, cause: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.cause = cause


@dataclass(slots=True)
class _Attempt:
    """Everything the finishing code needs about one dispatched request."""

    pod: Pod
    routed: Routed  # the routing core's record: decision, strategy, held load
    arrived: float
    model: str
    ttft_s: float | None = None
    recorded: bool = False

    @property
    def strategy(self) -> str:
        return self.routed.strategy.name


class _GuardedStream(StreamingResponse):
    """A stream whose clean-up runs even if the client leaves before it starts."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        **kwargs: Any,
    ) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


class Proxy:
    def __init__(
        self,
        settings: Settings,
        client: httpx.AsyncClient,
        registry: PodRegistry,
        router: Router,
        metrics: GatewayMetrics,
    ) -> None:
        self._s = settings
        self._client = client
        self._registry = registry
        self._router = router
        self._metrics = metrics
        t = settings.timeouts
        self._timeout = httpx.Timeout(
            connect=t.connect_s, read=t.first_byte_s, write=t.first_byte_s, pool=t.connect_s
        )

    # -- entry point --

    async def handle(self, request: Request, kind: Kind) -> Response:
        """Answer one OpenAI request (the caller has checked the client's credentials)."""
        arrived = time.perf_counter()
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"x-request-id": request_id}
        model = ""
        try:
            raw = await read_limited(request, self._s.max_body_bytes)
            parsed = parse_body(raw, kind)
            model = self._resolve_model(parsed)
            return await self._dispatch(request, parsed, model, request_id, arrived)
        except GatewayError as err:
            strategy = self._router.strategy_for(model).name if model else ""
            self._metrics.requests.labels(model, "", strategy, str(err.status)).inc()
            return err.response(headers)

    def _resolve_model(self, parsed: ParsedRequest) -> str:
        known = self._registry.known_models()
        model = parsed.model
        if model is None:  # /tokenize and /detokenize may omit it when one model is served
            if len(known) == 1:
                return next(iter(known))
            raise GatewayError(400, "'model' is required", param="model")
        if model not in known:
            listing = ", ".join(sorted(known)) or "none yet"
            raise GatewayError(
                404,
                f"The model '{model}' does not exist. Known models: {listing}",
                param="model",
                code="model_not_found",
            )
        return model

    # -- dispatch with retries --

    async def _dispatch(
        self, request: Request, parsed: ParsedRequest, model: str, request_id: str, arrived: float
    ) -> Response:
        req, answer = await self._router.prepare(
            parsed, model, request_id, request.headers, self._registry.healthy_for(model)
        )
        tried: set[str] = set()
        backoff = self._s.retry.backoff_s
        last_error: GatewayError | None = None
        for _ in range(max(1, self._s.retry.max_attempts)):
            candidates = [p for p in self._registry.healthy_for(model) if p.name not in tried]
            if not candidates:
                break
            routed = self._router.route(req, candidates, answer)
            pod = next(p for p in candidates if p.name == routed.pod)
            tried.add(pod.name)
            attempt = _Attempt(pod, routed, arrived, model)
            handed_off = False
            try:
                response = await self._attempt(request, parsed, attempt, request_id)
                handed_off = isinstance(response, _GuardedStream)
                return response
            except _Retryable as exc:
                last_error = exc.error
                self._metrics.retries.labels(model, exc.cause).inc()
                await self._registry.request_failed(pod)
                log.warning("pod %s failed before first byte (%s); retrying", pod.name, exc.cause)
                await asyncio.sleep(backoff)
                backoff *= 2
            finally:
                if not handed_off:
                    self._router.finish(routed, None)  # no-op once recorded
        if last_error is not None:
            raise last_error
        raise GatewayError(503, f"no healthy pod serves model '{model}'", code="no_healthy_pod")

    async def _attempt(
        self, request: Request, parsed: ParsedRequest, a: _Attempt, request_id: str
    ) -> Response:
        upstream = await self._open(request, parsed, a.pod, request_id)
        headers = self._response_headers(upstream, a, request_id)
        if upstream.status_code >= 500:
            body = await _read_quietly(upstream)
            raise _Retryable(
                GatewayError(502, f"pod '{a.pod.name}' returned {upstream.status_code}: {body}"),
                f"status_{upstream.status_code}",
            )
        if not (parsed.stream and upstream.status_code == 200):
            return await self._buffered(upstream, a, headers)
        it = upstream.aiter_raw().__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = b""
        except httpx.TimeoutException:
            await upstream.aclose()
            raise GatewayError(504, f"pod '{a.pod.name}' sent no first byte in time") from None
        except httpx.HTTPError as exc:
            await upstream.aclose()
            raise _Retryable(
                GatewayError(502, f"pod '{a.pod.name}' failed: {exc!r}"), "dropped"
            ) from None
        a.ttft_s = time.perf_counter() - a.arrived
        self._router.first_token(a.routed)
        return _GuardedStream(
            self._relay(first, it, upstream, a),
            on_close=lambda: self._abandon(upstream, a),
            status_code=200,
            headers=headers | {"cache-control": "no-cache", "x-accel-buffering": "no"},
        )

    async def _open(
        self, request: Request, parsed: ParsedRequest, pod: Pod, request_id: str
    ) -> httpx.Response:
        headers = {"content-type": "application/json", "x-request-id": request_id}
        auth = (
            f"Bearer {pod.config.api_key}"
            if pod.config.api_key
            else request.headers.get("authorization")
        )
        if auth:
            headers["authorization"] = auth
        upstream_req = self._client.build_request(
            "POST",
            pod.url + request.scope["path"],
            content=parsed.raw,
            headers=headers,
            timeout=self._timeout,
        )
        try:
            return await self._client.send(upstream_req, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise _Retryable(
                GatewayError(502, f"cannot connect to pod '{pod.name}': {exc!r}"), "connect"
            ) from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise _Retryable(
                GatewayError(502, f"pod '{pod.name}' dropped the connection: {exc!r}"), "dropped"
            ) from None
        except httpx.TimeoutException:
            raise GatewayError(504, f"pod '{pod.name}' did not answer in time") from None

    def _response_headers(
        self, upstream: httpx.Response, a: _Attempt, request_id: str
    ) -> dict[str, str]:
        headers = {k: upstream.headers[k] for k in _PASS_RESPONSE_HEADERS if k in upstream.headers}
        headers["x-request-id"] = request_id
        headers["x-kvgate-pod"] = a.pod.name
        headers["x-kvgate-strategy"] = a.strategy
        d = a.routed.decision
        if d.predicted_ttft_s is not None:
            headers["x-kvgate-predicted-ttft-ms"] = f"{d.predicted_ttft_s * 1000:.1f}"
            headers["x-kvgate-predicted-cached-tokens"] = str(d.predicted_cached_tokens)
        return headers

    # -- bodies --

    async def _buffered(
        self, upstream: httpx.Response, a: _Attempt, headers: dict[str, str]
    ) -> Response:
        try:
            async with asyncio.timeout(self._remaining(a)):
                body = await upstream.aread()
        except (TimeoutError, httpx.TimeoutException):
            raise GatewayError(504, f"pod '{a.pod.name}' timed out") from None
        except httpx.HTTPError as exc:
            raise _Retryable(
                GatewayError(502, f"pod '{a.pod.name}' failed: {exc!r}"), "dropped"
            ) from None
        finally:
            await upstream.aclose()
        self._registry.request_succeeded(a.pod)
        self._record(a, upstream.status_code, _usage_from_json(body))
        return Response(body, status_code=upstream.status_code, headers=headers)

    async def _relay(
        self,
        first: bytes,
        it: AsyncIterator[bytes],
        upstream: httpx.Response,
        a: _Attempt,
    ) -> AsyncIterator[bytes]:
        tail = bytearray(first[-_USAGE_TAIL_BYTES:])
        status: int | None = None  # stays None if the client leaves (we get cancelled)
        try:
            yield first
            deadline = asyncio.get_running_loop().time() + self._remaining(a)
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        chunk = await it.__anext__()
                except StopAsyncIteration:
                    break
                tail += chunk
                if len(tail) > 2 * _USAGE_TAIL_BYTES:
                    del tail[:-_USAGE_TAIL_BYTES]
                yield chunk
            status = 200
        except (TimeoutError, httpx.TimeoutException):
            status = 504
            yield sse_error_event(504, f"pod '{a.pod.name}' timed out mid-stream")
        except httpx.HTTPError as exc:
            status = 502
            yield sse_error_event(502, f"pod '{a.pod.name}' failed mid-stream: {exc!r}")
        finally:
            await upstream.aclose()
            if status == 200:
                self._registry.request_succeeded(a.pod)
                self._record(a, status, _usage_from_sse(bytes(tail)))
            elif status is None:
                self._record(a, 499, None)  # the client closed the stream: not the pod's fault
            else:
                await self._registry.request_failed(a.pod)
                self._record(a, status, None)

    async def _abandon(self, upstream: httpx.Response, a: _Attempt) -> None:
        """The client went away (or the stream ended): close upstream, release load."""
        await upstream.aclose()
        self._record(a, 499, None)  # nginx's "client closed request"; no-op once recorded

    # -- accounting --

    def _remaining(self, a: _Attempt) -> float:
        return max(0.001, a.arrived + self._s.timeouts.total_s - time.perf_counter())

    def _record(self, a: _Attempt, status: int, usage: dict[str, object] | None) -> None:
        """Metrics of the finished request; releases its load and lets the strategy learn."""
        if a.recorded:
            return
        a.recorded = True
        m = self._metrics
        m.requests.labels(a.model, a.pod.name, a.strategy, str(status)).inc()
        m.latency.labels(a.model, a.pod.name, a.strategy).observe(time.perf_counter() - a.arrived)
        if a.ttft_s is not None:
            m.ttft.labels(a.model, a.pod.name, a.strategy).observe(a.ttft_s)
        d = a.routed.decision
        if d.predicted_ttft_s is not None:
            for tier, n in (("L0", d.predicted_l0_tokens), ("L1", d.predicted_l1_tokens),
                            ("L2", d.predicted_l2_tokens)):  # fmt: skip
                m.predicted_tokens.labels(a.strategy, tier).inc(n)
        prompt_tokens, cached = _token_counts(usage)
        if prompt_tokens is not None:
            cached_n = cached or 0
            m.prompt_tokens.labels(a.model, a.pod.name, "cached").inc(cached_n)
            m.prompt_tokens.labels(a.model, a.pod.name, "computed").inc(prompt_tokens - cached_n)
            if d.predicted_ttft_s is not None and cached is not None:
                m.cached_tokens_error.labels(a.strategy).observe(
                    abs(d.predicted_cached_tokens - cached)
                )
                if a.ttft_s is not None:
                    m.ttft_error.labels(a.strategy).observe(abs(d.predicted_ttft_s - a.ttft_s))
        outcome = Outcome(
            ok=status < 400, ttft_s=a.ttft_s, prompt_tokens=prompt_tokens, cached_tokens=cached
        )
        self._router.finish(a.routed, outcome)


async def read_limited(request: Request, limit: int) -> bytes:
    """Read the body, refusing (413) as soon as it is known to exceed ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"request body exceeds the {limit}-byte limit", code="too_large")
    chunks = bytearray()
    async for chunk in request.stream():
        chunks += chunk
        if len(chunks) > limit:
            raise GatewayError(
                413, f"request body exceeds the {limit}-byte limit", code="too_large"
            )
    return bytes(chunks)


async def _read_quietly(upstream: httpx.Response) -> str:
    try:
        body = await upstream.aread()
        return body[:500].decode(errors="replace")
    except httpx.HTTPError:
        return "(no body)"
    finally:
        await upstream.aclose()


def _usage_from_json(body: bytes) -> dict[str, object] | None:
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    return usage if isinstance(usage, dict) else None


def _usage_from_sse(tail: bytes) -> dict[str, object] | None:
    """The usage object of the last SSE event carrying one (vLLM puts it last)."""
    for event in reversed(tail.split(b"\n\n")):
        line = event.strip()
        if not line.startswith(b"data:") or b'"usage"' not in line:
            continue
        try:
            doc = json.loads(line[5:])
        except ValueError:
            continue
        usage = doc.get("usage") if isinstance(doc, dict) else None
        if isinstance(usage, dict):
            return usage
    return None


def _token_counts(usage: dict[str, object] | None) -> tuple[int | None, int | None]:
    if not usage:
        return None, None
    prompt = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (
        prompt if isinstance(prompt, int) else None,
        cached if isinstance(cached, int) else None,
    )
