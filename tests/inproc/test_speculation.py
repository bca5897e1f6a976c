"""When kv-aware's speculative index entries are written. A dispatched prompt counts as
held by its pod at the next lookup, though the memory index is written only then, or
once the response has started, whichever comes first: off the request's way to the pod."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
from prometheus_client import CollectorRegistry

from bench.polling import wait_for_async
from bench.tinymodel import ensure_tokenizer
from gateway.config import PodConfig, Settings
from gateway.kv import KvIndex
from kvindex.store import Removed, Stored
from kvindex.types import Tier
from tests.inproc.harness import inproc_gateway
from tests.inproc.scripted_pod import MODEL, SSE_DONE, delta, sse, stream

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story " * 40}]}


def kv_aware() -> dict:
    model = {"block_size": 16, "tokenizer": str(ensure_tokenizer())}
    return {"strategy": "kv-aware", "models": {MODEL: model}}


async def test_a_prompt_whose_response_has_not_started_is_held_by_its_pod_at_the_next_lookup(
    pod_a,
):
    release = asyncio.Event()  # the head goes out at once, the first token once set
    pod_a.script(stream([sse(delta("x")), SSE_DONE], before_first=release))
    async with inproc_gateway(pod_a, **kv_aware()) as g:
        call = g.stream_chat({**CHAT, "stream": True})
        await wait_for_async(lambda: len(pod_a.received) == 1, 2.0, "the request at the pod")
        bounds = g.gw.kv.bounds()  # read without writing what waits
        assert bounds["index"].size == 0  # not written on its way there
        assert bounds["speculations_deferred"].size == 1

        lookup = (await g.admin.post("/admin/index/lookup", json=CHAT)).json()

        blocks = lookup["full_blocks"]
        assert blocks >= 4
        assert lookup["pods"] == {"pod-a": {"l0_blocks": blocks, "l0_l1_blocks": blocks}}
        release.set()
        await call.finished()


async def test_a_prompts_speculation_is_written_once_its_response_has_started(pod_a):
    pod_a.script(stream([sse(delta("x"))], ending="hold"))
    async with inproc_gateway(pod_a, **kv_aware()) as g:
        call = g.stream_chat({**CHAT, "stream": True})
        await call.received(1)  # the first chunk reached the client; the stream goes on

        stats = await g.gw.kv.store.stats()

        assert stats.keys >= 4
        assert g.gw.kv.bounds()["speculations_deferred"].size == 0
        call.leave()
        await call.finished()


async def test_a_deferred_speculation_does_not_outlive_its_pods_ejection():
    settings = Settings(pods=[PodConfig(name="p", url="http://127.0.0.1:9", models=["m"])])
    async with httpx.AsyncClient() as client:
        kv = KvIndex(settings, CollectorRegistry(), client)
        keys = list(range(1, 9))
        kv.speculate("p", keys)
        assert kv.bounds()["speculations_deferred"].size == 1

        await kv.pod_ejected(SimpleNamespace(name="p"))  # type: ignore[arg-type]

        assert (await kv.store.match(keys, 16)).pods == {}
        assert kv.bounds()["speculations_deferred"].size == 0
        await kv.close()


async def test_a_deferred_speculation_is_written_before_an_event_batch_that_removes_its_keys():
    """Stored then Removed by the pod before the speculation's write: the write must not
    come after them and count the pod as holding what it has just evicted."""
    settings = Settings(pods=[PodConfig(name="p", url="http://127.0.0.1:9", models=["m"])])
    async with httpx.AsyncClient() as client:
        kv = KvIndex(settings, CollectorRegistry(), client)
        keys = list(range(1, 9))
        kv.speculate("p", keys)

        await kv.store.apply("p", [Stored(Tier.L0, keys)])
        await kv.store.apply("p", [Removed(Tier.L0, keys)])

        assert (await kv.store.match(keys, 16)).pods == {}
        await kv.close()
