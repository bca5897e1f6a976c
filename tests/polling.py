"""Waiting on live servers in integration tests, and reading their /metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition", poll: float = 0.05
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that."""
    expired = _deadline(timeout, what)
    while not (value := predicate()):
        expired()
        time.sleep(poll)
    return value


async def wait_until(
    predicate: Callable[[], T], timeout: float = 2.0, what: str = "condition", poll: float = 0.002
) -> T:
    """``wait_for`` for tests whose servers run in the test's own event loop."""
    expired = _deadline(timeout, what)
    while not (value := predicate()):
        expired()
        await asyncio.sleep(poll)
    return value


def _deadline(timeout: float, what: str) -> Callable[[], None]:
    """A check that raises once ``timeout`` seconds have passed since this call."""
    deadline = time.monotonic() + timeout

    def expired() -> None:
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    return expired


def metric_value(exposition: str, name: str) -> float:
    """Sum of every sample of ``name`` (all label sets) in Prometheus text."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in exposition.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )
