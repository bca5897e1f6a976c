"""The admin app: KV events over HTTP, index inspection (``kvgate index``), metrics,
configuration reload.

It is served on its own listener (``admin.host``/``admin.port``, loopback by default),
never on the serving port, and only admin keys open it (``admin.api_keys``; with none
configured the listener must be on loopback, which ``Settings`` enforces). A pod may
post its own events with its ``events_key``. Client keys open nothing here: the index
tells what is cached, so it is an oracle for other tenants' prompts.

Handlers are module-level functions of the request, like ``gateway.app``'s; a
``GatewayError`` raised here becomes an OpenAI-shaped error.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.apis import CACHE_ROUTED
from gateway.auth import bearer_token, key_matches
from gateway.errors import GatewayError
from gateway.http_limits import read_limited
from gateway.in_flight import limits_of
from gateway.kv import EventsNotShared
from gateway.openai_body import parse_body
from gateway.scale_out import kv_aware_strategies
from kvindex.events.http_ingest import BadEventsBody

if TYPE_CHECKING:
    from gateway.state import Gateway
    from routing.core import RoutingCore


def admin_routes() -> list[Route]:
    return [
        Route("/admin/kv-events", kv_events, methods=["POST"]),
        Route("/admin/index/stats", index_stats, methods=["GET"]),
        Route("/admin/index/lookup", index_lookup, methods=["POST"]),
        Route("/admin/bounds", bounds, methods=["GET"]),
        Route("/admin/pods", pods, methods=["GET"]),
        Route("/admin/reload", reload, methods=["POST"]),
    ]


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gw
    return gw


def _admin(request: Request) -> Gateway:
    """The gateway, once the caller holds an admin key (or none is configured: loopback)."""
    gw = _gateway(request)
    keys = gw.settings.admin.api_keys
    if keys and not key_matches(bearer_token(request.headers), keys):
        raise GatewayError(401, "missing or invalid admin key", code="invalid_api_key")
    return gw


async def _body(request: Request, gw: Gateway) -> bytes:
    return await read_limited(
        request, gw.settings.admin.max_body_bytes, gw.settings.timeouts.client_body_s
    )


async def kv_events(request: Request) -> Response:
    """Events in vLLM's batch schema (msgpack or JSON) for pods without ZMQ.

    The pod is named by ``?pod=NAME`` or the ``x-kvgate-pod`` header. An admin key, or
    that pod's own ``events_key``, may post them."""
    gw = _gateway(request)
    name = request.query_params.get("pod") or request.headers.get("x-kvgate-pod")
    pod = gw.registry.get(name or "")
    events_key = pod.config.events_key if pod is not None else None
    if not (events_key and key_matches(bearer_token(request.headers), [events_key])):
        _admin(request)
    if pod is None:
        raise GatewayError(404, f"unknown pod {str(name)[:200]!r}", param="pod")
    body = await _body(request, gw)
    if gw.registry.get(pod.name) is not pod:
        # The pod left while its body was read (a poster sets the pace): applied now, its
        # events would give it an engine map and index entries that nothing drops again.
        raise GatewayError(404, f"pod {pod.name[:200]!r} left the fleet", param="pod")
    try:
        applied = await gw.kv.ingest_http(pod, body, request.headers.get("content-type", ""))
    except (BadEventsBody, ValueError) as exc:
        raise GatewayError(400, f"bad KV event body: {exc}") from None
    except EventsNotShared as exc:  # nothing applied: the poster may send it again
        raise GatewayError(503, f"{exc}; nothing was applied, retry (a smaller body "
                           "if it is over half of scale_out.worker_bus_bytes)",
                           headers={"retry-after": "1"}) from None  # fmt: skip
    return JSONResponse({"applied_ops": applied})


async def index_stats(request: Request) -> Response:
    gw = _admin(request)
    stats = await gw.kv.store.stats()  # after the deferred speculations (kvindex.deferred)
    return JSONResponse(
        {
            "backend": stats.backend,
            "keys": stats.keys,
            "capacity": stats.capacity,
            "l2_keys": stats.l2_keys,
            "per_pod": stats.per_pod,
            # What kv-aware prices evictions by: each pod's scraped L0 size and the
            # blocks its events say it holds (null: not known exactly)
            "l0": {
                pod.name: {
                    "capacity_blocks": pod.engine.kv_capacity_blocks,
                    "held_blocks": gw.kv.l0_blocks_now(pod.name),
                }
                for pod in gw.registry.all()
            },
            "subscribers": _jsonable(gw.kv.subscriber_stats()),
        }
    )


async def index_lookup(request: Request) -> Response:
    """Which pods and tiers hold how many blocks of a prompt: a chat or completion body,
    or the body of the API named by ``"api"`` (``responses``, ``messages``); ``model``
    may be a LoRA adapter."""
    gw = _admin(request)
    raw = await _body(request, gw)
    probe = parse_body(raw, "tokenize")
    kind = probe.body.get("api") or ("chat" if "messages" in probe.body else "completions")
    if not isinstance(kind, str) or kind not in CACHE_ROUTED:
        raise GatewayError(400, f"'api' must be one of {sorted(CACHE_ROUTED)}", param="api")
    parsed = parse_body(raw, kind)
    model = parsed.model or ""
    if model not in gw.registry.known_models():  # no metric series or tokenizer per guess
        raise GatewayError(404, f"unknown model {model[:200]!r}", param="model",
                           code="model_not_found")  # fmt: skip
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


async def reload(request: Request) -> Response:
    """Reload the settings from the sources the gateway started with (``gateway.reload``),
    in every worker; the answer is this worker's: 200 applied (what changed, what needs
    a restart), 422 rejected (why; the running settings stay)."""
    gw = _admin(request)
    if gw.reloader is None:
        raise GatewayError(409, "this gateway has no settings source to reload from")
    result = await gw.reloader.reload_all_workers("POST /admin/reload")
    body = {"result": result.result, "changed": result.changed,
            "needs_restart": result.needs_restart}  # fmt: skip
    if result.result == "rejected":
        return JSONResponse({**body, "reason": result.reason}, status_code=422)
    return JSONResponse(body)


async def pods(request: Request) -> Response:
    """Every pod this worker knows, as routing sees it now (sglang-router's and
    vllm-router's worker listing): whether it is in rotation, the models and adapters it
    serves, the requests routers have in flight on it (with ``--workers`` or shared load,
    every worker's and replica's), the queue gauges last scraped from it, and per model
    how many times its average pod's compute kv-aware prices it at (``speed``; a pod
    not told apart from the average is not listed)."""
    gw = _admin(request)
    load = gw.router.core.load
    listed = []
    for pod in sorted(gw.registry.all(), key=lambda p: p.name):
        counts, engine = load.get(pod.name), pod.engine
        listed.append({
            "name": pod.name,
            "url": pod.url,
            "healthy": pod.healthy,
            "models": sorted(pod.models),
            "in_flight": counts.in_flight,
            "prefilling": counts.prefilling,
            "prefill_tokens": counts.prefill_tokens,
            "engine": {"waiting": engine.waiting, "running": engine.running,
                       "kv_usage": engine.kv_usage,
                       "kv_capacity_blocks": engine.kv_capacity_blocks},
            "failed_probes": pod.failed_probes,
            "failed_requests": pod.failed_requests,
            "speed": pod_speeds(gw.router.core, pod.name),
        })  # fmt: skip
    return JSONResponse({"pods": listed})


def pod_speeds(core: RoutingCore, pod: str) -> dict[str, float]:
    """``pod``'s speed factor per model from the core's kv-aware strategies."""
    speeds: dict[str, float] = {}
    for strategy in kv_aware_strategies(core):
        if strategy.speeds is not None:
            speeds.update(strategy.speeds.of_pod(pod))
    return {model: round(factor, 3) for model, factor in sorted(speeds.items())}


async def bounds(request: Request) -> Response:
    """Every bounded structure's size, capacity and worst-case bytes; the process's RSS
    and open file descriptors (``kvgate bench soak`` samples this every minute)."""
    gw = _admin(request)
    structures = {**gw.kv.bounds(), **gw.router.core.bounds(), **gw.registry.bounds(),
                  **gw.scale.bounds(), **gw.upstream.bounds(),
                  **gw.in_flight.bounds(limits_of(gw.settings)),
                  **request.app.state.client_connections.bounds(),
                  **gw.metrics.bounds(gw.settings.max_requests_in_flight)}  # fmt: skip
    if gw.admission is not None:
        structures.update(gw.admission.bounds())
    return JSONResponse(
        {
            "process": process_usage(),
            "structures": {
                name: {
                    "size": b.size,
                    "capacity": b.capacity,
                    "unit": b.unit,
                    "bytes_each": b.bytes_each,
                    "worst_case_bytes": b.worst_case_bytes,
                }
                for name, b in sorted(structures.items())
            },  # fmt: skip
        }
    )


def process_usage() -> dict[str, int | None]:
    """Resident memory and open file descriptors of this process (Linux /proc)."""
    rss = fds = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    with contextlib.suppress(OSError):
        fds = len(os.listdir("/proc/self/fd"))
    return {"rss_bytes": rss, "open_fds": fds}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return value
