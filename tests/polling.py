"""Waiting on live servers in integration tests, and reading their /metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition", poll: float = 0.05
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


def metric_value(exposition: str, name: str) -> float:
    """Sum of every sample of ``name`` (all label sets) in Prometheus text."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in exposition.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )
