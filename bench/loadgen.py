"""Load generator: sends chat requests through a gateway with the official client.

Closed loop (N concurrent users, each sending its next request when the previous
one finished) or open loop (requests start at given offsets, e.g. Poisson or a
trace's timestamps). Every request streams, so TTFT is the client-observed time to
the first content chunk; usage (with cached tokens) comes from the final chunk.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import openai
from rich.progress import Progress


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
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_cached_tokens: int | None = None
    error: str = ""


async def _one(client: openai.AsyncOpenAI, model: str, i: int, req: ChatRequest) -> RequestResult:
    started = time.perf_counter()
    kwargs: dict[str, object] = {}
    if req.user:
        kwargs["user"] = req.user
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
        result = RequestResult(index=i, ok=True, pod=raw.headers.get("x-kvgate-pod", ""))
        predicted = raw.headers.get("x-kvgate-predicted-cached-tokens")
        result.predicted_cached_tokens = int(predicted) if predicted is not None else None
        stream = raw.parse()
        async for chunk in stream:
            if result.ttft_s == 0.0 and chunk.choices:
                result.ttft_s = time.perf_counter() - started
            if chunk.usage is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                result.cached_tokens = (details.cached_tokens or 0) if details else 0
        result.e2e_s = time.perf_counter() - started
        return result
    except openai.APIError as exc:
        return RequestResult(
            index=i, ok=False, e2e_s=time.perf_counter() - started, error=str(exc)[:200]
        )


async def run_closed_loop(
    base_url: str,
    model: str,
    sessions: Sequence[Sequence[ChatRequest]],
    concurrency: int,
    label: str = "requests",
) -> list[RequestResult]:
    """Each session's requests run in order; up to ``concurrency`` sessions at once."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="kvgate-bench", max_retries=0)
    total = sum(len(s) for s in sessions)
    results: list[RequestResult] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for s in range(len(sessions)):
        queue.put_nowait(s)
    with Progress() as progress:
        task = progress.add_task(label, total=total)

        async def user() -> None:
            while not queue.empty():
                s = queue.get_nowait()
                for req in sessions[s]:
                    results.append(await _one(client, model, len(results), req))
                    progress.advance(task)

        await asyncio.gather(*(user() for _ in range(max(1, concurrency))))
    await client.close()
    return results


async def run_open_loop(
    base_url: str, model: str, requests: Sequence[ChatRequest], label: str = "requests"
) -> list[RequestResult]:
    """Start each request at its ``at_s`` offset regardless of earlier ones."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="kvgate-bench", max_retries=0)
    start = time.perf_counter()
    with Progress() as progress:
        task = progress.add_task(label, total=len(requests))

        async def fire(i: int, req: ChatRequest) -> RequestResult:
            delay = req.at_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            r = await _one(client, model, i, req)
            progress.advance(task)
            return r

        results = await asyncio.gather(*(fire(i, r) for i, r in enumerate(requests)))
    await client.close()
    return list(results)
