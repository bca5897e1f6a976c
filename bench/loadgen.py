"""Load generator: sends chat requests through a router with the official client.

Closed loop (N concurrent users, each sending its next request when the previous
one finished) or open loop (requests start at given offsets, e.g. Poisson or a
trace's timestamps, whether or not earlier ones finished). Given several router
URLs (gateway replicas), each request goes to one picked at random, as a Kubernetes
Service spreads connections over its endpoints (seeded: the same run picks alike);
``RequestResult.gateway`` says which. Every request streams,
so TTFT is the client-observed time to the first content chunk; usage (with
cached tokens) comes from the final chunk. Prompt text is never kept in results.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import openai
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

# usage.prompt_tokens_details keys vLLM defines; any other integer key there
# (a simulator's per-tier split, say) is kept in RequestResult.details.
_STANDARD_DETAILS = {"cached_tokens", "audio_tokens", "created_cache_tokens", "multimodal_tokens"}


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]
    max_tokens: int = 16
    user: str | None = None  # a session key the `session` strategy may use
    at_s: float = 0.0  # open loop: start offset from the run's start
    extra: dict[str, object] = field(default_factory=dict)


@dataclass
class RequestResult:
    index: int
    ok: bool
    pod: str = ""
    sent_s: float = 0.0  # offset from the run's start
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached_tokens: int | None = None
    predicted_ttft_s: float | None = None  # kvgate's prediction (x-kvgate-predicted-ttft-ms)
    details: dict[str, int] = field(default_factory=dict)
    error: str = ""
    gateway: int = 0  # which of the router URLs served it


class Spread:
    """One client per router URL; ``pick`` chooses one at random (seeded), like a
    Kubernetes Service choosing an endpoint for a new connection."""

    def __init__(self, base_urls: str | Sequence[str], seed: int = 0) -> None:
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        self.clients = [make_client(u) for u in urls]
        self._rng = random.Random(seed)

    def pick(self) -> tuple[int, openai.AsyncOpenAI]:
        i = self._rng.randrange(len(self.clients)) if len(self.clients) > 1 else 0
        return i, self.clients[i]

    async def close(self) -> None:
        for client in self.clients:
            await client.close()


def make_client(base_url: str, timeout_s: float = 300.0) -> openai.AsyncOpenAI:
    """One client per run: no retries (a retry would hide errors), generous pool."""
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    return openai.AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key="kvgate-bench",
        max_retries=0,
        timeout=timeout_s,
        http_client=httpx.AsyncClient(limits=limits, timeout=timeout_s),
    )


def _usage(result: RequestResult, usage: object) -> None:
    result.prompt_tokens = int(getattr(usage, "prompt_tokens", 0) or 0)
    details = getattr(usage, "prompt_tokens_details", None)
    if details is None:
        return
    result.cached_tokens = int(getattr(details, "cached_tokens", 0) or 0)
    extra = getattr(details, "model_extra", None) or {}
    for key, value in extra.items():
        if key not in _STANDARD_DETAILS and isinstance(value, int):
            result.details[key] = value


async def send_one(
    client: openai.AsyncOpenAI, model: str, i: int, req: ChatRequest, t0: float
) -> RequestResult:
    """Stream one chat completion and measure it; errors become results, never raise."""
    started = time.perf_counter()
    result = RequestResult(index=i, ok=True, sent_s=started - t0)
    kwargs: dict[str, object] = {"user": req.user} if req.user else {}
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=model,
            messages=req.messages,  # type: ignore[arg-type]
            max_tokens=req.max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=req.extra or None,
            **kwargs,  # type: ignore[arg-type]
        )
        result.pod = raw.headers.get("x-kvgate-pod", "")
        predicted = raw.headers.get("x-kvgate-predicted-cached-tokens")
        result.predicted_cached_tokens = int(predicted) if predicted is not None else None
        predicted_ttft = raw.headers.get("x-kvgate-predicted-ttft-ms")
        if predicted_ttft is not None:
            result.predicted_ttft_s = float(predicted_ttft) / 1000
        async for chunk in raw.parse():
            if result.ttft_s == 0.0 and chunk.choices:
                result.ttft_s = time.perf_counter() - started
            if chunk.usage is not None:
                _usage(result, chunk.usage)
    except (openai.APIError, httpx.HTTPError) as exc:
        result.ok = False
        result.error = f"{type(exc).__name__}: {str(exc)[:160]}"
    result.e2e_s = time.perf_counter() - started
    if result.ok and result.ttft_s == 0.0:
        result.ttft_s = result.e2e_s  # no content chunk: the whole answer was the first byte
    return result


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("errors {task.fields[errors]}"),
        TimeElapsedColumn(),
        transient=True,
    )


async def run_closed_loop(
    base_url: str | Sequence[str],
    model: str,
    sessions: Sequence[Sequence[ChatRequest]],
    concurrency: int,
    label: str = "requests",
    seed: int = 0,
) -> list[RequestResult]:
    """Each session's requests run in order; up to ``concurrency`` sessions at once."""
    spread = Spread(base_url, seed)
    total = sum(len(s) for s in sessions)
    results: list[RequestResult] = []
    pending = list(range(len(sessions)))[::-1]
    sent = errors = 0
    t0 = time.perf_counter()
    with _progress() as progress:
        task = progress.add_task(label, total=total, errors=0)

        async def user() -> None:
            nonlocal sent, errors
            while pending:
                for req in sessions[pending.pop()]:
                    sent += 1
                    gateway, client = spread.pick()
                    r = await send_one(client, model, sent - 1, req, t0)
                    r.gateway = gateway
                    results.append(r)
                    errors += not r.ok
                    progress.update(task, advance=1, errors=errors)

        await asyncio.gather(*(user() for _ in range(max(1, concurrency))))
    await spread.close()
    return sorted(results, key=lambda r: r.index)


async def run_open_loop(
    base_url: str | Sequence[str],
    model: str,
    requests: Sequence[ChatRequest],
    label: str = "requests",
    seed: int = 0,
) -> list[RequestResult]:
    """Start each request at its ``at_s`` offset regardless of earlier ones."""
    spread = Spread(base_url, seed)
    t0 = time.perf_counter()
    errors = 0
    with _progress() as progress:
        task = progress.add_task(label, total=len(requests), errors=0)

        async def fire(i: int, req: ChatRequest) -> RequestResult:
            nonlocal errors
            delay = req.at_s - (time.perf_counter() - t0)
            gateway, client = spread.pick()
            if delay > 0:
                await asyncio.sleep(delay)
            r = await send_one(client, model, i, req, t0)
            r.gateway = gateway
            errors += not r.ok
            progress.update(task, advance=1, errors=errors)
            return r

        results = await asyncio.gather(*(fire(i, r) for i, r in enumerate(requests)))
    await spread.close()
    return list(results)
