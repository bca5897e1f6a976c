"""Forwarding API requests to the chosen pod: retries, streaming, deadlines, accounting.

Rules (the request lifecycle):
- load is counted at dispatch and released exactly once however the request ends;
- a connect error, a 5xx or a dropped connection before the first body byte is
  retried on another pod (bounded attempts, exponential backoff); after the first
  byte reached the client, a failure becomes one SSE error event and the stream
  closes (with ``stream_headers_early``, a stream's headers reach the client as soon
  as the pod's do, and from then on a failure is an SSE error event, not a retry);
- deadlines run from arrival: a stream's first body byte within ``first_byte_s``,
  the whole answer within ``total_s``; a pod that misses one answers 504 and, like a
  connect error, counts toward its ejection (a pod that hangs is taken out). A pod
  ejected for failing its probes gives up at once the requests it holds of which the
  client has seen nothing: they are retried elsewhere (``gateway.awaiting``); a
  stream whose client has its status line ends with an SSE error event once that pod
  has sent it nothing for a probe interval, instead of ``stream_idle_s``. A
  non-streamed answer has only ``total_s``: vLLM sends it whole once generated, so
  its first byte is its last, and ``first_byte_s`` would cut every generation longer
  than it (and eject healthy pods for it);
- the client's bytes go upstream untouched (unless tenant isolation sets the salt)
  and the pod's bytes come back chunk by chunk; a client that disconnects, before or
  during the answer, cancels the upstream request.

This is the hot path, so it speaks raw ASGI (``gateway.asgi``) and forwards through
``gateway.upstream`` (its own HTTP/1.1 client over httptools), not through Starlette
objects and httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator

from gateway.accounting import (
    USAGE_TAIL_BYTES,
    Accounting,
    Attempt,
    usage_from_json,
    usage_from_sse,
)
from gateway.admission import Admission
from gateway.apis import error_style
from gateway.asgi import (
    ClientLeft,
    DisconnectWatch,
    Receive,
    Scope,
    Send,
    encode_headers,
    read_body,
    send_error,
    send_response,
)
from gateway.auth import key_matches
from gateway.awaiting import AwaitingPods
from gateway.config import Settings
from gateway.errors import ErrorStyle, GatewayError, sse_error_event
from gateway.in_flight import InFlightBounds, RequestHold, limits_of
from gateway.metrics import GatewayMetrics
from gateway.openai_body import JSON, Kind, ParsedRequest, parse_body
from gateway.pods import Pod, PodRegistry
from gateway.router import Router
from gateway.tenancy import Tenancy
from gateway.tracing import Tracing, forward_client_context, span
from gateway.upstream import Upstream, UpstreamConnectError, UpstreamDropped, UpstreamResponse

log = logging.getLogger("kvgate.proxy")

# A client's x-request-id is echoed and forwarded only if it is short and plain.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
CLIENT_CLOSED = 499  # nginx's "client closed request"
_NOT_WAITING = contextlib.nullcontext()  # no table of waiting attempts (the setting off)
_NO_SPAN = contextlib.nullcontext()
_STREAM_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
ERROR_EXCERPT_BYTES = 500  # of a pod's 5xx body, quoted in the 502
# ... and how long it may take to come: the pod has answered already, and the next pod
# is tried within the same first-byte deadline (it runs from arrival).
ERROR_EXCERPT_WAIT_S = 0.25


class _QuietPod:
    """Ends a stream whose pod sends nothing for ``idle_s``, through the stream's own
    timeout ``deadline``. A chunk costs storing the time it was relayed; the timer
    re-arms itself at most once per ``idle_s``, instead of a new timer for every chunk.
    Time spent sending to the client (a slow reader) is not the pod's silence.

    ``idle_s`` None: no limit until the pod is lost (``pod_lost``: it failed its
    probes, ``gateway.awaiting``); from then on the limit is ``lost_grace_s``, a
    probe interval, and a stream quiet for that long already ends at once."""

    __slots__ = ("_deadline", "_handle", "_idle_s", "_loop", "fired", "last", "lost",
                 "lost_grace_s", "sending")  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        deadline: asyncio.Timeout,
        idle_s: float | None,
        lost_grace_s: float,
    ) -> None:
        self._loop = loop
        self._deadline = deadline
        self._idle_s = idle_s
        self.lost_grace_s = lost_grace_s
        self.last = loop.time()  # the last chunk's relay, or the watch's start
        self.sending = False
        self.fired = False
        self.lost = False
        self._handle: asyncio.Handle | None = None
        if idle_s is not None:
            self._handle = loop.call_at(self.last + idle_s, self._check)

    def pod_lost(self) -> None:
        self.lost = True
        if self._idle_s is None or self._idle_s > self.lost_grace_s:
            self._idle_s = self.lost_grace_s
        self.stop()
        self._check()

    def _check(self) -> None:
        assert self._idle_s is not None  # armed only with a limit
        now = self._loop.time()
        if self.sending:  # a slow client's time is not the pod's silence: look again later
            self._handle = self._loop.call_at(now + self._idle_s, self._check)
        elif now - self.last >= self._idle_s:
            self.fired = True
            self._handle = None
            self._deadline.reschedule(now)  # the relay gets TimeoutError
        else:  # due when the pod will have been quiet for idle_s since its last chunk
            self._handle = self._loop.call_at(self.last + self._idle_s, self._check)

    def what(self, waited_for: str) -> str:
        """Why it fired, for the SSE error event."""
        if self.lost:
            return f"stopped answering its probes and sent {waited_for} for {self._idle_s:g} s"
        return f"sent {waited_for} for {self._idle_s:g} s"

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class _PodFailure(Exception):
    """The pod failed this attempt before the client saw a byte of the answer."""

    def __init__(
        self, error: GatewayError, cause: str, *, retry: bool = True, pod_fault: bool = True
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.cause = cause
        self.retry = retry  # a timeout is not retried: the pod may still be working on it
        self.pod_fault = pod_fault  # counts toward the pod's ejection


def client_request_id(headers: dict[str, str]) -> str:
    """The client's ``x-request-id`` if it is short and plain, else a fresh one."""
    given = headers.get("x-request-id")
    if given and _REQUEST_ID.fullmatch(given):
        return given
    return os.urandom(16).hex()  # 128 random bits as 32 hex digits, like uuid4().hex, 6x cheaper


class Proxy:
    def __init__(
        self,
        settings: Settings,
        upstream: Upstream,
        registry: PodRegistry,
        router: Router,
        metrics: GatewayMetrics,
        in_flight: InFlightBounds,
        admission: Admission | None = None,
        tracing: Tracing | None = None,
        awaiting: AwaitingPods | None = None,
    ) -> None:
        self._s = settings
        # The bounds on requests in flight: limits from these settings, counts shared
        # with the proxies of earlier and later settings (``gateway.in_flight``).
        self._limits = limits_of(settings)
        self._in_flight = in_flight
        self._upstream = upstream
        self._registry = registry
        self._router = router
        self._metrics = metrics
        self._admission = admission  # None: admission control is off, and costs nothing
        self._tracing = tracing  # None: tracing is off (the client's context still goes up)
        # Attempts a lost pod gives up (shared across reloads, like the bounds); None: off.
        self._awaiting = awaiting if settings.health.retry_in_flight_on_eject else None
        # ``handle`` is chosen once: with tracing off no request pays for its wrapper.
        self.handle = self._handle if tracing is None else self._traced_handle
        self._accounting = Accounting(metrics, router)
        self._tenancy = Tenancy(settings.tenant_isolation)

    # -- entry point: ``handle`` --

    async def _traced_handle(
        self, scope: Scope, receive: Receive, send: Send, kind: Kind, headers: dict[str, str]
    ) -> None:
        assert self._tracing is not None
        with self._tracing.request(headers, scope["path"], send) as recording:
            await self._handle(scope, receive, recording, kind, headers)

    async def _handle(
        self, scope: Scope, receive: Receive, send: Send, kind: Kind, headers: dict[str, str]
    ) -> None:
        """Answer one API request (the caller has checked the client's credentials)."""
        arrived = time.perf_counter()
        request_id = client_request_id(headers)
        model = ""
        attempts: list[Attempt] = []  # each records its own outcome, exactly once
        watch: DisconnectWatch | None = None
        hold: RequestHold | None = None
        try:
            hold = self._in_flight.enter(self._limits)
            with span("kvgate.parse"):
                raw = await read_body(
                    receive, headers, self._s.max_body_bytes, self._s.timeouts.client_body_s,
                    hold,
                )  # fmt: skip
                parsed = parse_body(raw, kind, headers.get("content-type", JSON))
                self._tenancy.apply(parsed, headers)
                model = await self._resolve_model(parsed)
            watch = DisconnectWatch(receive)
            await self._dispatch(scope, send, parsed, model, headers, request_id, arrived,
                                 attempts, watch)  # fmt: skip
        except GatewayError as err:
            if watch is not None:
                watch.stop()
            if not any(a.recorded for a in attempts):
                self._count_unrouted(model, err.status)
            await send_error(send, err, {"x-request-id": request_id, **err.headers},
                             error_style(kind))  # fmt: skip
        except ClientLeft:
            self._count_unrouted(model, CLIENT_CLOSED)
        except asyncio.CancelledError:
            if watch is None or not watch.gone:
                raise  # not the client's leaving: the server is shutting down
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            if not any(a.recorded for a in attempts):
                self._count_unrouted(model, CLIENT_CLOSED)
        finally:
            if watch is not None:
                watch.stop()
            if hold is not None:
                hold.close()

    def _count_unrouted(self, model: str, status: int) -> None:
        strategy = self._router.strategy_for(model).name if model else ""
        self._metrics.requests.labels(model, "", strategy, str(status)).inc()

    async def _resolve_model(self, parsed: ParsedRequest) -> str:
        known = self._registry.known_models()
        model = parsed.model
        if model is not None and model not in known:
            # Perhaps a LoRA adapter loaded since the last probe: ask the pods again
            # (at most once per lora.refresh_min_interval_s, however many ask).
            await self._registry.refresh_models()
            known = self._registry.known_models()
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
        scope: Scope,
        send: Send,
        parsed: ParsedRequest,
        model: str,
        headers: dict[str, str],
        request_id: str,
        arrived: float,
        attempts: list[Attempt],
        watch: DisconnectWatch,
    ) -> None:
        req, answer = await self._router.prepare(
            parsed, model, request_id, headers, self._registry.healthy_for(model)
        )
        admitted = None  # the first attempt's routing, when admission control made it
        if self._admission is not None:
            ticket = self._admission.ticket(headers, time.monotonic())
            with span("kvgate.queue_wait"):
                admitted = await self._admission.admit(
                    model,
                    ticket,
                    req,
                    answer,
                    lambda: self._registry.healthy_for(model),
                    self._may_see_predictions(headers),
                )
        tried: set[str] = set()
        backoff = self._s.retry.backoff_s
        last_error: GatewayError | None = None
        for _ in range(max(1, self._s.retry.max_attempts)):
            candidates = [p for p in self._registry.healthy_for(model) if p.name not in tried]
            if admitted is not None and all(p.name != admitted.pod for p in candidates):
                self._router.finish(admitted, None)  # its pod left rotation while it waited
                admitted = None
            if not candidates:
                break
            if admitted is not None:
                routed, admitted = admitted, None
            else:
                with span("kvgate.choose"):
                    routed = self._router.route(req, candidates, answer, retry=bool(tried))
            pod = next(p for p in candidates if p.name == routed.pod)
            tried.add(pod.name)
            attempt = Attempt(pod, routed, arrived, model)
            attempts.append(attempt)
            try:
                with self._upstream_span(attempt), self._waiting_on_pod(attempt):
                    await self._attempt(scope, send, parsed, attempt, headers, request_id, watch)
                return
            except _PodFailure as exc:
                last_error = exc.error
                if exc.pod_fault:
                    await self._registry.request_failed(pod)
                if not exc.retry:
                    self._accounting.record(attempt, exc.error.status, None)
                    raise exc.error from None
                self._metrics.retries.labels(model, exc.cause).inc()
                if not exc.pod_fault:
                    continue  # the pod is fine; another one serves the model
                log.warning("pod %s failed before first byte (%s); retrying", pod.name, exc.cause)
                await asyncio.sleep(backoff)
                backoff *= 2
            except asyncio.CancelledError:
                task = asyncio.current_task()
                assert task is not None  # a request is always served from a task
                # Its pod was ejected for failing its probes (``gateway.awaiting``) and
                # nothing else stopped it (the client leaving, or the server shutting
                # down in the same moment: then cancelling() counts both): the client
                # has seen nothing, so another pod serves it.
                if not attempt.lost or watch.gone or task.cancelling() > 1:
                    self._accounting.record(attempt, CLIENT_CLOSED, None)
                    raise
                task.uncancel()
                last_error = GatewayError(502, f"pod '{pod.name}' stopped answering its probes")
                self._accounting.record(attempt, 502, None)
                self._metrics.retries.labels(model, "pod_lost").inc()
            finally:
                self._router.finish(routed, None)  # no-op once recorded
        if last_error is not None:
            raise last_error
        raise GatewayError(503, f"no healthy pod serves model '{model}'", code="no_healthy_pod")

    async def _attempt(
        self,
        scope: Scope,
        send: Send,
        parsed: ParsedRequest,
        a: Attempt,
        headers: dict[str, str],
        request_id: str,
        watch: DisconnectWatch,
    ) -> None:
        loop = asyncio.get_running_loop()
        timeouts = self._s.timeouts
        # A non-streamed answer's head comes with its last byte (module docstring).
        first_byte_s = timeouts.first_byte_s if parsed.stream else timeouts.total_s
        first_byte_by = self._deadline(loop, a, first_byte_s)
        upstream = await self._open(scope, parsed, a, headers, request_id, first_byte_by)
        if upstream.status == 404:  # e.g. an adapter unloaded since the last probe
            self._registry.models_stale(a.pod)
        try:
            if upstream.status >= 500:
                body = await _error_excerpt(upstream, first_byte_by)
                raise _PodFailure(
                    GatewayError(502, f"pod '{a.pod.name}' returned {upstream.status}: {body}"),
                    f"status_{upstream.status}",
                )
            out = self._response_headers(headers, upstream, a, request_id)
            if parsed.stream and upstream.status == 200:
                style = error_style(parsed.kind)
                await self._stream(send, upstream, a, out, first_byte_by, watch, style)
            else:
                await self._buffered(send, upstream, a, out, watch)
        finally:
            upstream.close()  # no-op after release(); otherwise the pod sees us leave

    async def _open(
        self,
        scope: Scope,
        parsed: ParsedRequest,
        a: Attempt,
        headers: dict[str, str],
        request_id: str,
        by: float,
    ) -> UpstreamResponse:
        pod = a.pod
        up_headers = {"content-type": parsed.content_type, "x-request-id": request_id}
        auth = self._upstream_auth(headers, pod)
        if auth:
            up_headers["authorization"] = auth
        if self._tracing is None:
            forward_client_context(headers, up_headers)
        else:
            self._tracing.inject(up_headers)  # the pod's spans join the attempt's
        try:
            async with asyncio.timeout_at(by):
                with span("kvgate.upstream_connect"):
                    return await self._upstream.open(pod.url + scope["path"], parsed.raw,
                                                     up_headers)  # fmt: skip
        except UpstreamConnectError as exc:
            raise _PodFailure(
                GatewayError(502, f"cannot connect to pod '{pod.name}': {exc}"), "connect"
            ) from None
        except UpstreamDropped as exc:
            raise _PodFailure(
                GatewayError(502, f"pod '{pod.name}' dropped the connection: {exc}"), "dropped"
            ) from None
        except TimeoutError:
            raise self._timed_out(a, "did not answer in time") from None

    def _upstream_auth(self, headers: dict[str, str], pod: Pod) -> str | None:
        """The pod's own key; the client's header only when it is not a gateway key."""
        if pod.config.api_key:
            return f"Bearer {pod.config.api_key}"
        if self._s.api_keys:
            return None  # the client's credential is the gateway's, never forwarded
        return headers.get("authorization")

    def _response_headers(
        self, headers: dict[str, str], upstream: UpstreamResponse, a: Attempt, request_id: str
    ) -> list[tuple[bytes, bytes]]:
        out = [("x-request-id", request_id), ("x-kvgate-pod", a.pod.name),
               ("x-kvgate-strategy", a.strategy)]  # fmt: skip
        content_type = upstream.headers.get("content-type")
        if content_type:
            out.append(("content-type", content_type))
        d = a.routed.decision
        if d.predicted_ttft_s is not None and self._may_see_predictions(headers):
            out.append(("x-kvgate-predicted-ttft-ms", f"{d.predicted_ttft_s * 1000:.1f}"))
            out.append(("x-kvgate-predicted-cached-tokens", str(d.predicted_cached_tokens)))
        return encode_headers(out)

    def _may_see_predictions(self, headers: dict[str, str]) -> bool:
        """Predictions say what is cached: every client when enabled, else admin callers."""
        if self._s.expose_predictions:
            return True
        admin_keys = self._s.admin.api_keys
        return bool(admin_keys) and key_matches(headers.get("x-kvgate-admin-key"), admin_keys)

    # -- bodies --

    async def _buffered(
        self,
        send: Send,
        upstream: UpstreamResponse,
        a: Attempt,
        out: list[tuple[bytes, bytes]],
        watch: DisconnectWatch,
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(self._deadline(loop, a, self._s.timeouts.total_s)):
                with span("kvgate.first_byte"):  # and the whole body: the pod sends it at once
                    body = await upstream.read()
        except TimeoutError:
            raise self._timed_out(a, "timed out") from None
        except UpstreamDropped as exc:
            raise _PodFailure(
                GatewayError(502, f"pod '{a.pod.name}' failed: {exc}"), "dropped"
            ) from None
        if upstream.status == 404 and _model_unknown(body) and self._served_elsewhere(a):
            # An adapter unloaded here between two probes while another pod still serves
            # it: that pod answers, not this pod's 404 (which says it does not exist).
            gone = f"pod '{a.pod.name}' no longer serves model '{a.model}'"
            error = GatewayError(404, gone, code="model_not_found")
            raise _PodFailure(error, "model_gone", pod_fault=False)
        self._answering(a)
        upstream.release()
        self._registry.request_succeeded(a.pod)
        self._accounting.record(a, upstream.status, usage_from_json(body))
        watch.stop()
        await send_response(send, upstream.status, out, body)
        self._router.response_started()

    async def _stream(
        self,
        send: Send,
        upstream: UpstreamResponse,
        a: Attempt,
        out: list[tuple[bytes, bytes]],
        first_byte_by: float,
        watch: DisconnectWatch,
        style: ErrorStyle = "openai",
    ) -> None:
        loop = asyncio.get_running_loop()
        chunks = upstream.chunks().__aiter__()
        start = {"type": "http.response.start", "status": 200, "headers": out + _STREAM_HEADERS}
        started = self._s.stream_headers_early
        failure: tuple[int, str] | None = None  # (status, what the pod did)
        if started:
            self._answering(a)
            await send(start)
        quiet: _QuietPod | None = None  # with the status line out: told if the pod is lost
        try:
            async with asyncio.timeout_at(first_byte_by) as first_wait:
                if started and self._awaiting is not None:
                    quiet = _QuietPod(loop, first_wait, None, self._s.health.interval_s)
                with span("kvgate.first_byte"), self._relaying(a, quiet):
                    first = await anext(chunks, b"")
        except TimeoutError:
            if not started:
                raise self._timed_out(a, "sent no first byte in time") from None
            if quiet is not None and quiet.fired:
                failure = (502, quiet.what("no first byte"))
            else:
                failure = (504, "sent no first byte in time")
        except UpstreamDropped as exc:
            if not started:
                raise _PodFailure(
                    GatewayError(502, f"pod '{a.pod.name}' failed: {exc}"), "dropped"
                ) from None
            failure = (502, f"failed: {exc}")
        finally:
            if quiet is not None:
                quiet.stop()
        if failure is not None:  # the client has the status line: no retry now
            await self._end_stream(send, a, *failure, watch, style)
            return
        self._answering(a)
        a.ttft_s = time.perf_counter() - a.arrived
        self._router.first_token(a.routed)
        if not started:
            await send(start)
        await send({"type": "http.response.body", "body": first, "more_body": True})
        self._router.response_started()
        self._router.learn_at_first_token(a.routed, a.ttft_s)
        await self._relay(send, chunks, upstream, a, first, loop, watch, style)

    async def _end_stream(
        self,
        send: Send,
        a: Attempt,
        status: int,
        what: str,
        watch: DisconnectWatch,
        style: ErrorStyle,
    ) -> None:
        """A stream whose status line has gone out and whose pod then failed (before its
        first byte with ``stream_headers_early``, or mid-stream): counted against the pod,
        recorded, and closed with one SSE error event."""
        await self._registry.request_failed(a.pod)
        self._accounting.record(a, status, None)
        watch.stop()
        last = sse_error_event(status, f"pod '{a.pod.name}' {what}", style)
        await send({"type": "http.response.body", "body": last, "more_body": False})

    async def _relay(
        self,
        send: Send,
        chunks: AsyncIterator[bytes],
        upstream: UpstreamResponse,
        a: Attempt,
        first: bytes,
        loop: asyncio.AbstractEventLoop,
        watch: DisconnectWatch,
        style: ErrorStyle = "openai",
    ) -> None:
        """The rest of a stream, after its first chunk reached the client. A failure now is
        one SSE error event; the client leaving (cancellation) is recorded as 499."""
        tail = bytearray(first[-USAGE_TAIL_BYTES:])
        failure: tuple[int, str] | None = None  # (status, what the pod did)
        idle_s = self._s.timeouts.stream_idle_s
        quiet: _QuietPod | None = None
        try:
            async with asyncio.timeout_at(
                self._deadline(loop, a, self._s.timeouts.total_s)
            ) as deadline:
                if idle_s is not None or self._awaiting is not None:
                    quiet = _QuietPod(loop, deadline, idle_s, self._s.health.interval_s)
                with span("kvgate.stream"), self._relaying(a, quiet):
                    async for chunk in chunks:
                        tail += chunk
                        if len(tail) > 2 * USAGE_TAIL_BYTES:
                            del tail[:-USAGE_TAIL_BYTES]
                        if quiet is not None:
                            quiet.sending = True
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})  # fmt: skip
                        if quiet is not None:
                            quiet.sending = False
                            quiet.last = loop.time()
        except TimeoutError:
            if quiet is not None and quiet.fired:
                status = 502 if quiet.lost else 504
                failure = (status, quiet.what("nothing") + " mid-stream")
            else:
                failure = (504, "timed out mid-stream")
        except UpstreamDropped as exc:
            failure = (502, f"failed mid-stream: {exc}")
        finally:
            if quiet is not None:
                quiet.stop()
        if failure is not None:
            await self._end_stream(send, a, *failure, watch, style)
            return
        upstream.release()
        self._registry.request_succeeded(a.pod)
        self._accounting.record(a, 200, usage_from_sse(bytes(tail)))
        watch.stop()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _upstream_span(self, a: Attempt) -> contextlib.AbstractContextManager[object]:
        """The attempt's client span (the pod's context); a no-op with tracing off. The
        decision is noted on the request's span (the current one, as this is called)."""
        if self._tracing is None:
            return _NO_SPAN
        d = a.routed.decision
        self._tracing.annotate(**{"kvgate.model": a.model, "kvgate.strategy": d.strategy,
                                  "kvgate.reason": d.reason,
                                  "kvgate.predicted_ttft_s": d.predicted_ttft_s})  # fmt: skip
        return self._tracing.upstream(a.pod.name, a.pod.url)

    def _waiting_on_pod(self, a: Attempt) -> contextlib.AbstractContextManager[None]:
        """Where a lost pod finds ``a`` to give it up (``gateway.awaiting``), for as
        long as ``a``'s call to the pod lasts: not in the retry handling after it."""
        if self._awaiting is None:
            return _NOT_WAITING
        return self._awaiting.holding(a)

    def _relaying(
        self, a: Attempt, quiet: _QuietPod | None
    ) -> contextlib.AbstractContextManager[None]:
        """Where a lost pod finds the stream ``a`` it feeds (its client has the status
        line) to tell its ``quiet`` watch (``gateway.awaiting``)."""
        if self._awaiting is None or quiet is None:
            return _NOT_WAITING
        return self._awaiting.relaying(a, quiet)

    def _answering(self, a: Attempt) -> None:
        """``a``'s client is about to see its first byte: from now on its answer cannot
        change pods, so a lost pod no longer gives it up."""
        if self._awaiting is not None:
            self._awaiting.leave(a)

    # -- deadlines --

    @staticmethod
    def _deadline(loop: asyncio.AbstractEventLoop, a: Attempt, seconds: float) -> float:
        """The event loop's time at which ``seconds`` after ``a``'s arrival will have passed."""
        return loop.time() + max(0.001, a.arrived + seconds - time.perf_counter())

    def _served_elsewhere(self, a: Attempt) -> bool:
        return any(p.name != a.pod.name for p in self._registry.healthy_for(a.model))

    @staticmethod
    def _timed_out(a: Attempt, what: str) -> _PodFailure:
        return _PodFailure(GatewayError(504, f"pod '{a.pod.name}' {what}"), "timeout", retry=False)


def _model_unknown(body: bytes) -> bool:
    """Whether a pod's 404 says it serves no such model (vLLM: ``param`` "model")."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("param") == "model"


async def _error_excerpt(upstream: UpstreamResponse, by: float) -> str:
    """The start of a 5xx answer's body, to quote in the 502: up to ``ERROR_EXCERPT_BYTES``
    of what arrives within ``ERROR_EXCERPT_WAIT_S`` and by ``by`` (the first-byte deadline).
    Its end is not waited for: a pod whose error body stalls or never ends must not hold
    the request, which goes to the next pod. A body not read to its end closes its
    connection (the caller's ``close``)."""
    excerpt = b""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(UpstreamDropped, TimeoutError):
        async with asyncio.timeout_at(min(by, loop.time() + ERROR_EXCERPT_WAIT_S)):
            async for chunk in upstream.chunks():
                excerpt += chunk
                if len(excerpt) >= ERROR_EXCERPT_BYTES:
                    break
            else:
                upstream.release()  # read to its end: the connection can be reused
    if not excerpt:
        return "(no body)"
    return excerpt[:ERROR_EXCERPT_BYTES].decode(errors="replace")
