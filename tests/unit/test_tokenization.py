"""Local tokenization renders chat like vLLM 0.32 and caches by rendered prompt."""

import threading

import pytest

from bench.tinymodel import ensure_tokenizer
from kvindex.tokenization import (
    ChatPrompt,
    LocalTokenizer,
    TokenCache,
    Tokenization,
    TokenizationError,
    UnsupportedPrompt,
)


@pytest.fixture(scope="module")
def local():
    return LocalTokenizer(ensure_tokenizer())


def test_chat_renders_the_template_with_the_generation_prompt(local):
    text = local.render_chat(ChatPrompt([{"role": "user", "content": "Hi"}]))
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_continue_final_message_leaves_the_last_turn_open(local):
    messages = [{"role": "user", "content": "Write"}, {"role": "assistant", "content": "Once"}]
    prompt = ChatPrompt(messages, add_generation_prompt=False, continue_final_message=True)
    text = local.render_chat(prompt)
    assert text == "<|im_start|>user\nWrite<|im_end|>\n<|im_start|>assistant\nOnce"


def test_text_parts_are_joined_by_newlines_for_string_templates(local):
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    text = local.render_chat(
        ChatPrompt([{"role": "user", "content": parts}], add_generation_prompt=False)
    )
    assert text == "<|im_start|>user\none\ntwo<|im_end|>\n"


def test_developer_turns_become_system_when_the_template_lacks_the_role(local):
    text = local.render_chat(
        ChatPrompt([{"role": "developer", "content": "R"}], add_generation_prompt=False)
    )
    assert text == "<|im_start|>system\nR<|im_end|>\n"


def test_image_parts_are_not_rendered_locally(local):
    parts = [{"type": "image_url", "image_url": {"url": "data:"}}]
    with pytest.raises(UnsupportedPrompt):
        local.render_chat(ChatPrompt([{"role": "user", "content": parts}]))


def test_both_generation_flags_are_refused_like_vllm_does(local):
    with pytest.raises(UnsupportedPrompt):
        local.render_chat(
            ChatPrompt([{"role": "user", "content": "x"}], continue_final_message=True)
        )


async def test_chat_ids_are_the_rendered_text_encoded_without_special_tokens(local):
    tok = Tokenization("tiny", "local", local)
    prompt = ChatPrompt([{"role": "user", "content": "Hello there"}])
    expected = local.encode(local.render_chat(prompt), add_special_tokens=False)
    assert list(await tok.chat(prompt)) == expected
    assert expected[0] == 1  # <|im_start|> is one special token, not its characters


async def test_repeated_prompts_are_served_from_the_cache(local):
    tok = Tokenization("tiny", "local", local)
    prompt = ChatPrompt([{"role": "user", "content": "Hello again"}])
    first = await tok.chat(prompt)
    assert await tok.chat(prompt) == first
    assert (tok.stats.misses, tok.stats.hits) == (1, 1)


async def test_long_prompts_are_encoded_off_the_event_loop_with_the_same_ids(local):
    inline = Tokenization("tiny", "local", local, offload_chars=10**9)
    offloaded = Tokenization("tiny", "local", local, offload_chars=100, offload_max_chars=100)
    prompt = "A cache keeps what was computed. " * 40
    assert await offloaded.completion(prompt) == await inline.completion(prompt)
    assert (offloaded.stats.offloaded, inline.stats.offloaded) == (1, 0)


async def test_many_short_messages_are_rendered_off_the_event_loop(local, monkeypatch):
    """Thousands of empty messages are render work without characters (issue D7)."""
    rendered_on: list[str] = []
    render = local.render_chat

    def spy(prompt: ChatPrompt) -> str:
        rendered_on.append(threading.current_thread().name)
        return render(prompt)

    monkeypatch.setattr(local, "render_chat", spy)
    tok = Tokenization("tiny", "local", local, offload_chars=2048)
    await tok.chat(ChatPrompt.from_body({"messages": [{"role": "user", "content": "hi"}] * 3}))
    await tok.chat(ChatPrompt.from_body({"messages": [{"role": "user", "content": ""}] * 5000}))
    main = threading.main_thread().name
    assert rendered_on[0] == main and rendered_on[1] != main


async def test_local_mode_reports_what_it_cannot_render(local):
    tok = Tokenization("tiny", "local", local)
    with pytest.raises(TokenizationError):
        await tok.chat(ChatPrompt([{"role": "user", "content": [{"type": "input_audio"}]}]))


async def test_auto_mode_without_an_engine_fails_cleanly_on_unsupported_prompts(local):
    tok = Tokenization("tiny", "auto", local)
    with pytest.raises(TokenizationError):
        await tok.chat(ChatPrompt([{"role": "user", "content": [{"type": "input_audio"}]}]))
    assert tok.stats.fallbacks == 1


def test_token_cache_is_bounded_by_the_tokens_it_holds():
    cache = TokenCache(capacity_tokens=5)
    cache.put(b"a", [1, 2, 3])
    cache.put(b"b", [4, 5])
    assert cache.get(b"a") == [1, 2, 3]  # a becomes most recent
    cache.put(b"c", [6])
    assert (cache.get(b"b"), cache.get(b"a"), cache.get(b"c"), cache.tokens) == (
        None,
        [1, 2, 3],
        [6],
        4,
    )
    cache.put(b"huge", list(range(6)))
    assert cache.get(b"huge") is None


def test_a_chat_body_without_options_takes_vllm_defaults():
    messages = [{"role": "user", "content": "Hi"}]
    assert ChatPrompt.from_body({"model": "m", "messages": messages}) == ChatPrompt(
        messages=messages,
        add_generation_prompt=True,
        continue_final_message=False,
        add_special_tokens=False,
        chat_template_kwargs=None,
        tools=None,
        documents=None,
    )


def test_a_chat_body_sets_every_option_and_ill_typed_ones_fall_back_to_defaults():
    messages = [{"role": "user", "content": "Hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    body = {
        "messages": messages,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "add_special_tokens": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": [tool],
        "documents": [{"text": "d"}],
    }
    assert ChatPrompt.from_body(body) == ChatPrompt(
        messages, False, True, True, {"enable_thinking": False}, [tool], [{"text": "d"}]
    )
    ill_typed = {"messages": messages, "chat_template_kwargs": [1], "tools": {}, "documents": "d"}
    assert ChatPrompt.from_body(ill_typed) == ChatPrompt(messages)


def test_the_tokenize_body_omits_empty_options_and_documents_which_tokenize_lacks():
    messages = [{"role": "user", "content": "Hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    prompt = ChatPrompt(messages, chat_template_kwargs={}, tools=[], documents=[{"text": "d"}])
    assert prompt.tokenize_body() == {
        "messages": messages,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "add_special_tokens": False,
    }
    full = ChatPrompt(messages, chat_template_kwargs={"x": 1}, tools=[tool])
    assert full.tokenize_body() == {
        "messages": messages,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "add_special_tokens": False,
        "chat_template_kwargs": {"x": 1},
        "tools": [tool],
    }


def test_documents_and_template_kwargs_from_the_body_reach_the_template():
    template = (
        "{% for d in documents %}[{{ d['text'] }}]{% endfor %}{{ mood }}|"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    local = LocalTokenizer(ensure_tokenizer(), chat_template=template)
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "documents": [{"text": "one"}, {"text": "two"}],
        "chat_template_kwargs": {"mood": "calm"},
    }
    assert local.render_chat(ChatPrompt.from_body(body)) == "[one][two]calm|Hi"
