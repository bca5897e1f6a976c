"""The simulated pod's Responses and Anthropic Messages APIs and its LoRA adapters, driven
over real HTTP by the official ``openai`` and ``anthropic`` clients.

Expected prompt ids come from ``transformers`` directly (the conversion to chat is
held to vLLM's own renderer in ``tests/unit/test_conversions_vllm.py``); event
payloads are decoded with plain msgspec.
"""

from __future__ import annotations

import anthropic
import httpx
import msgspec
import openai
import pytest
import zmq
from transformers import AutoTokenizer

from bench.sim.launch import sim_fleet
from bench.tinymodel import MODEL_NAME, ensure_tokenizer

MODEL = MODEL_NAME
BS = 32
FILLER = "Requests that share a prefix share work. " * 12


@pytest.fixture(scope="module")
def pod():
    with sim_fleet(1, kv_events=True, lora_modules=("sql-lora",),
                   allow_runtime_lora_updating=True) as pods:  # fmt: skip
        yield pods[0]


@pytest.fixture(scope="module")
def ids():
    tok = AutoTokenizer.from_pretrained(str(ensure_tokenizer()))

    def render(messages: list[dict]) -> list[int]:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)

    return render


def cached(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // BS * BS


def test_responses_answer_like_vllm_and_count_the_instructions(pod, ids):
    client = openai.OpenAI(base_url=pod.url + "/v1", api_key="x", max_retries=0)
    args = {"model": MODEL, "instructions": "Be terse.", "input": "responses " + FILLER,
            "max_output_tokens": 3}  # fmt: skip
    prompt = len(ids([{"role": "system", "content": "Be terse."},
                      {"role": "user", "content": args["input"]}]))  # fmt: skip
    first = client.responses.create(**args)
    assert (first.status, first.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert first.output[0].content[0].text and first.model == MODEL
    assert (first.usage.input_tokens, first.usage.output_tokens) == (prompt, 3)
    assert first.usage.input_tokens_details.cached_tokens == 0
    events = list(client.responses.create(**args, stream=True))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 3,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.usage.input_tokens_details.cached_tokens == cached(prompt)
    assert done.output[0].content[0].text == "".join(e.delta for e in events[4:7])


def test_messages_answer_like_vllm_with_cache_reads_apart(pod, ids):
    client = anthropic.Anthropic(base_url=pod.url, api_key="x", max_retries=0)
    args = {"model": MODEL, "system": "Be terse.", "max_tokens": 2,
            "messages": [{"role": "user", "content": "messages " + FILLER}]}  # fmt: skip
    prompt = len(ids([{"role": "system", "content": "Be terse."}, *args["messages"]]))
    first = client.messages.create(**args)
    assert (first.type, first.role, first.stop_reason) == ("message", "assistant", "max_tokens")
    created = prompt // BS * BS
    assert (first.usage.input_tokens, first.usage.cache_creation_input_tokens,
            first.usage.cache_read_input_tokens) == (prompt - created, created, 0)  # fmt: skip
    with client.messages.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.usage.cache_read_input_tokens == cached(prompt)
    assert (
        final.usage.input_tokens
        == prompt - cached(prompt) - final.usage.cache_creation_input_tokens
    )


def test_messages_errors_are_in_anthropics_shape(pod):
    client = anthropic.Anthropic(base_url=pod.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="nope", max_tokens=2,
                               messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "NotFoundError"


def test_an_adapter_is_listed_with_its_parent_and_caches_apart_from_the_base(pod):
    cards = httpx.get(pod.url + "/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(MODEL, None), ("sql-lora", MODEL)]
    prompt = [7] * (4 * BS) + [9]

    def cached_for(model: str) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": 1}
        r = httpx.post(pod.url + "/v1/completions", json=body).json()
        assert r["model"] == model
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert [cached_for("sql-lora"), cached_for(MODEL), cached_for("sql-lora")] == [0, 0, 4 * BS]


def test_adapters_load_and_unload_at_runtime_with_vllms_answers(pod):
    load = {"lora_name": "new-lora", "lora_path": "/adapters/new"}
    r = httpx.post(pod.url + "/v1/load_lora_adapter", json=load)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'new-lora' added successfully.")
    again = httpx.post(pod.url + "/v1/load_lora_adapter", json=load)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    ids_ = [c["id"] for c in httpx.get(pod.url + "/v1/models").json()["data"]]
    assert "new-lora" in ids_
    r = httpx.post(pod.url + "/v1/unload_lora_adapter", json={"lora_name": "new-lora"})
    assert r.status_code == 200
    gone = httpx.post(pod.url + "/v1/unload_lora_adapter", json={"lora_name": "new-lora"})
    assert gone.status_code == 404
    chat = {"model": "new-lora", "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(pod.url + "/v1/chat/completions", json=chat).status_code == 404


def test_an_adapters_blocks_are_published_with_its_name(pod):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(pod.events_endpoint)
    try:
        stored = None
        for i in range(50):  # ZMQ drops what is published before the SUB has joined
            prompt = [100 + i] * (2 * BS) + [5]
            body = {"model": "sql-lora", "prompt": prompt, "max_tokens": 1, "cache_salt": "s"}
            httpx.post(pod.url + "/v1/completions", json=body)
            if sock.poll(200):
                _, _, payload = sock.recv_multipart()
                stored = next(e for e in msgspec.msgpack.decode(payload)[1]
                              if e["type"] == "BlockStored")  # fmt: skip
                break
        assert stored is not None, "no KV event batch"
        assert (stored["lora_id"], stored["lora_name"]) == (1, "sql-lora")
        assert stored["extra_keys"] == [["sql-lora", "s"], ["sql-lora"]]
    finally:
        sock.close(0)
        ctx.term()
