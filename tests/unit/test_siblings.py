"""What one worker tells its siblings: its speculations (memory index) reach their
indexes, with what is left of the TTL, when a lookup there starts with the same first
key; with Redis they are not sent (Redis has them)."""

from __future__ import annotations

import asyncio
import time
from array import array

import httpx
import pytest
from prometheus_client import CollectorRegistry

from bench.tinymodel import ensure_tokenizer
from gateway import siblings
from gateway.config import PodConfig, Settings
from gateway.host_bus import HostBus
from gateway.kv import KvIndex
from gateway.metrics import GatewayMetrics
from gateway.pods import PodRegistry
from gateway.siblings import (
    EventsWrittenElsewhere,
    SiblingMetrics,
    Siblings,
    decode_events,
    decode_prefix_routed,
    decode_prefix_tokens,
    decode_speculation,
    encode_events,
    encode_prefix_routed,
    encode_prefix_tokens,
    encode_speculation,
)
from kvindex.store import Stored
from kvindex.tokenization.prompt import ChatPrompt
from kvindex.types import PodPrefix, Tier
from routing.core import Candidate, RoutingCore
from routing.types import Reason

KEYS = [0xAB00 + i for i in range(8)]


def test_messages_round_trip():
    assert decode_speculation(encode_speculation("pod-é", KEYS, 12.5)) == ("pod-é", KEYS, 12.5)
    hashes = [2**64 - 1, 0, 7]
    assert decode_prefix_routed(encode_prefix_routed("m/é", "pod-1", hashes)) == (
        "m/é", "pod-1", hashes)  # fmt: skip
    ids = array("I", [0, 1, 2**32 - 1])
    assert decode_prefix_tokens(encode_prefix_tokens("m/é", b"f" * 8, b"k" * 16, ids)) == (
        "m/é", b"f" * 8, b"k" * 16, ids)  # fmt: skip
    body = b"[1.0, [], null]"
    assert decode_events(encode_events("p", body, "application/json")) == (
        "p", body, "application/json")  # fmt: skip


@pytest.fixture
async def workers():
    """Two workers' indexes and siblings, over one bus, in this process."""
    bus = HostBus(workers=2, ring_bytes=64 * 1024)
    settings = Settings(pods=[PodConfig(name="p", url="http://127.0.0.1:9", models=["m"])])
    made = []
    async with httpx.AsyncClient() as client:
        for i in range(2):
            prom = CollectorRegistry()
            kv = KvIndex(settings, prom, client)
            registry = PodRegistry(settings.pods, client, settings.health, GatewayMetrics(prom))
            sib = Siblings(bus.endpoint(i), kv, registry, share_speculation=True,
                           speculative_ttl_s=settings.index.speculative_ttl_s)  # fmt: skip
            kv.peers = sib
            made.append(kv)
        yield made
        for kv in made:
            await kv.close()


async def test_a_speculation_by_one_worker_is_in_the_others_index_at_its_next_lookup(workers):
    a, b = workers
    a.speculate("pod-x", KEYS[:5])
    await b.peers.settle(KEYS)  # what KvIndex.lookup does first

    match = await b.store.match(KEYS, 16)
    assert match.pods == {"pod-x": PodPrefix(5, 5)}


async def test_a_speculation_drained_after_its_ttl_is_dropped(workers):
    a, b = workers
    late = encode_speculation("pod-x", KEYS, time.monotonic() - 0.01)
    a.peers.endpoint.publish(siblings.SPECULATE, late)
    await b.peers.settle(KEYS)
    assert (b.peers.endpoint.received, b.peers.endpoint.bad) == (1, 0)  # handled, not lost
    assert (await b.store.match(KEYS, 16)).pods == {}


async def test_a_speculation_waits_unapplied_until_a_lookup_shares_its_first_key(workers):
    a, b = workers
    other = [0xCD00 + i for i in range(8)]
    a.speculate("pod-x", KEYS[:5])
    a.speculate("pod-y", other[:3])

    await b.peers.settle(other)  # a lookup of another chain: only that one is written
    assert (await b.store.match(KEYS, 16)).pods == {}
    assert (await b.store.match(other, 16)).pods == {"pod-y": PodPrefix(3, 3)}
    assert b.peers.bounds()["siblings.speculations_pending"].size > 0

    await b.peers.settle(KEYS[:2])  # shares the first key: the longer speculation counts
    assert (await b.store.match(KEYS, 16)).pods == {"pod-x": PodPrefix(5, 5)}
    assert b.peers.bounds()["siblings.speculations_pending"].size == 0


async def test_speculations_waiting_for_a_lookup_stay_within_their_byte_bound(workers, monkeypatch):
    a, b = workers
    size = len(encode_speculation("pod-x", KEYS, 0.0))
    monkeypatch.setattr(siblings, "MAX_PENDING_BYTES", 3 * size)
    heads = [[0xE000 + 16 * i + j for j in range(8)] for i in range(5)]
    for keys in heads:
        a.speculate("pod-x", keys)
    b.peers.endpoint.drain()

    assert b.peers.bounds()["siblings.speculations_pending"].size == 3 * size
    assert b.peers.speculations_dropped == 2
    await b.peers.settle(heads[0])  # the oldest went first
    assert (await b.store.match(heads[0], 16)).pods == {}
    await b.peers.settle(heads[4])
    assert (await b.store.match(heads[4], 16)).pods == {"pod-x": PodPrefix(8, 8)}


async def test_a_busy_first_key_sheds_its_expired_speculations(workers):
    a, b = workers
    for _ in range(3):
        a.peers.endpoint.publish(1, encode_speculation("pod-x", KEYS, time.monotonic() - 1))
    a.speculate("pod-y", KEYS[:4])
    b.peers.endpoint.drain()

    pending = b.peers.bounds()["siblings.speculations_pending"].size
    assert pending == len(encode_speculation("pod-y", KEYS[:4], 0.0))


async def test_a_posted_event_body_is_in_the_siblings_index_at_its_next_lookup(workers):
    a, b = workers
    tokens = list(range(100, 132))
    body = (b'[1.0, [{"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": null,'
            b' "token_ids": ' + str(tokens).encode() + b', "block_size": 16, "lora_id": null,'
            b' "medium": "GPU", "lora_name": null}], null]')  # fmt: skip
    pod = a.peers._registry.get("p")
    assert await a.ingest_http(pod, body, "application/json") >= 1
    await b.peers.start()
    try:
        keys = b.keyer("m").keys_for(tokens, None, None)
        await b.peers.settle(keys)  # what KvIndex.lookup does first: no waiting, no polling

        assert (await b.store.match(keys, 16)).pods == {"p": PodPrefix(2, 2)}
    finally:
        await b.peers.stop()


async def test_what_a_worker_could_not_send_or_apply_is_in_its_metrics(workers, monkeypatch):
    """A posted batch a worker drops leaves its index short of what its siblings hold:
    an operator sees it in /metrics, not only in a log line."""
    a, b = workers
    prom_a, prom_b = CollectorRegistry(), CollectorRegistry()
    a.peers.metrics, b.peers.metrics = SiblingMetrics(prom_a), SiblingMetrics(prom_b)
    monkeypatch.setattr(siblings, "MAX_PENDING_BYTES", 1)  # no speculation waits here
    ids = array("I", [0, 1, 2**32 - 1])
    assert decode_prefix_tokens(encode_prefix_tokens("m/é", b"f" * 8, b"k" * 16, ids)) == (
        "m/é", b"f" * 8, b"k" * 16, ids)  # fmt: skip
    body = b"[1.0, [], null]"
    for _ in range(siblings.MAX_QUEUED_BODIES + 3):  # b's applying task is not running
        assert a.peers.events_posted("p", body, "application/json")
    a.speculate("pod-x", KEYS)
    assert not a.peers.events_posted("p", b"x" * a.peers.endpoint.bus.ring_bytes, "text/plain")
    b.peers.endpoint.drain()
    for _ in range(2):  # a second report adds nothing new
        a.peers.report()
        b.peers.report()

    def sample(prom, name, **labels):
        return prom.get_sample_value(name, labels)

    sent = siblings.MAX_QUEUED_BODIES + 4
    assert sample(prom_a, "kvgate_worker_messages_total", outcome="published") == sent
    assert sample(prom_a, "kvgate_worker_messages_total", outcome="refused") == 1
    assert sample(prom_b, "kvgate_worker_messages_total", outcome="received") == sent
    assert sample(prom_b, "kvgate_worker_dropped_total", what="events") == 3
    assert sample(prom_b, "kvgate_worker_dropped_total", what="speculations") == 1
    assert sample(prom_b, "kvgate_worker_ring_overruns_total") == 0


async def test_a_worker_that_does_not_write_events_still_writes_speculation():
    class Recorder:
        def __init__(self):
            self.calls = []

        async def apply(self, pod, ops):
            self.calls.append("apply")

        async def drop_pod(self, pod):
            self.calls.append("drop_pod")

        async def speculate(self, pod, keys, ttl_s):
            self.calls.append("speculate")

    inner = Recorder()
    store = EventsWrittenElsewhere(inner)
    await store.apply("p", [Stored(Tier.L0, KEYS)])
    await store.drop_pod("p")
    await store.speculate("p", KEYS, 1.0)
    assert inner.calls == ["speculate"]


async def test_a_prefix_aware_choice_of_one_worker_is_the_others_choice_too():
    """Each worker's prefix-aware strategy remembers what it chose; a sibling's choices
    reach it over the bus, so the second turn of a conversation goes where the first
    went whichever worker the kernel gave it to."""
    bus = HostBus(workers=2, ring_bytes=64 * 1024)
    settings = Settings(pods=[PodConfig(name="p", url="http://127.0.0.1:9", models=["m"])])
    pods = [Candidate(f"pod-{i}") for i in range(4)]
    cores, sibs = [], []
    async with httpx.AsyncClient() as client:
        for i in range(2):
            prom = CollectorRegistry()
            kv = KvIndex(settings, prom, client)
            registry = PodRegistry(settings.pods, client, settings.health, GatewayMetrics(prom))
            core = RoutingCore.from_config("prefix-aware", {})
            sibs.append(Siblings(bus.endpoint(i), kv, registry, share_speculation=True,
                                 speculative_ttl_s=3.0, core=core))  # fmt: skip
            cores.append(core)
        first_turn, second_turn = [11, 12, 13], [11, 12, 13, 14]

        def route(worker: int, hashes: list[int]):
            sibs[worker].drain()
            routed = cores[worker].route(cores[worker].request("m", prefix_hashes=lambda: hashes),
                                         pods, None)  # fmt: skip
            sibs[worker].routed(routed)
            cores[worker].finish(routed, None)
            return routed

        # Worker 0 takes the first turn to a pod other than where worker 1's empty
        # memory would send it (its least loaded, in order: pod-0), ...
        for busy in range(3):  # worker 0's own requests on pod-0..2 make pod-3 its choice
            cores[0].load.start(f"pod-{busy}", 0)
        chosen = route(0, first_turn).pod
        assert chosen == "pod-3"
        # ... and worker 1 sends the second turn there, as a cache hit.
        second = route(1, second_turn)
        assert (second.pod, second.decision.reason) == ("pod-3", Reason.CACHE_HIT)


async def test_events_being_written_as_their_pod_leaves_leave_no_entries(workers):
    """A batch's write that ends after its pod left (a Redis round trip, here held)
    would put back entries ``pod_removed`` had dropped, and nothing would drop them."""
    a, _ = workers

    class HeldWrites:  # the real store, its writes held until released
        def __init__(self, inner) -> None:
            self.inner = inner
            self.release = asyncio.Event()

        async def apply(self, pod, ops) -> None:
            await self.release.wait()
            await self.inner.apply(pod, ops)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    a.store = held = HeldWrites(a.store)
    tokens = list(range(100, 132))
    body = (b'[1.0, [{"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": null,'
            b' "token_ids": ' + str(tokens).encode() + b', "block_size": 16, "lora_id": null,'
            b' "medium": "GPU", "lora_name": null}], null]')  # fmt: skip
    pod = a.peers._registry.get("p")
    posting = asyncio.create_task(a.apply_http_events(pod, body, "application/json"))
    await asyncio.sleep(0.01)
    await a.pod_removed("p")
    held.release.set()
    await posting
    keys = a.keyer("m").keys_for(tokens, None, None)
    assert (await a.store.match(keys, 16)).pods == {}


SYSTEM = "You answer questions about the harbour's tide tables. " * 40


def _turns(n: int) -> list[dict[str, str]]:
    """A conversation of ``n`` questions, the last unanswered."""
    messages = [{"role": "system", "content": SYSTEM}]
    for i in range(n):
        messages.append({"role": "user", "content": f"When is high water on day {i}? " * 8})
        if i < n - 1:
            messages.append({"role": "assistant", "content": f"On day {i} at noon. " * 8})
    return messages


@pytest.mark.parametrize("case", ["shared", "not shared", "another tokenizer"])
async def test_a_conversations_next_turn_on_the_other_worker_encodes_only_what_is_new(case):
    """Worker 0 tokenizes turn 2 of a conversation; its sibling, given turn 3 (a new
    connection the kernel gave it), takes turn 2's ids from the bus and encodes only the
    answer and question after them. Without the bus, or when the sibling's settings name
    another tokenizer for the model (a reload that reached one worker first), it encodes
    the conversation from its start. Either way the ids are the tokenizer's own."""
    bus = HostBus(workers=2, ring_bytes=256 * 1024)
    kvs, sibs = [], []
    async with httpx.AsyncClient() as client:
        for i in range(2):
            mode = "local" if case == "another tokenizer" and i == 1 else "auto"
            settings = Settings(
                pods=[PodConfig(name="p", url="http://127.0.0.1:9", models=["tiny"])],
                models={"tiny": {"tokenizer": str(ensure_tokenizer()), "tokenizer_mode": mode}},
            )
            prom = CollectorRegistry()
            kv = KvIndex(settings, prom, client)
            registry = PodRegistry(settings.pods, client, settings.health, GatewayMetrics(prom))
            sib = Siblings(bus.endpoint(i), kv, registry, share_speculation=True,
                           speculative_ttl_s=3.0)  # fmt: skip
            if case != "not shared":
                kv.tokens.share_prefixes(sib.prefix_tokenized)  # as gateway.scale_out does
            kvs.append(kv)
            sibs.append(sib)
        first, second = (kv.tokens.tokenization("tiny") for kv in kvs)
        await first.chat(ChatPrompt(messages=_turns(2)))
        sibs[1].drain()
        third_turn = ChatPrompt(messages=_turns(3))
        ids = await second.chat(third_turn)

        assert list(ids) == first.local.encode(first.local.render_chat(third_turn), False)
        new_text = sum(len(m["content"]) for m in _turns(3)[-2:])
        if case == "shared":
            assert second.stats.prefix_tokens > 0
            assert second.stats.encoded_chars < 1.5 * new_text
        else:
            assert second.stats.prefix_tokens == 0
            assert second.stats.encoded_chars > len(SYSTEM)
        if case == "another tokenizer":
            assert sibs[1].endpoint.received == 1  # it came, and was left out
        for kv in kvs:
            await kv.close()


async def test_a_first_turn_is_not_sent_to_the_siblings():
    """A chat with no answer in it yet (most are never extended: a new question on a
    shared system prompt) costs the siblings nothing."""
    bus = HostBus(workers=2, ring_bytes=256 * 1024)
    settings = Settings(models={"tiny": {"tokenizer": str(ensure_tokenizer())}})
    async with httpx.AsyncClient() as client:
        kv = KvIndex(settings, CollectorRegistry(), client)
        registry = PodRegistry([], client, settings.health, GatewayMetrics(CollectorRegistry()))
        sib = Siblings(bus.endpoint(0), kv, registry, share_speculation=True,
                       speculative_ttl_s=3.0)  # fmt: skip
        kv.tokens.share_prefixes(sib.prefix_tokenized)
        tok = kv.tokens.tokenization("tiny")
        await tok.chat(ChatPrompt(messages=_turns(1)))
        assert sib.endpoint.published == 0
        await tok.chat(ChatPrompt(messages=_turns(2)))
        assert sib.endpoint.published == 1
        await kv.close()
