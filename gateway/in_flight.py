"""What the requests being served may hold together: their number and their bodies' bytes.

Every API request's body is read whole before it is routed (it is parsed to route, and
kept until the answer ends so that a failed attempt can go to another pod), so N
requests in flight hold N bodies of up to ``max_body_bytes`` each: with the default
8 MiB, a thousand clients sending at once would make the process hold 8 GiB, and
nothing else bounds how many send at once. Two bounds per process (per worker with
``--workers``) close that:

- ``max_requests_in_flight``: a request that arrives with that many already being
  served is answered 503 before its body is read;
- ``max_body_bytes_in_flight``: a body is charged as it is read (its whole declared
  ``Content-Length`` at once, a chunked body chunk by chunk) and released when its
  request ends; a body that would pass the bound is answered 503 as soon as it
  would (a declared one before any of it is read).

The 503 carries ``Retry-After``: the gateway is full, not the client wrong, and a
load balancer or the OpenAI clients (which retry 503) try again or elsewhere. A request
already admitted is never affected. The default count matches
``max_upstream_connections`` (a request beyond it would only wait for a connection
while holding its body), and the default bytes are 32 bodies of the largest size or
tens of thousands of typical ones.

The limits come with the proxy's settings (a reload builds a new proxy, and new
requests meet the new limits); the counts live here, one object for the process, so
that requests admitted before a reload stay counted after it. A refused request is
counted by ``kvgate_requests_refused_total{bound}`` and, like every request answered
before a pod was chosen, as ``kvgate_requests_total{status="503"}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.config import Settings
from gateway.errors import GatewayError
from kvindex.types import Bound

# What one request in flight holds besides its body's bytes: its client connection,
# ASGI task, parsed request and upstream connection. Measured: a gateway's RSS with
# 1,000 and 2,000 small requests held by a hung pod grew 18 and 20 KB a request.
REQUEST_BYTES = 20_000
RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class InFlightLimits:
    max_requests: int
    max_body_bytes: int


def limits_of(settings: Settings) -> InFlightLimits:
    return InFlightLimits(settings.max_requests_in_flight, settings.max_body_bytes_in_flight)


class RequestHold:
    """One admitted request's share of the bounds, until ``close``."""

    __slots__ = ("_counts", "_limit", "charged", "_open")

    def __init__(self, counts: InFlightBounds, limit: int) -> None:
        self._counts = counts
        self._limit = limit
        self.charged = 0
        self._open = True

    def charge(self, n: int) -> None:
        """Hold ``n`` more body bytes; 503 (nothing charged) if that passes the bound."""
        counts = self._counts
        if counts.body_bytes + n > self._limit:
            counts.on_refused("body_bytes")
            raise at_capacity(f"request bodies in flight would pass {self._limit} bytes")
        counts.body_bytes += n
        self.charged += n

    def close(self) -> None:
        """Release what this request held (once; later calls do nothing)."""
        if self._open:
            self._open = False
            self._counts.requests -= 1
            self._counts.body_bytes -= self.charged
            self.charged = 0


class InFlightBounds:
    """The process's requests in flight and the body bytes they hold."""

    def __init__(self, on_refused: Callable[[str], None]) -> None:
        """``on_refused``: called with the bound a request was refused at, "requests" or
        "body_bytes" (``kvgate_requests_refused_total``)."""
        self.requests = 0
        self.body_bytes = 0
        self.on_refused = on_refused

    def enter(self, limits: InFlightLimits) -> RequestHold:
        """Admit one request, or 503 if ``limits.max_requests`` are being served."""
        if self.requests >= limits.max_requests:
            self.on_refused("requests")
            raise at_capacity(f"{limits.max_requests} requests are being served")
        self.requests += 1
        return RequestHold(self, limits.max_body_bytes)

    def bounds(self, limits: InFlightLimits) -> dict[str, Bound]:
        """``/admin/bounds``: requests and body bytes held now, against ``limits``."""
        return {
            "requests.in_flight": Bound(
                self.requests, limits.max_requests, "requests", REQUEST_BYTES
            ),
            "requests.body_bytes": Bound(self.body_bytes, limits.max_body_bytes, "bytes", 1),
        }


def at_capacity(why: str) -> GatewayError:
    """The 503 a request or connection gets at one of the gateway's bounds."""
    return GatewayError(
        503,
        f"the gateway is at capacity ({why}); retry shortly",
        code="gateway_at_capacity",
        headers={"retry-after": str(RETRY_AFTER_S)},
    )
