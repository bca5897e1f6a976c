"""The forwarding client: one seam between the proxy and the HTTP library that talks to pods.

Measured on the gateway's hot path (``kvgate bench overhead``, docs/performance.md),
httpx's connection pool costs more CPU per request than everything else the gateway
does: with 32 concurrent requests it scans every pooled connection, and checks each
socket, for each request. aiohttp's connector does not, so requests to pods go through
aiohttp here; httpx stays for health probes, admin and engine ``/tokenize`` calls,
where it is not on the hot path.

The proxy sees only ``Upstream.open`` and ``UpstreamResponse``, and three failures:
``UpstreamConnectError`` (the pod could not be reached: retry elsewhere),
``UpstreamDropped`` (it closed or broke the connection: retry before the first
byte, an SSE error after), and ``asyncio.TimeoutError`` from the deadlines the proxy
wraps around each call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import aiohttp

# Idle pooled connections are closed after this. vLLM's server (uvicorn) closes idle
# keep-alive connections after 5 s; closing ours first keeps a request from being sent
# on a connection the pod is closing at that moment, which would look like a pod fault.
IDLE_CLOSE_S = 4.0


class UpstreamError(Exception):
    """The pod did not complete the exchange."""


class UpstreamConnectError(UpstreamError):
    """The pod could not be reached (refused, unresolvable, connect timeout)."""


class UpstreamDropped(UpstreamError):
    """The pod closed or broke the connection, or sent a malformed response."""


class UpstreamResponse:
    """A pod's answer once its status line and headers arrived; the body is read on demand."""

    __slots__ = ("_resp", "status", "headers")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers: Mapping[str, str] = resp.headers

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            raise UpstreamDropped(repr(exc)) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (not re-framed: SSE events pass through as sent)."""
        content = self._resp.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    return
                yield chunk
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            raise UpstreamDropped(repr(exc)) from None

    def release(self) -> None:
        """The body was read to its end: the connection goes back to the pool."""
        self._resp.release()

    def close(self) -> None:
        """Abandon the exchange: the connection is closed, so the pod sees the request end."""
        self._resp.close()


class Upstream:
    """A pooled HTTP/1.1 client for the pods (keep-alive, bounded connections)."""

    def __init__(self, max_connections: int, connect_timeout_s: float) -> None:
        self._max_connections = max_connections
        self._connect_timeout = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=connect_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self._max_connections, keepalive_timeout=IDLE_CLOSE_S, ttl_dns_cache=60
        )
        # Nothing automatic: no cookies, no decompression (bytes are relayed as sent),
        # no User-Agent or Accept-Encoding the client did not ask for.
        self._session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            timeout=self._connect_timeout,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """POST ``body`` to ``url`` and return once the status line and headers arrived."""
        assert self._session is not None, "Upstream.start() first"
        try:
            resp = await self._session.post(url, data=body, headers=headers)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise UpstreamConnectError(repr(exc)) from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                aiohttp.ClientResponseError, aiohttp.ClientPayloadError) as exc:  # fmt: skip
            raise UpstreamDropped(repr(exc)) from None
        except TimeoutError:
            raise
        except aiohttp.ClientError as exc:
            raise UpstreamDropped(repr(exc)) from None
        return UpstreamResponse(resp)
