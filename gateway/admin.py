"""Admin endpoints: KV events over HTTP and index inspection (``kvgate index``).

Module-level handlers of the request, like ``gateway.app``'s; a ``GatewayError``
raised here becomes an OpenAI-shaped error through the app's handler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.auth import require_client_key
from gateway.errors import GatewayError
from gateway.openai_body import parse_body
from kvindex.events.http_ingest import BadEventsBody

if TYPE_CHECKING:
    from fastapi import FastAPI

    from gateway.state import Gateway


def add_admin_routes(app: FastAPI) -> None:
    app.router.add_route("/admin/kv-events", kv_events, methods=["POST"])
    app.router.add_route("/admin/index/stats", index_stats, methods=["GET"])
    app.router.add_route("/admin/index/lookup", index_lookup, methods=["POST"])


def _admin(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gw
    require_client_key(request.headers, gw.settings.api_keys)
    return gw


async def kv_events(request: Request) -> Response:
    """Events in vLLM's batch schema (msgpack or JSON) for pods without ZMQ.

    The pod is named by ``?pod=NAME`` or the ``x-kvgate-pod`` header."""
    gw = _admin(request)
    name = request.query_params.get("pod") or request.headers.get("x-kvgate-pod")
    pod = gw.registry.get(name or "")
    if pod is None:
        raise GatewayError(404, f"unknown pod {name!r}", param="pod")
    body = await request.body()
    try:
        applied = await gw.kv.ingest_http(pod, body, request.headers.get("content-type", ""))
    except (BadEventsBody, ValueError) as exc:
        raise GatewayError(400, f"bad KV event body: {exc}") from None
    return JSONResponse({"applied_ops": applied})


async def index_stats(request: Request) -> Response:
    gw = _admin(request)
    stats = await gw.kv.store.stats()
    return JSONResponse(
        {
            "backend": stats.backend,
            "keys": stats.keys,
            "capacity": stats.capacity,
            "l2_keys": stats.l2_keys,
            "per_pod": stats.per_pod,
            "subscribers": _jsonable(gw.kv.subscriber_stats()),
        }
    )


async def index_lookup(request: Request) -> Response:
    """Which pods and tiers hold how many blocks of a prompt (chat or completion)."""
    gw = _admin(request)
    raw = await request.body()
    probe = parse_body(raw, "tokenize")
    kind = "chat" if "messages" in probe.body else "completions"
    parsed = parse_body(raw, kind)
    model = parsed.model or ""
    answer = await gw.kv.lookup(parsed, model, gw.registry.healthy_for(model))
    if answer is None:
        raise GatewayError(400, f"cannot tokenize this prompt for model {model!r}")
    match = answer.match
    return JSONResponse(
        {
            "model": model,
            "block_size": match.block_size,
            "prompt_tokens": answer.prompt_tokens,
            "full_blocks": len(answer.block_keys),
            "keys": [f"{k:016x}" for k in answer.block_keys],
            "pods": {
                pod: {"l0_blocks": p.l0, "l0_l1_blocks": p.l0_l1}
                for pod, p in sorted(match.pods.items())
            },
            "l2_blocks": match.l2,
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
