"""A pod lost to its probes while it holds requests (``gateway.awaiting``), in process:
what its requests do when something else stops them at the same moment.

pod-a hangs (its requests get nothing); pod-b answers. Round-robin orders pods by
name, so pod-a is tried first. The test calls ``pod_lost`` as the registry does on a
probe ejection."""

from __future__ import annotations

import asyncio

import pytest

from bench.polling import wait_for_async
from tests.inproc.harness import CHAT, inproc_gateway
from tests.inproc.scripted_pod import hang


def _pod(g, name: str):
    pod = g.gw.registry.get(name)
    assert pod is not None
    return pod


async def test_a_lost_pods_request_goes_to_another_pod(pod_a, pod_b):
    pod_a.script(hang())
    async with inproc_gateway(pod_a, pod_b) as g:
        asking = asyncio.create_task(g.chat(CHAT))
        await wait_for_async(lambda: len(pod_a.received) == 1, timeout=2)
        g.gw.awaiting.pod_lost(_pod(g, "pod-a"))
        r = await asyncio.wait_for(asking, 2)
        assert (r.status_code, r.headers["x-kvgate-pod"]) == (200, "pod-b")


async def test_a_shutdown_that_lands_with_the_pods_loss_is_not_swallowed(pod_a, pod_b):
    """The request is cancelled twice at once: by the lost pod (retry it) and by the
    server's shutdown (stop). The retry must not eat the shutdown's cancellation: the
    request stops, and pod-b never sees it."""
    pod_a.script(hang())
    async with inproc_gateway(pod_a, pod_b) as g:
        asking = asyncio.create_task(g.chat(CHAT))
        await wait_for_async(lambda: len(pod_a.received) == 1, timeout=2)
        g.gw.awaiting.pod_lost(_pod(g, "pod-a"))
        asking.cancel()  # the shutdown, in the same loop iteration
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asking, 2)
        assert len(pod_b.received) == 0
