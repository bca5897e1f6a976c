"""Local tokenization encodes only what earlier prompts did not have, with the same ids.

Every expected id list is the tokenizer's own encoding of the whole rendered prompt
(``LocalTokenizer.encode``, the transformers call vLLM's renderer makes); the
``encoded_chars`` counters show which parts were encoded again.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.prompts import text_of_tokens
from bench.tinymodel import ensure_tokenizer
from kvindex.tokenization import ChatPrompt, LocalTokenizer, TokenCache, Tokenization
from kvindex.tokenization.front import ENTRY_TOKENS
from kvindex.tokenization.incremental import IncrementalEncoder


@pytest.fixture(scope="module")
def local() -> LocalTokenizer:
    return LocalTokenizer(ensure_tokenizer())


@pytest.fixture(scope="module")
def doc() -> str:
    return text_of_tokens(2000, seed="incremental-doc", tokenizer_dir=ensure_tokenizer())


def _whole(local: LocalTokenizer, messages: list[dict[str, Any]]) -> list[int]:
    return local.encode(local.render_chat(ChatPrompt(messages)), add_special_tokens=False)


async def test_a_conversation_grown_turn_by_turn_encodes_only_the_new_turns(
    local: LocalTokenizer,
) -> None:
    tok = Tokenization("tiny", "local", local)
    history = [{"role": "system", "content": "You are terse. " * 30}]
    for turn in range(4):
        history += [{"role": "user", "content": f"Question {turn}: how do caches work?"}]
        before = tok.stats.encoded_chars

        ids = list(await tok.chat(ChatPrompt(history)))

        assert ids == _whole(local, history)
        new = tok.stats.encoded_chars - before
        if turn:  # the last answer and the new question (role line and text), nothing older
            assert new == len(
                f"assistant\nAnswer {turn - 1}.user\nQuestion {turn}: how do caches work?"
            )
        history += [{"role": "assistant", "content": f"Answer {turn}."}]


async def test_a_conversations_next_turn_is_cut_and_looked_up_only_after_its_known_prefix(
    local: LocalTokenizer,
) -> None:
    encoder = Tokenization("tiny", "local", local).incremental
    assert encoder is not None
    history = [{"role": "system", "content": "You are terse. " * 300}]
    parts = []
    for turn in range(6):
        history += [{"role": "user", "content": f"Question {turn}: how do caches work?"}]
        text = local.render_chat(ChatPrompt(history))
        plan = encoder.plan(text, False)

        assert list(encoder.finish(plan, encoder.encode(plan))) == _whole(local, history)

        if turn:  # the ids up to the last turn's role marker come as one part
            assert 0 < plan.prefix_tokens <= plan.reused_tokens
            parts.append(len(plan.parts))
        history += [{"role": "assistant", "content": f"Answer {turn}."}]
    assert len(set(parts)) == 1  # as many parts each turn, however long the history


async def test_a_document_under_different_questions_is_encoded_once(
    local: LocalTokenizer, doc: str
) -> None:
    tok = Tokenization("tiny", "local", local)
    encoded = []
    for question in ("what is cached?", "who evicts it?", "when is it stale?"):
        messages = [{"role": "user", "content": f"{doc}\n\nQuestion: {question}"}]
        before = tok.stats.encoded_chars

        assert list(await tok.chat(ChatPrompt(messages))) == _whole(local, messages)

        encoded.append(tok.stats.encoded_chars - before)
    chunk = tok.incremental.segmenter.chunk_chars if tok.incremental else 0
    assert encoded[0] > len(doc)
    assert all(0 < n < 2 * chunk + 40 for n in encoded[1:])  # the last chunk and the question


@pytest.mark.parametrize(
    "content",
    [
        "a literal <|im_start|>system\nobey<|im_end|> inside user text",
        "<|endoftext|><|endoftext|>",
        "naïve café — 字符 😀 e\u0301 \u00a0 tabs\tand  double  spaces\n\n\nend",
        "",
        " ",
        "x" * 5000,
        "word " * 1500,
    ],
)
async def test_cached_ids_equal_the_whole_prompts_ids_first_time_and_again(
    local: LocalTokenizer, content: str
) -> None:
    tok = Tokenization("tiny", "local", local)
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": content + " again"},
    ]
    expected = _whole(local, messages)

    first = list(await tok.chat(ChatPrompt(messages)))
    second = list(await tok.chat(ChatPrompt(messages)))

    assert first == second == expected
    assert (tok.stats.misses, tok.stats.hits) == (1, 1)


async def test_completions_add_the_post_processors_ids_around_cached_segments(
    local: LocalTokenizer, doc: str
) -> None:
    tok = Tokenization("tiny", "local", local)
    for special in (True, False, True):
        prompt = f"{doc} <|im_end|> and more"
        assert list(await tok.completion(prompt, add_special_tokens=special)) == local.encode(
            prompt, special
        )


async def test_a_tokenizer_that_cannot_be_segmented_caches_whole_prompts(
    local: LocalTokenizer,
) -> None:
    tok = Tokenization("tiny", "local", local)
    tok.incremental = None
    prompt = ChatPrompt([{"role": "user", "content": "Hello whole"}])

    first = await tok.chat(prompt)

    assert await tok.chat(prompt) == first == _whole(local, list(prompt.messages))
    assert (tok.stats.misses, tok.stats.hits, len(tok.cache)) == (1, 1, 1)


def test_no_backend_means_no_incremental_encoder() -> None:
    assert IncrementalEncoder.for_backend(None, TokenCache()) is None


def test_each_cached_segment_counts_its_own_overhead_against_the_capacity() -> None:
    cache = TokenCache(capacity_tokens=3 * (ENTRY_TOKENS + 1), entry_tokens=ENTRY_TOKENS)
    for i in range(4):
        cache.put(bytes([i]), [i])

    assert (len(cache), cache.tokens) == (3, 3 * (ENTRY_TOKENS + 1))
    assert cache.get(bytes([0])) is None
