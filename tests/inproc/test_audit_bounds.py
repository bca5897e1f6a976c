"""Bounds audit: a pod that leaves the fleet leaves nothing behind, even when it leaves
in the middle of a request or of an event post (pods are renamed on every rollout, so
whatever a departed pod's name keeps grows with each one)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from bench.polling import wait_for_async
from tests.inproc.harness import inproc_gateway
from tests.inproc.scripted_pod import answer, completion, hang


async def test_a_pod_removed_with_a_request_in_flight_leaves_no_metric_series(pod_a, pod_b):
    release = asyncio.Event()
    pod_a.script(hang(release, answer(completion())))
    async with inproc_gateway(pod_a, pod_b) as g:
        request = asyncio.create_task(g.chat())  # round-robin: pod-a first
        await wait_for_async(lambda: bool(pod_a.received), 2.0, "the request at pod-a")
        await g.gw.registry.remove("pod-a")
        release.set()
        assert (await request).status_code == 200
        # The request's own series were written after the pod left; they go with it.
        assert g.series(pod="pod-a") == []
        assert (await g.chat()).status_code == 200  # pod-b's series are untouched
        assert g.metric("kvgate_requests_total", pod="pod-b") == 1
        assert g.metric("kvgate_pod_in_flight_requests", pod="pod-b") == 0


async def test_a_pod_back_under_its_name_before_its_last_request_ended_keeps_its_series(
    pod_a, pod_b
):
    release = asyncio.Event()
    pod_a.script(hang(release, answer(completion())))
    async with inproc_gateway(pod_a, pod_b) as g:
        request = asyncio.create_task(g.chat())
        await wait_for_async(lambda: bool(pod_a.received), 2.0, "the request at pod-a")
        await g.gw.registry.remove("pod-a")
        pod = g.gw.registry.add(pod_a.config)
        await g.gw.registry.probe(pod)
        assert (await g.chat()).status_code == 200  # pod-b
        assert (await g.chat()).status_code == 200  # pod-a, back
        release.set()
        assert (await request).status_code == 200
        assert g.metric("kvgate_requests_total", pod="pod-a") == 2
        assert g.metric("kvgate_pod_in_flight_requests", pod="pod-a") == 0


def stored_batch(tokens: list[int]) -> bytes:
    """One KV-event batch as a pod posts it: ``tokens`` in blocks of 16."""
    event = {"type": "BlockStored", "block_hashes": list(range(1, len(tokens) // 16 + 1)),
             "parent_block_hash": None, "token_ids": tokens, "block_size": 16,
             "medium": "GPU", "lora_name": None}  # fmt: skip
    return json.dumps([0.0, [event], None]).encode()


async def test_events_a_pod_posted_as_it_left_are_not_applied(pod_a, pod_b):
    body = stored_batch(list(range(1, 33)))
    removed = asyncio.Event()

    async def slowly() -> AsyncIterator[bytes]:
        yield body[:10]
        await removed.wait()  # the pod leaves while its body is on its way
        yield body[10:]

    async with inproc_gateway(pod_a, pod_b, strategy="kv-aware") as g:
        json_body = {"content-type": "application/json"}
        url = "/admin/kv-events?pod=pod-a"
        post = asyncio.create_task(g.admin.post(url, content=slowly(), headers=json_body))
        await asyncio.sleep(0.05)
        await g.gw.registry.remove("pod-a")
        removed.set()
        r = await post
        assert r.status_code == 404, r.text
        bounds = (await g.admin.get("/admin/bounds")).json()["structures"]
        assert not [name for name in bounds if "pod-a" in name]  # no engine map kept
        stats = (await g.admin.get("/admin/index/stats")).json()
        assert "pod-a" not in stats["per_pod"]
        assert g.series(pod="pod-a") == []
