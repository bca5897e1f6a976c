"""EngineTokenizer and auto-mode fallback against a real HTTP /tokenize on loopback.

The server below answers like vLLM's /tokenize using the tiny model's tokenizer, so
the ids it returns are what the local path would compute.
"""

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.polling import wait_for_async
from bench.ports import free_port
from bench.tinymodel import ensure_tokenizer
from kvindex.tokenization import (
    ChatPrompt,
    EngineTokenizer,
    LocalTokenizer,
    Tokenization,
    TokenizationError,
)
from kvindex.tokenization.front import TokenCache


@pytest.fixture(scope="module")
def local():
    return LocalTokenizer(ensure_tokenizer())


@pytest.fixture
async def engine_url(local):
    app = FastAPI()
    seen: list[dict] = []

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        seen.append(body)
        if body.get("model") == "broken":
            return JSONResponse({"error": "boom"}, status_code=500)
        if body.get("model") == "bad-ids":
            return {"tokens": [1, -1, 2**40]}
        if body.get("model") == "too-many":  # more ids than the prompt's bytes could make
            return {"tokens": [0] * (len(body["prompt"]) + 10_000)}
        if body.get("model") == "drip":  # each byte in time, the whole answer never

            async def dripped() -> AsyncIterator[bytes]:
                for byte in b'{"tokens": [1, 2, 3]}':
                    yield bytes([byte])
                    await asyncio.sleep(0.1)

            return StreamingResponse(dripped(), media_type="application/json")
        if "messages" in body:
            text_only = [
                {**m, "content": m["content"] if isinstance(m["content"], str) else "[media]"}
                for m in body["messages"]
            ]
            text = local.render_chat(ChatPrompt(text_only))
            return {"tokens": local.encode(text, body["add_special_tokens"]), "count": 0}
        ids = local.encode(body["prompt"], body["add_special_tokens"])
        if body.get("model") == "shifted":  # another model's vocabulary
            ids = [i + 1 for i in ids]
        return {"tokens": ids}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    task = asyncio.create_task(server.serve())

    def started() -> bool:
        if task.done():
            task.result()  # raises what stopped the server before it started
            raise AssertionError("the tokenizer server exited before it started")
        return server.started

    await wait_for_async(started, timeout=10.0, what="the tokenizer server", poll=0.01)
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    await task


async def test_engine_mode_asks_the_pod_with_vllm_request_fields(engine_url, local):
    url, seen = engine_url
    engine = EngineTokenizer(url)
    tok = Tokenization("tiny", "engine", engine=engine)
    messages = [{"role": "user", "content": "Hi"}]
    prompt = ChatPrompt(messages)
    assert await tok.chat(prompt) == local.encode(local.render_chat(prompt), False)
    assert seen == [
        {
            "model": "tiny",
            "messages": messages,
            "add_generation_prompt": True,
            "continue_final_message": False,
            "add_special_tokens": False,
        }
    ]
    await tok.chat(prompt)
    assert (tok.stats.engine, tok.stats.hits, len(seen)) == (1, 1, 1)
    await engine.aclose()


async def test_auto_mode_falls_back_to_the_engine_for_prompts_it_cannot_render(engine_url, local):
    url, _ = engine_url
    engine = EngineTokenizer(url)
    tok = Tokenization("tiny", "auto", local, engine)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    expected = local.encode(
        local.render_chat(ChatPrompt([{"role": "user", "content": "[media]"}])), False
    )
    assert await tok.chat(ChatPrompt(messages)) == expected
    assert (tok.stats.fallbacks, tok.stats.engine, tok.stats.local) == (1, 1, 0)
    await engine.aclose()


async def test_completion_via_engine_adds_special_tokens_by_default(engine_url, local):
    url, seen = engine_url
    engine = EngineTokenizer(url)
    ids = await Tokenization("tiny", "engine", engine=engine).completion("plain text")
    assert ids == local.encode("plain text", True)
    assert seen[-1] == {"model": "tiny", "prompt": "plain text", "add_special_tokens": True}
    await engine.aclose()


async def test_models_sharing_a_cache_keep_their_own_engine_answers(engine_url, local):
    """The gateway's models without a local tokenizer share one cache of the pods'
    answers: the same prompt for another model is asked again and kept apart."""
    url, seen = engine_url
    engine = EngineTokenizer(url)
    shared = TokenCache()
    tiny, shifted = (Tokenization(m, "engine", engine=engine, cache=shared)
                     for m in ("tiny", "shifted"))  # fmt: skip
    expected = local.encode("plain text", True)
    for _ in range(2):  # asked once each, then from the shared cache
        assert await tiny.completion("plain text") == expected
        assert await shifted.completion("plain text") == [i + 1 for i in expected]
    assert [body["model"] for body in seen] == ["tiny", "shifted"]
    assert tiny.cache is shifted.cache and len(shared) == 2
    await engine.aclose()


async def test_engine_errors_and_unreachable_pods_raise_tokenization_error(engine_url):
    url, _ = engine_url
    broken = Tokenization("broken", "engine", engine=EngineTokenizer(url))
    with pytest.raises(TokenizationError):
        await broken.completion("x")
    gone = Tokenization("tiny", "engine", engine=EngineTokenizer(f"http://127.0.0.1:{free_port()}"))
    with pytest.raises(TokenizationError):
        await gone.completion("x")


@pytest.mark.parametrize("model", ["bad-ids", "too-many"])
async def test_ids_no_prompt_could_make_are_a_tokenization_error(engine_url, model):
    url, _ = engine_url
    engine = EngineTokenizer(url)
    with pytest.raises(TokenizationError):
        await Tokenization(model, "engine", engine=engine).completion("x" * 100)
    await engine.aclose()


async def test_an_answer_dripped_past_the_timeout_is_a_tokenization_error(engine_url):
    url, _ = engine_url
    engine = EngineTokenizer(url, timeout_s=0.5)  # each byte comes within it, all never
    started = time.monotonic()
    with pytest.raises(TokenizationError):
        await Tokenization("drip", "engine", engine=engine).completion("x")
    assert time.monotonic() - started < 1.5
    await engine.aclose()
