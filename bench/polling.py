"""Waiting on live servers (benchmarks and tests), and reading their /metrics.

Every "poll until it answers, or give up" loop uses ``wait_for`` (``wait_for_async``
inside an event loop). A predicate may raise to fail fast, e.g. when the process it
waits on has exited, so the caller sees the real cause instead of a timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition", poll: float = 0.05
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that.

    Raises ``TimeoutError`` naming ``what`` once ``timeout`` seconds have passed.
    """
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        _give_up_after(deadline, timeout, what)
        time.sleep(poll)
    return value


async def wait_for_async(
    predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition", poll: float = 0.02
) -> T:
    """``wait_for`` that lets the event loop run between polls."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        _give_up_after(deadline, timeout, what)
        await asyncio.sleep(poll)
    return value


def _give_up_after(deadline: float, timeout: float, what: str) -> None:
    if time.monotonic() >= deadline:
        raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


def http_status(url: str, timeout: float = 1.0) -> int | None:
    """Status of ``GET url``, or None while nothing answers (refused, reset, timed out)."""
    try:
        return httpx.get(url, timeout=timeout).status_code
    except httpx.HTTPError:
        return None


def metric_samples(exposition: str, name: str, **labels: str) -> list[float]:
    """Every sample of ``name`` in Prometheus text whose labels include ``labels`` (none
    given: all label sets), in order. Label values are matched whole, as written
    (``pod="a"``), so none may hold a comma."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    samples: list[float] = []
    for line in exposition.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        head, value = line.rsplit(" ", 1)
        if wanted:
            present = head[len(name) + 1 : -1].split(",") if head.endswith("}") else []
            if not all(w in present for w in wanted):
                continue
        samples.append(float(value))
    return samples


def metric_value(exposition: str, name: str, **labels: str) -> float:
    """Sum of ``metric_samples``: 0 where there is none."""
    return sum(metric_samples(exposition, name, **labels))


def scraped(url: str, name: str, **labels: str) -> list[float]:
    """``metric_samples`` of ``url``'s ``/metrics`` as it answers now."""
    return metric_samples(httpx.get(f"{url}/metrics", timeout=10).text, name, **labels)
