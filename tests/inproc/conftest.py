"""Scripted pods, started in the test's event loop and closed after it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from tests.inproc.scripted_pod import ScriptedPod

StartPod = Callable[..., Awaitable[ScriptedPod]]


@pytest.fixture
async def start_pod() -> AsyncIterator[StartPod]:
    """Start ``ScriptedPod(name, api_key)``; every pod started is closed at teardown."""
    started: list[ScriptedPod] = []

    async def start(name: str, api_key: str | None = None) -> ScriptedPod:
        pod = await ScriptedPod(name, api_key).start()
        started.append(pod)
        return pod

    yield start
    for pod in started:
        await pod.close()


# Round-robin orders pods by name, so a test's first request goes to pod-a.
@pytest.fixture
async def pod_a(start_pod: StartPod) -> ScriptedPod:
    return await start_pod("pod-a")


@pytest.fixture
async def pod_b(start_pod: StartPod) -> ScriptedPod:
    return await start_pod("pod-b")
