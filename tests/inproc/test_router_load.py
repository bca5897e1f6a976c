"""The router counts a request's load when it dispatches it, and releases it when done."""

from __future__ import annotations

import asyncio

from bench.polling import wait_for_async
from tests.inproc.harness import inproc_gateway
from tests.inproc.scripted_pod import answer, completion, hang

N = 8


async def test_least_loaded_spreads_held_requests_evenly_and_releases_them(pod_a, pod_b):
    release = asyncio.Event()
    for pod in (pod_a, pod_b):
        pod.default = hang(until=release, then=answer(completion()))
    async with inproc_gateway(pod_a, pod_b, strategy="least-loaded") as g:

        def per_pod() -> list[tuple[int, int, float]]:
            """(held by the pod, router load, in-flight gauge) for pod-a and pod-b."""
            return [
                (len(p.received), g.load(p.name),
                 g.metric("kvgate_pod_in_flight_requests", pod=p.name))
                for p in (pod_a, pod_b)
            ]  # fmt: skip

        calls = [asyncio.create_task(g.chat()) for _ in range(N)]
        await wait_for_async(
            lambda: len(pod_a.received) + len(pod_b.received) == N, 2.0, "N held", poll=0.002
        )
        assert per_pod() == [(N // 2, N // 2, N // 2)] * 2
        release.set()
        responses = await asyncio.gather(*calls)
        assert [r.status_code for r in responses] == [200] * N
        assert per_pod() == [(N // 2, 0, 0)] * 2
