"""Admin endpoints: KV events over HTTP and index inspection (``kvgate index``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from gateway.errors import GatewayError
from gateway.openai_body import parse_body
from kvindex.events.http_ingest import BadEventsBody

if TYPE_CHECKING:
    from gateway.app import Gateway


def add_admin_routes(app: FastAPI, gw: Callable[[Request], Gateway]) -> None:
    @app.post("/admin/kv-events")
    async def kv_events(request: Request) -> Response:
        """Events in vLLM's batch schema (msgpack or JSON) for pods without ZMQ.

        The pod is named by ``?pod=NAME`` or the ``x-kvgate-pod`` header. A
        ``GatewayError`` raised here becomes an OpenAI-shaped error (app handler).
        """
        g = gw(request)
        g.proxy.check_auth(request)
        name = request.query_params.get("pod") or request.headers.get("x-kvgate-pod")
        pod = g.registry.get(name or "")
        if pod is None:
            raise GatewayError(404, f"unknown pod {name!r}", param="pod")
        body = await request.body()
        try:
            applied = await g.kv.ingest_http(pod, body, request.headers.get("content-type", ""))
        except (BadEventsBody, ValueError) as exc:
            raise GatewayError(400, f"bad KV event body: {exc}") from None
        return JSONResponse({"applied_ops": applied})

    @app.get("/admin/index/stats")
    async def index_stats(request: Request) -> Response:
        g = gw(request)
        g.proxy.check_auth(request)
        stats = await g.kv.store.stats()
        return JSONResponse(
            {
                "backend": stats.backend,
                "keys": stats.keys,
                "capacity": stats.capacity,
                "l2_keys": stats.l2_keys,
                "per_pod": stats.per_pod,
                "subscribers": _jsonable(g.kv.subscriber_stats()),
            }
        )

    @app.post("/admin/index/lookup")
    async def index_lookup(request: Request) -> Response:
        """Which pods and tiers hold how many blocks of a prompt (chat or completion)."""
        g = gw(request)
        g.proxy.check_auth(request)
        raw = await request.body()
        probe = parse_body(raw, "tokenize")
        kind = "chat" if "messages" in probe.body else "completions"
        parsed = parse_body(raw, kind)
        model = parsed.model or ""
        lookup = await g.kv.lookup(parsed, model, g.registry.healthy_for(model))
        if lookup is None:
            raise GatewayError(400, f"cannot tokenize this prompt for model {model!r}")
        bs = lookup.match.block_size
        return JSONResponse(
            {
                "model": model,
                "block_size": bs,
                "prompt_tokens": len(lookup.token_ids),
                "full_blocks": len(lookup.keys),
                "keys": [f"{k:016x}" for k in lookup.keys],
                "pods": {
                    pod: {"l0_blocks": p.l0, "l0_l1_blocks": p.l0_l1}
                    for pod, p in sorted(lookup.match.pods.items())
                },
                "l2_blocks": lookup.match.l2,
            }
        )


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return value
