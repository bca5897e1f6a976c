"""Forwarding OpenAI requests to the chosen pod: retries, streaming, timeouts, accounting.

Rules (the request lifecycle):
- load is counted at dispatch and released exactly once however the request ends;
- a connect error, a 5xx or a dropped connection before the first body byte is
  retried on another pod (bounded attempts, exponential backoff); after the first
  byte reached the client, a failure becomes one SSE error event and the stream
  closes;
- deadlines run from arrival: the pod's first body byte within ``first_byte_s``,
  the whole answer within ``total_s``; a pod that misses one answers 504 and, like a
  connect error, counts toward its ejection (a pod that hangs is taken out);
- the client's bytes go upstream untouched (unless tenant isolation sets the salt)
  and the pod's bytes come back chunk by chunk; a client that disconnects, before or
  during the answer, cancels the upstream request.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway.accounting import (
    USAGE_TAIL_BYTES,
    Accounting,
    Attempt,
    usage_from_json,
    usage_from_sse,
)
from gateway.auth import key_matches
from gateway.config import Settings
from gateway.errors import GatewayError, sse_error_event
from gateway.http_limits import read_limited, unless_client_leaves
from gateway.metrics import GatewayMetrics
from gateway.openai_body import Kind, ParsedRequest, parse_body
from gateway.pods import Pod, PodRegistry
from gateway.router import Router
from gateway.tenancy import Tenancy

log = logging.getLogger("kvgate.proxy")

_PASS_RESPONSE_HEADERS = ("content-type",)
# A client's x-request-id is echoed and forwarded only if it is short and plain.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
CLIENT_CLOSED = 499  # nginx's "client closed request"


class _PodFailure(Exception):
    """The pod failed this attempt before the client saw a byte of the answer."""

    def __init__(self, error: GatewayError, cause: str, *, retry: bool = True) -> None:
        super().__init__(error.message)
        self.error = error
        self.cause = cause
        self.retry = retry  # a timeout is not retried: the pod may still be working on it


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


def client_request_id(headers: Any) -> str:
    """The client's ``x-request-id`` if it is short and plain, else a fresh one."""
    given = headers.get("x-request-id")
    if given and _REQUEST_ID.fullmatch(given):
        return str(given)
    return uuid.uuid4().hex


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
        self._accounting = Accounting(metrics, router)
        self._tenancy = Tenancy(settings.tenant_isolation)
        t = settings.timeouts
        # Per socket operation; the deadlines from arrival are enforced around them.
        self._timeout = httpx.Timeout(
            connect=t.connect_s, read=t.first_byte_s, write=t.first_byte_s, pool=t.connect_s
        )

    # -- entry point --

    async def handle(self, request: Request, kind: Kind) -> Response:
        """Answer one OpenAI request (the caller has checked the client's credentials)."""
        arrived = time.perf_counter()
        request_id = client_request_id(request.headers)
        headers = {"x-request-id": request_id}
        model = ""
        attempts: list[Attempt] = []  # each records its own outcome, exactly once
        try:
            raw = await read_limited(
                request, self._s.max_body_bytes, self._s.timeouts.client_body_s
            )
            parsed = parse_body(raw, kind)
            self._tenancy.apply(parsed, request.headers)
            model = self._resolve_model(parsed)
            response = await unless_client_leaves(
                request, self._dispatch(request, parsed, model, request_id, arrived, attempts)
            )
            if response is None:  # the client left before an answer started
                if not any(a.recorded for a in attempts):
                    self._count_unrouted(model, CLIENT_CLOSED)
                return Response(status_code=CLIENT_CLOSED)
            return response
        except GatewayError as err:
            if not any(a.recorded for a in attempts):
                self._count_unrouted(model, err.status)
            return err.response(headers)

    def _count_unrouted(self, model: str, status: int) -> None:
        strategy = self._router.strategy_for(model).name if model else ""
        self._metrics.requests.labels(model, "", strategy, str(status)).inc()

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
                f"The model '{model[:200]}' does not exist. Known models: {listing}",
                param="model",
                code="model_not_found",
            )
        return model

    # -- dispatch with retries --

    async def _dispatch(
        self,
        request: Request,
        parsed: ParsedRequest,
        model: str,
        request_id: str,
        arrived: float,
        attempts: list[Attempt],
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
            attempt = Attempt(pod, routed, arrived, model)
            attempts.append(attempt)
            handed_off = False
            try:
                response = await self._attempt(request, parsed, attempt, request_id)
                handed_off = isinstance(response, _GuardedStream)
                return response
            except _PodFailure as exc:
                last_error = exc.error
                await self._registry.request_failed(pod)
                if not exc.retry:
                    self._accounting.record(attempt, exc.error.status, None)
                    raise exc.error from None
                self._metrics.retries.labels(model, exc.cause).inc()
                log.warning("pod %s failed before first byte (%s); retrying", pod.name, exc.cause)
                await asyncio.sleep(backoff)
                backoff *= 2
            except asyncio.CancelledError:  # the client left: not the pod's fault
                self._accounting.record(attempt, CLIENT_CLOSED, None)
                raise
            finally:
                if not handed_off:
                    self._router.finish(routed, None)  # no-op once recorded
        if last_error is not None:
            raise last_error
        raise GatewayError(503, f"no healthy pod serves model '{model}'", code="no_healthy_pod")

    async def _attempt(
        self, request: Request, parsed: ParsedRequest, a: Attempt, request_id: str
    ) -> Response:
        first_byte_by = self._deadline(a, self._s.timeouts.first_byte_s)
        upstream = await self._open(request, parsed, a, request_id, first_byte_by)
        headers = self._response_headers(request, upstream, a, request_id)
        if upstream.status_code >= 500:
            body = await _read_quietly(upstream)
            raise _PodFailure(
                GatewayError(502, f"pod '{a.pod.name}' returned {upstream.status_code}: {body}"),
                f"status_{upstream.status_code}",
            )
        if not (parsed.stream and upstream.status_code == 200):
            return await self._buffered(upstream, a, headers)
        it = upstream.aiter_raw().__aiter__()
        try:
            async with asyncio.timeout_at(first_byte_by):
                first = await it.__anext__()
        except StopAsyncIteration:
            first = b""
        except (TimeoutError, httpx.TimeoutException):
            await upstream.aclose()
            raise self._timed_out(a, "sent no first byte in time") from None
        except httpx.HTTPError as exc:
            await upstream.aclose()
            raise _PodFailure(
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
        self, request: Request, parsed: ParsedRequest, a: Attempt, request_id: str, by: float
    ) -> httpx.Response:
        pod = a.pod
        headers = {"content-type": "application/json", "x-request-id": request_id}
        auth = self._upstream_auth(request, pod)
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
            async with asyncio.timeout_at(by):
                return await self._client.send(upstream_req, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise _PodFailure(
                GatewayError(502, f"cannot connect to pod '{pod.name}': {exc!r}"), "connect"
            ) from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise _PodFailure(
                GatewayError(502, f"pod '{pod.name}' dropped the connection: {exc!r}"), "dropped"
            ) from None
        except (TimeoutError, httpx.TimeoutException):
            raise self._timed_out(a, "did not answer in time") from None

    def _upstream_auth(self, request: Request, pod: Pod) -> str | None:
        """The pod's own key; the client's header only when it is not a gateway key."""
        if pod.config.api_key:
            return f"Bearer {pod.config.api_key}"
        if self._s.api_keys:
            return None  # the client's credential is the gateway's, never forwarded
        return request.headers.get("authorization")

    def _response_headers(
        self, request: Request, upstream: httpx.Response, a: Attempt, request_id: str
    ) -> dict[str, str]:
        headers = {k: upstream.headers[k] for k in _PASS_RESPONSE_HEADERS if k in upstream.headers}
        headers["x-request-id"] = request_id
        headers["x-kvgate-pod"] = a.pod.name
        headers["x-kvgate-strategy"] = a.strategy
        d = a.routed.decision
        if d.predicted_ttft_s is not None and self._may_see_predictions(request):
            headers["x-kvgate-predicted-ttft-ms"] = f"{d.predicted_ttft_s * 1000:.1f}"
            headers["x-kvgate-predicted-cached-tokens"] = str(d.predicted_cached_tokens)
        return headers

    def _may_see_predictions(self, request: Request) -> bool:
        """Predictions say what is cached: every client when enabled, else admin callers."""
        if self._s.expose_predictions:
            return True
        admin_keys = self._s.admin.api_keys
        return bool(admin_keys) and key_matches(request.headers.get("x-kvgate-admin-key"),
                                                admin_keys)  # fmt: skip

    # -- bodies --

    async def _buffered(
        self, upstream: httpx.Response, a: Attempt, headers: dict[str, str]
    ) -> Response:
        try:
            async with asyncio.timeout_at(self._deadline(a, self._s.timeouts.total_s)):
                body = await upstream.aread()
        except (TimeoutError, httpx.TimeoutException):
            raise self._timed_out(a, "timed out") from None
        except httpx.HTTPError as exc:
            raise _PodFailure(
                GatewayError(502, f"pod '{a.pod.name}' failed: {exc!r}"), "dropped"
            ) from None
        finally:
            await upstream.aclose()
        self._registry.request_succeeded(a.pod)
        self._accounting.record(a, upstream.status_code, usage_from_json(body))
        return Response(body, status_code=upstream.status_code, headers=headers)

    async def _relay(
        self,
        first: bytes,
        it: AsyncIterator[bytes],
        upstream: httpx.Response,
        a: Attempt,
    ) -> AsyncIterator[bytes]:
        tail = bytearray(first[-USAGE_TAIL_BYTES:])
        status: int | None = None  # stays None if the client leaves (we get cancelled)
        try:
            yield first
            deadline = self._deadline(a, self._s.timeouts.total_s)
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        chunk = await it.__anext__()
                except StopAsyncIteration:
                    break
                tail += chunk
                if len(tail) > 2 * USAGE_TAIL_BYTES:
                    del tail[:-USAGE_TAIL_BYTES]
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
                self._accounting.record(a, status, usage_from_sse(bytes(tail)))
            elif status is None:  # the client closed the stream: not the pod's fault
                self._accounting.record(a, CLIENT_CLOSED, None)
            else:
                await self._registry.request_failed(a.pod)
                self._accounting.record(a, status, None)

    async def _abandon(self, upstream: httpx.Response, a: Attempt) -> None:
        """The client went away (or the stream ended): close upstream, release load."""
        await upstream.aclose()
        self._accounting.record(a, CLIENT_CLOSED, None)  # no-op once recorded

    # -- deadlines --

    def _deadline(self, a: Attempt, seconds: float) -> float:
        """The event loop's time at which ``seconds`` after ``a``'s arrival will have passed."""
        left = max(0.001, a.arrived + seconds - time.perf_counter())
        return asyncio.get_running_loop().time() + left

    @staticmethod
    def _timed_out(a: Attempt, what: str) -> _PodFailure:
        return _PodFailure(GatewayError(504, f"pod '{a.pod.name}' {what}"), "timeout", retry=False)


async def _read_quietly(upstream: httpx.Response) -> str:
    try:
        body = await upstream.aread()
        return body[:500].decode(errors="replace")
    except httpx.HTTPError:
        return "(no body)"
    finally:
        await upstream.aclose()
